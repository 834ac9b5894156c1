"""Every assignment of the six mesh degrees whose product is 8 (56; for MoE the 20 that split experts, in
`test_sweep_degrees_moe.py`) either trains 2 steps or is refused in one line before anything is traced; none ends
in a traceback or an abort.
A dense model runs with sequence parallelism wherever it applies and with 2 virtual stages on 2 pipeline stages
(every other axis meets virtual stages there, its collectives inside the chunks' branches; 4 and 8 stages run one
chunk a stage: each chunk adds to what is compiled), an MoE model without either and with at most 2 pipeline stages
(the equivalence tests cover MoE in virtual stages; `test_sweep_precision.py` has the precisions).

The expected outcome of each case is stated, not observed: a case that should train and is refused fails, and so
does one that should be refused and trains.
"""
import itertools
import math

import pytest

from layouts import train_or_refusal

AXES = ("data", "stage", "fsdp", "context", "expert", "tensor")
ASSIGNMENTS = [dict(zip(AXES, d)) for d in itertools.product((1, 2, 4, 8), repeat=6) if math.prod(d) == 8]
BASE = ["train.log_every=1", "train.eval_every=0", "train.global_batch_size=16", "train.seq_len=16",
        "log.progress=never", "data.max_bytes=2000000", "checkpoint.every=0", "model.vocab_size=264",
        "model.hidden_size=64", "model.num_heads=8", "model.ffn_size=64", "optim.warmup_steps=0"]
MOE = ["model.moe.num_experts=8", "model.moe.expert_ffn_size=32"]


def layers(d: dict, virtual: bool) -> list[str]:
    """A layer per pipeline chunk, 2 for a model without stages (compile time grows with the depth)."""
    return [f"model.num_layers={max(2, d['stage'] * (2 if virtual else 1))}"]


def layout(d: dict, sp: bool, virtual: bool) -> list[str]:
    out = [f"parallel.{a}={n}" for a, n in d.items()]
    if sp and d["tensor"] > 1:
        out.append("parallel.sequence_parallel=true")
    if virtual and d["stage"] > 1:
        out.append("parallel.virtual_stages=2")
    return out


def name(d: dict) -> str:
    return "-".join(f"{a}{n}" for a, n in d.items() if n > 1)


@pytest.mark.parametrize("degrees", ASSIGNMENTS, ids=name)
def test_dense_with_sequence_parallelism_and_virtual_stages_trains(degrees, tmp_path):
    virtual = degrees["stage"] == 2
    assert train_or_refusal(BASE + layers(degrees, virtual) + layout(degrees, sp=True, virtual=virtual),
                            tmp_path) is None
