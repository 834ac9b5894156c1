"""The MoE half of `test_sweep_degrees.py`: every assignment of the six degrees that splits the experts (expert
2 to 8, against every other axis, with at most 2 pipeline stages) trains an MoE model 2 steps. An MoE model whose
experts are whole on every device runs on the dense model's meshes, swept there, with the expert kernel of
`test_moe.py`."""
import pytest

from layouts import train_or_refusal
from test_sweep_degrees import ASSIGNMENTS, BASE, MOE, layers, layout, name


@pytest.mark.parametrize("degrees", [d for d in ASSIGNMENTS if d["stage"] <= 2 and d["expert"] >= 2], ids=name)
def test_moe_without_sequence_parallelism_trains(degrees, tmp_path):
    assert train_or_refusal(BASE + MOE + layers(degrees, virtual=False) + layout(degrees, sp=False, virtual=False),
                            tmp_path) is None
