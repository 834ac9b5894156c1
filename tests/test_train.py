"""The training loop end to end: CLI outputs, metrics, non-finite skipping, the model API."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import yaml

from mlm_jax import Trainer, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["train.steps=4", "train.log_every=2", "train.eval_every=4", "train.eval_batches=2",
         "train.global_batch_size=8", "train.seq_len=32", "data.max_bytes=2000000", "log.progress=never"]


def test_cli_writes_config_and_metrics(tmp_path):
    out = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "mlm_jax.train", "--config", "configs/tiny.yaml", *SMALL,
                             f"train.output_dir={out}", "log.sharding_report=true"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "rules (first match wins)" in result.stdout and "blocks/attn/q/kernel" in result.stdout
    assert "kernels: attention: xla (cudnn: cuDNN attention needs an NVIDIA GPU" in result.stdout
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["train"]["steps"] == 4 and saved["name"] == "tiny"
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "loss" in r]
    assert [r["step"] for r in train] == [2, 4]
    for r in train:
        for key in ("step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops_per_device", "mfu", "step_time_s",
                    "skipped_steps"):
            assert key in r, key
        assert r["mfu"] is None and r["tokens_per_s"] > 0 and r["skipped_steps"] == 0
    assert [r["step"] for r in lines if "eval_loss" in r] == [4]


def test_non_finite_gradients_skip_the_update_and_are_counted(tmp_path):
    trainer = Trainer(load_config(None, SMALL + [f"train.output_dir={tmp_path}", "train.eval_every=0"]))
    params = trainer.state.params
    poisoned = dict(params, final_norm={"scale": params["final_norm"]["scale"] * jnp.nan})
    trainer.state = trainer.state._replace(params=poisoned)
    before = jax.device_get(trainer.state.params["head"]["kernel"])
    records = trainer.fit(steps=2)
    assert records[-1]["skipped_steps"] == 2
    assert records[-1]["loss"] is None  # non-finite values are written as null
    np.testing.assert_array_equal(jax.device_get(trainer.state.params["head"]["kernel"]), before)
    assert int(trainer.state.step) == 2


def test_model_api_returns_logits_and_fit_continues(tmp_path):
    trainer = Trainer(load_config(None, SMALL + [f"train.output_dir={tmp_path}", "train.eval_every=0"]))
    trainer.fit(steps=2)
    tokens_BS = jnp.zeros((2, 16), jnp.int32)
    assert trainer.model(tokens_BS).shape == (2, 16, 512)
    trainer.fit()
    assert int(trainer.state.step) == 4
    assert np.isfinite(trainer.evaluate())


def test_learning_rate_schedules():
    from mlm_jax.train.optimizer import schedule
    o = load_config(None, ["optim.lr=1.0", "optim.min_lr=0.1", "optim.warmup_steps=10"]).optim
    cos = schedule(o, 110)
    assert float(cos(0)) == 0.0 and abs(float(cos(10)) - 1.0) < 1e-6 and abs(float(cos(110)) - 0.1) < 1e-6
    wsd = schedule(o.__class__(**{**o.__dict__, "schedule": "wsd", "decay_fraction": 0.2}), 110)
    assert abs(float(wsd(80)) - 1.0) < 1e-6 and abs(float(wsd(110)) - 0.1) < 1e-6
    const = schedule(o.__class__(**{**o.__dict__, "schedule": "constant"}), 110)
    assert abs(float(const(5)) - 0.5) < 1e-6 and float(const(100)) == 1.0


def test_norms_and_biases_get_no_weight_decay():
    from mlm_jax.train.optimizer import decay_mask
    mask = decay_mask({"final_norm": {"scale": 1, "bias": 2}, "head": {"kernel": 3}})
    assert mask == {"final_norm": {"scale": False, "bias": False}, "head": {"kernel": True}}


def test_profile_steps_write_a_trace_of_those_steps(tmp_path, capsys):
    import gzip
    cfg = load_config(None, SMALL + [f"train.output_dir={tmp_path}", "train.eval_every=0", "log.profile_steps=[2,3]"])
    Trainer(cfg, devices=jax.devices()[:1]).fit()
    assert "profile of steps 2..3 written to" in capsys.readouterr().out
    traces = list((tmp_path / "profile").rglob("*.trace.json.gz"))
    assert traces
    events = json.load(gzip.open(traces[0], "rt"))["traceEvents"]
    assert any("step" in e.get("name", "") for e in events)  # the compiled step ran inside the trace


def test_bf16_moments_round_only_the_stored_moments():
    """Two AdamW steps with the moments stored in bf16 between them: the second update is exactly the fp32
    optimizer's from its first state rounded to bf16 (the rounding is all that changes, and it changes something),
    and the stored moments are bf16."""
    from mlm_jax.train.optimizer import make_optimizer
    keys = iter(jax.random.split(jax.random.key(0), 6))
    tree = lambda: {"w": jax.random.normal(next(keys), (64, 32)),  # noqa: E731
                    "norm": {"scale": jax.random.normal(next(keys), (32,))}}
    params, grads1, grads2 = tree(), tree(), tree()
    rounded = lambda state: jax.tree.map(  # noqa: E731
        lambda x: x.astype(jnp.bfloat16).astype(x.dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    optimizers = {dtype: make_optimizer(load_config(None, [f"optim.moments_dtype={dtype}"]).optim, 10)
                  for dtype in ("float32", "bfloat16")}
    states = {dtype: tx.update(grads1, tx.init(params), params)[1] for dtype, tx in optimizers.items()}
    assert {x.dtype for x in jax.tree.leaves(states["bfloat16"]) if x.ndim} == {jnp.dtype(jnp.bfloat16)}
    got = optimizers["bfloat16"].update(grads2, states["bfloat16"], params)[0]
    want = optimizers["float32"].update(grads2, rounded(states["float32"]), params)[0]
    unrounded = optimizers["float32"].update(grads2, states["float32"], params)[0]
    for g, w, u in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(unrounded)):
        np.testing.assert_array_equal(g, w)
        assert not np.array_equal(g, u)


def test_bf16_moments_train_under_zero1(tmp_path):
    trainer = Trainer(load_config(None, SMALL + [f"train.output_dir={tmp_path}", "train.eval_every=0",
                                                 "optim.moments_dtype=bfloat16", "parallel.data=2", "parallel.fsdp=4",
                                                 "parallel.shard_optimizer=true"]))
    records = trainer.fit(steps=2)
    assert np.isfinite(records[-1]["loss"])
    moments = [x for x in jax.tree.leaves(trainer.state.opt_state) if x.ndim]
    assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.bfloat16)}


def _products(overrides: list[str], devices: int, tmp_path, config: str | None = None) -> tuple[int, int]:
    """(the products in the lowered train step, the model's layers)."""
    cfg = load_config(config, ["model.dtype=bfloat16", "model.scan_layers=false", "train.global_batch_size=8",
                               "train.seq_len=32", "data.max_bytes=2000000", f"train.output_dir={tmp_path}",
                               *overrides])
    trainer = Trainer(cfg, devices=jax.devices()[:devices])
    return trainer.lowered_step().as_text().count("stablehlo.dot_general"), cfg.model.num_layers


def test_remat_dots_recomputes_no_product_but_attentions(tmp_path):
    """`model.remat=dots` keeps every product but attention's two of each layer (batched products on the XLA path; on
    a GPU, one cuDNN call), whichever kernel makes it: the custom-VJP products of per-layer accumulation and of FSDP's
    master weights, and the experts' grouped products, which a policy looking for `dot_general` without batch dims
    never kept (it recomputed them as `full` does)."""
    none, layers = _products(["model.remat=none"], 1, tmp_path)
    for overrides, devices in ((["train.num_microbatches=2"], 1), (["parallel.fsdp=2"], 2)):
        dots, _ = _products([*overrides, "model.remat=dots"], devices, tmp_path)
        assert dots - none == 2 * layers, (overrides, dots, none)
    assert _products(["model.remat=full"], 1, tmp_path)[0] > none + 2 * layers
    moe = {r: _products([f"model.remat={r}"], 1, tmp_path, "configs/mixtral-tiny.yaml") for r in ("none", "dots")}
    assert moe["dots"][0] - moe["none"][0] == 2 * moe["none"][1], moe
