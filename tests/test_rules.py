"""The rules table (DESIGN.md section 2): resolver, presets and overrides, golden PartitionSpecs, sharding report.

Golden snapshots live in tests/golden/; regenerate them with `MLM_JAX_UPDATE_GOLDEN=1 pytest tests/test_rules.py`
and review the diff.
"""
import json
import math
import os
import pathlib
import re

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from mlm_jax import load_config
from mlm_jax.config import ConfigError
from mlm_jax.model import axes as ax
from mlm_jax.parallel import rules as R
from mlm_jax.parallel import sharding as shd
from mlm_jax.parallel.mesh import build_mesh
from mlm_jax.model.transformer import model_spec

GOLDEN = pathlib.Path(__file__).parent / "golden"
UPDATE = os.environ.get("MLM_JAX_UPDATE_GOLDEN") == "1"
LAYOUT = dict(data=2, stage=1, fsdp=2, context=1, expert=1, tensor=2)
SHAPE = dict(data=2, fsdp=2, tensor=2, context=1)  # a plain dict is enough for `resolve`
is_spec = lambda x: isinstance(x, P)  # noqa: E731


def resolve(names, rules=R.PRESETS["default"], mesh_shape=SHAPE, shape=None):
    return shd.resolve(names, rules, mesh_shape, shape)


# -- resolver ----------------------------------------------------------------------------------------------------

def test_first_rule_for_a_name_wins():
    rules = (("embed", ("tensor",)), ("embed", ("fsdp",)))
    assert resolve(("embed",), rules) == P("tensor")


def test_mesh_axes_of_size_one_are_dropped():
    rules = (("act_batch", ("data", "context", "fsdp")),)
    assert resolve(("act_batch",), rules) == P(("data", "fsdp"))
    assert resolve(("act_batch",), rules, dict(data=1, fsdp=1)) == P()


def test_a_mesh_axis_is_used_at_most_once_per_tensor():
    rules = (("embed", ("fsdp",)), ("mlp", ("fsdp", "tensor")), ("heads", ("tensor",)))
    assert resolve(("embed", "mlp"), rules) == P("fsdp", "tensor")
    assert resolve(("embed", "mlp", "heads"), rules) == P("fsdp", "tensor")
    assert resolve(("mlp", "embed", "heads"), rules) == P(("fsdp", "tensor"))


def test_a_rule_naming_an_axis_twice_does_not_repeat_it():
    assert resolve(("mlp",), (("mlp", ("tensor", "tensor")),)) == P("tensor")


def test_an_override_naming_an_axis_twice_is_rejected():
    with pytest.raises(ConfigError, match="appears twice"):
        R.make_rules([["mlp", ["tensor", "tensor"]]], sequence_parallel=False)


def test_axes_that_do_not_divide_the_dim_are_dropped_when_the_shape_is_known():
    rules = (("act_batch", ("data", "fsdp")),)
    assert resolve(("act_batch",), rules, shape=(8,)) == P(("data", "fsdp"))
    assert resolve(("act_batch",), rules, shape=(6,)) == P("data")  # 6 % 2 == 0 but 6 % 4 != 0
    assert resolve(("act_batch",), rules, shape=(3,)) == P()
    assert resolve(("act_batch",), rules) == P(("data", "fsdp"))  # no shape: no check


def test_unnamed_dims_stay_unsharded_and_trailing_nones_are_trimmed():
    assert resolve((None, "embed", None, None)) == P(None, "fsdp")
    assert resolve(("layers", "norm")) == P()
    assert resolve(()) == P()


def test_unknown_logical_name_raises():
    with pytest.raises(KeyError, match="embedding"):
        resolve(("embedding",))


# -- make_rules ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset", list(R.PRESETS))
def test_every_preset_has_a_rule_for_every_logical_name(preset):
    rules = R.make_rules(preset, sequence_parallel=False)
    assert rules == R.PRESETS[preset]
    assert {name for name, _ in rules} == set(ax.PARAM_AXES + ax.ACTIVATION_AXES)
    assert {a for _, axes in rules for a in axes} <= set(R.MESH_AXES)


def test_sequence_parallel_shards_the_residual_sequence_over_context_and_tensor_first():
    rules = R.make_rules("default", sequence_parallel=True)
    assert rules[0] == ("act_seq_sp", ("context", "tensor"))
    assert rules[1:] == R.PRESETS["default"]
    assert resolve(("act_batch", "act_seq_sp", "act_embed"), rules) == P(("data", "fsdp"), "tensor")
    assert resolve(("act_batch", "act_seq_sp", "act_embed")) == P(("data", "fsdp"))


def test_overrides_go_before_the_default_table_and_win():
    rules = R.make_rules([["embed", ["fsdp", "data"]], ["mlp", None], ("vocab", "fsdp")], sequence_parallel=False)
    assert rules[:3] == (("embed", ("fsdp", "data")), ("mlp", ()), ("vocab", ("fsdp",)))
    assert rules[3:] == R.PRESETS["default"]
    assert resolve(("layers", "embed", "mlp"), rules) == P(None, ("fsdp", "data"))
    assert resolve(("vocab", "embed"), rules) == P("fsdp", "data")  # fsdp taken by vocab


@pytest.mark.parametrize("bad", [
    "nonesuch",  # unknown preset
    42,  # neither a name nor a list
    [["embedding", ["fsdp"]]],  # unknown logical name
    [["embed", ["model"]]],  # unknown mesh axis
    [["embed", "model"]],
    ["embed"],  # malformed entries
    [["embed"]],
    [["embed", ["fsdp"], "extra"]],
    [[1, ["fsdp"]]],
])
def test_bad_rules_raise_config_error(bad):
    with pytest.raises(ConfigError, match="parallel.rules"):
        R.make_rules(bad, sequence_parallel=False)


# -- golden PartitionSpecs on the tiny model, data=2 x fsdp=2 x tensor=2 -------------------------------------------

@pytest.fixture(scope="module")
def mesh():
    return build_mesh(LAYOUT)


@pytest.fixture(scope="module")
def spec():
    return model_spec(load_config(None, ["model.num_kv_heads=2"]).model)


def by_path(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec)[0]
    return {"/".join(k.key for k in path): leaf for path, leaf in flat}


def as_json(spec: P):
    entries = [list(e) if isinstance(e, tuple) else e for e in spec]
    while entries and entries[-1] is None:  # P('a', None) and P('a') shard alike
        entries.pop()
    return entries


def snapshot(rules, mesh, spec):
    cfg = load_config(None, ["model.num_kv_heads=2"])
    m, t = cfg.model, cfg.train
    B, S, D, N, K, H, F, V = (t.global_batch_size, t.seq_len, m.hidden_size, m.num_heads, m.kv_heads,
                              m.dim_per_head, m.ffn_size, m.vocab_size)
    activations = {
        "residual": (("act_batch", "act_seq_sp", "act_embed"), (B, S, D)),
        "q": (("act_batch", "act_seq", "act_heads", None), (B, S, N, H)),
        "k": (("act_batch", "act_seq", "act_kv_heads", None), (B, S, K, H)),
        "mlp_hidden": (("act_batch", "act_seq", "act_mlp"), (B, S, F)),
        "logits": (("act_batch", "act_seq", "act_vocab"), (B, S, V)),
    }
    params = shd.param_specs(spec.names, spec.shapes, mesh, rules)
    masters = jax.tree.map(lambda s, x: shd.zero1_spec(s, x.shape, mesh), params, spec.shapes, is_leaf=is_spec)
    shape_of = shd.mesh_shape(mesh)
    return {
        "mesh": shape_of,
        "rules": [[name, list(axes)] for name, axes in rules],
        "params": {k: as_json(v) for k, v in by_path(params).items()},
        "zero1_masters": {k: as_json(v) for k, v in by_path(masters).items()},
        "activations": {k: as_json(shd.resolve(n, rules, shape_of, s)) for k, (n, s) in activations.items()},
    }


CASES = [(p, False) for p in R.PRESETS] + [("default", True)]


@pytest.mark.parametrize("preset,sp", CASES, ids=[p + ("_sp" if sp else "") for p, sp in CASES])
def test_partition_specs_match_golden(preset, sp, mesh, spec):
    got = snapshot(R.make_rules(preset, sp), mesh, spec)
    path = GOLDEN / f"rules_{preset}{'_sp' if sp else ''}.json"
    if UPDATE:
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=1) + "\n")
        return
    assert path.exists(), f"{path} missing: run with MLM_JAX_UPDATE_GOLDEN=1 and review it"
    assert got == json.loads(path.read_text())


def test_default_layout_is_the_one_in_design_md(mesh, spec):
    """Independent of the golden files: a handful of specs stated in DESIGN.md section 2."""
    p = by_path(shd.param_specs(spec.names, spec.shapes, mesh, R.PRESETS["default"]))
    assert p["blocks/attn/q/kernel"] == P(None, "fsdp", "tensor")  # (layers, embed, heads, head_dim)
    assert p["blocks/attn/k/kernel"] == P(None, "fsdp", "tensor")  # (layers, embed, kv_heads, head_dim)
    assert p["blocks/attn/o/kernel"] == P(None, "tensor", None, "fsdp")  # (layers, heads, head_dim, embed)
    assert p["blocks/mlp/up/kernel"] == P(None, "fsdp", "tensor")  # (layers, embed, mlp)
    assert p["blocks/mlp/down/kernel"] == P(None, "tensor", "fsdp")  # (layers, mlp, embed)
    assert p["embed/embedding"] == P("tensor", "fsdp")  # (vocab, embed)
    assert p["head/kernel"] == P("fsdp", "tensor")  # (embed, vocab)
    assert p["final_norm/scale"] == P() and p["blocks/attn_norm/scale"] == P()


def test_zero1_adds_the_unused_data_parallel_axes_to_the_largest_dim_they_divide(mesh):
    assert shd.zero1_spec(P(None, "fsdp", "tensor"), (4, 128, 4, 32), mesh)[1] == ("fsdp", "data")
    assert as_json(shd.zero1_spec(P(), (4, 128), mesh)) == [None, ["data", "fsdp"]]
    assert shd.zero1_spec(P(), (3,), mesh) == P()  # nothing divides: left replicated


# -- sharding report --------------------------------------------------------------------------------------------

def test_sharding_report_lists_rules_and_every_parameter_with_bytes_per_device(mesh, spec):
    rules = R.make_rules("default", sequence_parallel=True)
    specs = shd.param_specs(spec.names, spec.shapes, mesh, rules)
    masters = jax.tree.map(lambda s, x: shd.zero1_spec(s, x.shape, mesh), specs, spec.shapes, is_leaf=is_spec)
    report = shd.sharding_report(rules, mesh, spec.shapes, spec.names, specs, masters).splitlines()

    rule_lines = [ln for ln in report if "->" in ln]
    assert [tuple(part.strip() for part in ln.split("->")) for ln in rule_lines] == [
        (name, ", ".join(axes) or "-") for name, axes in rules]

    shapes, specs_by, masters_by = by_path(spec.shapes), by_path(specs), by_path(masters)
    param_lines = {ln.split(" | ")[0].strip(): ln.split(" | ") for ln in report if " | " in ln and "->" not in ln}
    param_lines.pop("parameters: path")
    assert param_lines.keys() == shapes.keys()
    for key, (_, shape, _, compute, master, nbytes) in param_lines.items():
        assert shape == str(tuple(shapes[key].shape))
        assert compute == str(specs_by[key]) and master == str(masters_by[key])

    q = shapes["blocks/attn/q/kernel"]
    total = math.prod(q.shape) * np.dtype(q.dtype).itemsize
    assert int(param_lines["blocks/attn/q/kernel"][-1].replace(",", "")) == total // 8  # fsdp x tensor x data (ZeRO-1)
    compute_only = shd.sharding_report(rules, mesh, spec.shapes, spec.names, specs, specs)
    q_line = next(ln for ln in compute_only.splitlines() if ln.strip().startswith("blocks/attn/q/kernel"))
    assert "P(None, 'fsdp', 'tensor')" in q_line
    assert int(q_line.split(" | ")[-1].replace(",", "")) == total // 4  # fsdp=2 x tensor=2
    assert re.search(r"master parameter bytes per device: [\d,]+$", compute_only)
