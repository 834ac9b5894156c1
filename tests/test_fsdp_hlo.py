"""FSDP moves 16-bit weights and sums gradients in fp32: in the train step of a bf16 model under data2 x fsdp4, as
XLA's SPMD partitioner leaves it, every weight (the embedding table and a tied head included) is gathered in bf16,
cast on its shard, and every gradient's partial sums are reduced in fp32, the head's too when it runs in chunks of
the sequence (`train.loss_chunks`). (The CPU backend later widens bf16 collectives to fp32, so the program is read
right after partitioning.)"""
import re

import pytest

from mlm_jax import Trainer, load_config


@pytest.mark.parametrize("overrides", [["model.tie_embeddings=false", "model.scan_layers=true"],
                                       ["model.tie_embeddings=true", "model.scan_layers=false"],
                                       ["model.tie_embeddings=false", "train.loss_chunks=4"],
                                       ["model.tie_embeddings=true", "train.loss_chunks=4"]])
def test_fsdp_gathers_bf16_and_reduces_fp32(tmp_path, overrides):
    cfg = load_config(None, ["model.dtype=bfloat16", "parallel.data=2", "parallel.fsdp=4", "train.steps=1",
                             f"train.output_dir={tmp_path}", "log.progress=never", "train.eval_every=0", *overrides])
    dump = tmp_path / "hlo"
    Trainer(cfg).lowered_step().compile(compiler_options={
        "xla_dump_to": str(dump), "xla_dump_hlo_pass_re": "spmd-partitioning", "xla_dump_hlo_module_re": "jit_step"})
    (partitioned,) = dump.glob("*jit_step*after_spmd-partitioning*.txt")
    text = partitioned.read_text()
    gathers = re.findall(r"= (\w+)\[[^\]]*\]\S* all-gather(?:-start)?\(", text)
    reductions = re.findall(r"= (\w+)\[[^\]]*\]\S* (?:all-reduce|reduce-scatter)(?:-start)?\(", text)
    # at least the seven dense weights of a layer (gathered inside the loop body of scanned layers) and the table
    assert len(gathers) >= 8 and set(gathers) == {"bf16"}, sorted(gathers)
    assert len(reductions) >= 8 and set(reductions) == {"f32"}, sorted(reductions)
