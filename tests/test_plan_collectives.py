"""The collectives of compiled SPMD programs, read from their optimized HLO: kinds, buffer bytes, device groups and
runs per execution (loops multiply, branches count as their caller), the GPU's async and iota spellings from literal
HLO, and their price on intra- and inter-node links."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from mlm_jax.plan.collectives import (
    INTER,
    INTRA,
    Collective,
    Links,
    collectives,
    crosses_nodes,
    replica_groups,
    seconds,
    summary,
)

ROWS, COLS = ((0, 1, 2, 3), (4, 5, 6, 7)), ((0, 4), (1, 5), (2, 6), (3, 7))  # mesh (a=2, b=4): groups over b, over a
SHARD = 4 * 4 * 4  # one device's f32[4,4] block of the f32[8,16] input sharded over (a, b)


def compiled(f, in_spec, out_spec=None, *, scalar_args=0):
    """The collectives of `f` under shard_map over a (2, 4) mesh, on an f32[8,16] input sharded by `in_spec` (and
    its output too, unless `out_spec`)."""
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    specs = (in_spec,) + (P(),) * scalar_args
    step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=out_spec or in_spec, check_vma=False))
    args = [jax.ShapeDtypeStruct((8, 16), jnp.float32, sharding=NamedSharding(mesh, in_spec))]
    args += [jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P()))] * scalar_args
    return collectives(step.lower(*args).compile().as_text())


def only(cs):
    assert len(cs) == 1, cs
    return cs[0]


def test_psum_over_b_is_one_all_reduce_in_two_groups_of_four():
    c = only(compiled(lambda v: jax.lax.psum(v, "b"), P("a", "b")))
    assert (c.kind, c.bytes, c.group_size, c.groups, c.count, c.count_known) == ("all-reduce", SHARD, 4, ROWS, 1, True)


def test_psum_over_a_pairs_each_device_with_the_one_below_it():
    c = only(compiled(lambda v: jax.lax.psum(v, "a"), P("a", "b")))
    assert (c.kind, c.bytes, c.group_size, c.groups) == ("all-reduce", SHARD, 2, COLS)


def test_all_gather_counts_its_gathered_result():
    c = only(compiled(lambda v: jax.lax.all_gather(v, "b", axis=1, tiled=True), P("a", "b"), P("a", None)))
    assert (c.kind, c.bytes, c.group_size, c.groups) == ("all-gather", 4 * SHARD, 4, ROWS)


def test_reduce_scatter_counts_its_whole_operand():
    c = only(compiled(lambda v: jax.lax.psum_scatter(v, "b", scatter_dimension=1, tiled=True), P("a", None),
                      P("a", "b")))
    # A backend may lower it as an all-reduce of the operand and a slice; both move the whole f32[4,16].
    assert c.kind in ("reduce-scatter", "all-reduce")
    assert (c.bytes, c.group_size, c.groups) == (4 * SHARD, 4, ROWS)


def test_all_to_all_counts_one_devices_buffer_however_it_is_split():
    c = only(compiled(lambda v: jax.lax.all_to_all(v, "b", 0, 1, tiled=True), P("a", "b")))
    assert (c.kind, c.bytes, c.group_size, c.groups) == ("all-to-all", SHARD, 4, ROWS)


def test_ppermute_reports_its_source_target_pairs():
    c = only(compiled(lambda v: jax.lax.ppermute(v, "b", [(i, (i + 1) % 4) for i in range(4)]), P("a", "b")))
    ring = tuple((r + i, r + (i + 1) % 4) for r in (0, 4) for i in range(4))
    assert (c.kind, c.bytes, c.group_size, c.groups) == ("collective-permute", SHARD, 2, ring)


def test_a_scan_of_five_runs_its_psum_five_times_and_nested_loops_multiply():
    def step(c, _):
        return jax.lax.psum(c, "b") * 0.5, None

    once = only(compiled(lambda v: jax.lax.scan(step, v, None, length=5)[0], P("a", "b")))
    nested = only(compiled(lambda v: jax.lax.scan(lambda c, _: (jax.lax.scan(step, c, None, length=5)[0], None),
                                                  v, None, length=3)[0], P("a", "b")))
    assert (once.count, once.count_known, once.groups) == (5, True, ROWS)
    assert (nested.count, nested.count_known) == (15, True)


def test_a_loop_of_unknown_trip_count_counts_once_and_says_so():
    def f(v, n):
        return jax.lax.while_loop(lambda c: c[1] < n, lambda c: (jax.lax.psum(c[0], "a") * 0.5, c[1] + 1), (v, 0))[0]
    c = only(compiled(f, P("a", "b"), scalar_args=1))
    assert (c.kind, c.groups, c.count, c.count_known) == ("all-reduce", COLS, 1, False)


def test_a_branch_counts_as_often_as_its_conditional_runs():
    def step(c, i):
        return jax.lax.cond(i % 2 == 0, lambda u: jax.lax.psum(u, "b"), lambda u: u * 2, c), None
    c = only(compiled(lambda v: jax.lax.scan(step, v, jnp.arange(4))[0], P("a", "b")))
    assert (c.kind, c.count) == ("all-reduce", 4)  # an upper bound: the branch runs on two of the four steps


GPU_HLO = """HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[8,128]{1,0})->bf16[8,128]{1,0}}, \
num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%async_computation (p: f32[8,64]) -> f32[2,64] {
  %p = f32[8,64]{1,0} parameter(0)
  ROOT %rs = f32[2,64]{1,0} reduce-scatter(%p), channel_id=4, replica_groups=[2,4]<=[8], dimensions={0}, \
use_global_device_ids=true, to_apply=%add
}

%inner_body (t: (s32[], bf16[8,128])) -> (s32[], bf16[8,128]) {
  %t = (s32[], bf16[8,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = bf16[8,128]{1,0} get-tuple-element(%t), index=1
  %ar-start = bf16[8,128]{1,0} all-reduce-start(%v), channel_id=5, replica_groups={}, use_global_device_ids=true, \
to_apply=%add, backend_config={"operation_queue_id":"0","collective_backend_config":{"is_sync":false}}
  %ar-done = bf16[8,128]{1,0} all-reduce-done(%ar-start)
  ROOT %r = (s32[], bf16[8,128]{1,0}) tuple(%i, %ar-done)
}

%inner_cond (t: (s32[], bf16[8,128])) -> pred[] {
  %t = (s32[], bf16[8,128]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%outer_body (t: (s32[], bf16[8,128])) -> (s32[], bf16[8,128]) {
  %t = (s32[], bf16[8,128]{1,0}) parameter(0)
  %w = (s32[], bf16[8,128]{1,0}) while(%t), condition=%inner_cond, body=%inner_body, \
backend_config={"known_trip_count":{"n":"3"},"known_init_step":{"init":"0","step":"1"}}
  ROOT %cp-start = ((s32[], bf16[8,128]{1,0}), (s32[], bf16[8,128]{1,0}), u32[], u32[]) \
collective-permute-start(%w), channel_id=6, source_target_pairs={{0,4},{4,0}}
}

%outer_cond (t: (s32[], bf16[8,128])) -> pred[] {
  %t = (s32[], bf16[8,128]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (p0: bf16[8,128], p1: f32[8,64], p2: f8e4m3fn[2,16]) -> bf16[8,128] {
  %p0 = bf16[8,128]{1,0} parameter(0), metadata={op_name="all-gather-start(not an instruction)"}
  %p1 = f32[8,64]{1,0} parameter(1)
  %p2 = f8e4m3fn[2,16]{1,0} parameter(2)
  %ag-start = (bf16[8,128]{1,0}, bf16[8,512]{1,0}) all-gather-start(%p0), channel_id=1, \
replica_groups=[4,2]<=[2,4]T(1,0), dimensions={1}, use_global_device_ids=true
  %ag-done = bf16[8,512]{1,0} all-gather-done(%ag-start)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[8,128]{1,0}) tuple(%zero, %p0)
  %rs-start = ((f32[8,64]{1,0}), f32[2,64]{1,0}) async-start(%p1), calls=%async_computation
  %rs-done = f32[2,64]{1,0} async-done(%rs-start), calls=%async_computation
  %a2a = (f8e4m3fn[2,16]{1,0}, f8e4m3fn[2,16]{1,0}) all-to-all(%p2, %p2), channel_id=2, replica_groups={{0,1},{2,3}}
  %loop = (s32[], bf16[8,128]{1,0}) while(%init), condition=%outer_cond, body=%outer_body, \
backend_config={"known_trip_count":{"n":"7"}}
  ROOT %out = bf16[8,128]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_gpu_async_pairs_count_once_by_their_start_with_their_results_bytes():
    by_kind = {c.kind: c for c in collectives(GPU_HLO)}
    assert set(by_kind) == {"all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute"}
    ag, rs, ar = by_kind["all-gather"], by_kind["reduce-scatter"], by_kind["all-reduce"]
    a2a, cp = by_kind["all-to-all"], by_kind["collective-permute"]
    assert (ag.bytes, ag.groups, ag.count) == (8 * 512 * 2, COLS, 1)  # the result, not the operand in its tuple
    assert (rs.bytes, rs.groups, rs.count, rs.computation) == (8 * 64 * 4, ROWS, 1, "async_computation")
    assert (ar.bytes, ar.groups, ar.count, ar.count_known) == (8 * 128 * 2, (tuple(range(8)),), 7 * 3, True)
    assert (a2a.bytes, a2a.group_size) == (2 * 2 * 16, 2)
    assert (cp.bytes, cp.groups, cp.count, cp.computation) == (4 + 8 * 128 * 2, ((0, 4), (4, 0)), 7, "outer_body")


def test_empty_replica_groups_take_the_devices_given():
    ar = next(c for c in collectives(GPU_HLO, num_devices=16) if c.kind == "all-reduce")
    assert (ar.group_size, ar.groups) == (16, (tuple(range(16)),))


def test_hlo_without_an_entry_computation_is_refused():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        collectives("HloModule m\n")


@pytest.mark.parametrize("text, groups", [
    ("[2,4]<=[8]", ROWS),
    ("[4,2]<=[2,4]T(1,0)", COLS),
    ("[2,4]<=[2,4]", ROWS),
    ("[4,2]<=[2,2,2]T(2,1,0)", ((0, 4), (2, 6), (1, 5), (3, 7))),
    ("{{0,1},{2,3}}", ((0, 1), (2, 3))),
    ("{}", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", ROWS),
    ("mesh['axis_0'=2,'axis_1'=4,'axis_2'=1] {'axis_0'}", COLS),
    ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['a'=8] {'a':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
    ("mesh['a'=8] {'a':(1)2}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    ("mesh['a'=2,'b'=4] {'a','b':(2)2}", ((0, 4, 1, 5), (2, 6, 3, 7))),
    ("mesh['a'=2,'b'=4] {}", tuple((i,) for i in range(8))),
])
def test_replica_groups_read_explicit_iota_mesh_and_empty_forms(text, groups):
    assert tuple(sorted(map(sorted, replica_groups(text, 8)))) == tuple(sorted(map(sorted, groups)))


def test_a_collective_whose_groups_cannot_be_read_is_refused_rather_than_given_every_device():
    hlo = GPU_HLO.replace("replica_groups={{0,1},{2,3}}", "replica_groups=grid<2x4>")
    with pytest.raises(ValueError, match="unreadable replica groups"):
        collectives(hlo)


LINKS = Links(gpus_per_node=4, intra_bandwidth=100e9, inter_bandwidth=25e9, intra_latency=1e-5, inter_latency=1e-4)


def test_a_ring_collective_costs_its_bytes_over_the_slowest_link_plus_a_latency_per_step():
    ar = Collective("all-reduce", 8 * 10**9, 4, ((0, 1, 2, 3), (4, 5, 6, 7)), 3, "main")
    ag = Collective("all-gather", 8 * 10**9, 2, COLS, 1, "main")
    assert seconds(ar, LINKS) == pytest.approx(3 * (2 * 3 / 4 * 8e9 / 100e9 + 3 * 1e-5))
    assert seconds(ag, LINKS) == pytest.approx(1 / 2 * 8e9 / 25e9 + 1e-4)  # every pair spans the two nodes
    assert not crosses_nodes((0, 1, 2, 3), 4) and crosses_nodes((3, 4), 4)


def test_a_permute_costs_one_step_and_a_group_of_one_nothing():
    cp = Collective("collective-permute", 10**9, 2, ((0, 1), (1, 0)), 1, "main")
    alone = Collective("all-reduce", 10**9, 1, ((0,), (1,)), 5, "main")
    assert seconds(cp, LINKS) == pytest.approx(1e9 / 100e9 + 1e-5)
    assert seconds(alone, LINKS) == 0.0


def test_summary_groups_runs_bytes_and_seconds_by_kind_and_link_class():
    cs = [Collective("all-reduce", 1000, 4, ROWS, 2, "main"), Collective("all-reduce", 500, 4, ROWS, 1, "body"),
          Collective("all-reduce", 1000, 2, COLS, 1, "main")]
    table = summary(cs, LINKS)
    assert set(table) == {("all-reduce", INTRA), ("all-reduce", INTER)}
    intra = table["all-reduce", INTRA]
    assert (intra["runs"], intra["bytes"], intra["sent_bytes"]) == (3, 2500, pytest.approx(1.5 * 2500))
    assert intra["seconds"] == pytest.approx(seconds(cs[0], LINKS) + seconds(cs[1], LINKS))
    assert table["all-reduce", INTER]["seconds"] == pytest.approx(seconds(cs[2], LINKS))


SCHEDULED_HLO = """HloModule jit_step, is_scheduled=true, num_partitions=8

%fused (x: f32[8,64]) -> f32[8,64] {
  %x = f32[8,64]{1,0} parameter(0)
  ROOT %n = f32[8,64]{1,0} negate(%x)
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%rs_computation (p: f32[8,64]) -> f32[2,64] {
  %p = f32[8,64]{1,0} parameter(0)
  ROOT %rs = f32[2,64]{1,0} reduce-scatter(%p), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, to_apply=%add
}

ENTRY %main (p0: bf16[8,128], p1: f32[8,64]) -> f32[8,64] {
  %p0 = bf16[8,128]{1,0} parameter(0)
  %p1 = f32[8,64]{1,0} parameter(1)
  %ag-start = (bf16[8,128]{1,0}, bf16[8,512]{1,0}) all-gather-start(%p0), channel_id=1, replica_groups=[2,4]<=[8], \
dimensions={1}
  %ag-start.1 = (bf16[8,128]{1,0}, bf16[8,512]{1,0}) all-gather-start(%p0), channel_id=2, replica_groups=[2,4]<=[8], \
dimensions={1}
  %ag-done.1 = bf16[8,512]{1,0} all-gather-done(%ag-start.1)
  %rs-start = ((f32[8,64]{1,0}), f32[2,64]{1,0}) async-start(%p1), calls=%rs_computation
  %f = f32[8,64]{1,0} fusion(%p1), kind=kLoop, calls=%fused
  %rs-done = f32[2,64]{1,0} async-done(%rs-start), calls=%rs_computation
  %ag-done = (bf16[8,512]{1,0}) all-gather-done(%ag-start)
  ROOT %out = f32[8,64]{1,0} add(%f, %f)
}
"""


def test_a_collective_is_overlapped_where_the_schedule_computes_between_its_start_and_done():
    found = collectives(SCHEDULED_HLO)
    gathers = [c for c in found if c.kind == "all-gather"]
    assert [c.overlapped for c in gathers] == [True, False]  # the fusion runs before %ag-done (a tuple), not %ag-done.1
    (rs,) = (c for c in found if c.kind == "reduce-scatter")  # inside the async computation the fusion waits on
    assert rs.overlapped and rs.computation == "rs_computation"
    assert not any(c.overlapped for c in collectives(GPU_HLO))  # each done right after its start
