"""What a compiled SPMD program communicates per step, read from its optimized HLO text, and what that costs on given
links: the planner prices a layout's collectives without running it, from the program XLA really built (which
collectives survived, their buffer sizes, their device groups and how often loops run them).

Device ids in the HLO are positions in the program's device assignment (a single-replica program compiled by
`jax.jit` over a mesh: the mesh's devices in flat order); a node holds `gpus_per_node` consecutive ids, as
`jax.make_mesh` orders GPUs (process by process).

Pricing model (one place): each run of a collective costs, for a group of n devices, the bytes each device sends
divided by the link's one-direction bandwidth per GPU plus one link latency per step. A device sends (n-1)/n of the
buffer for all-gather, reduce-scatter and all-to-all, 2(n-1)/n for all-reduce (a ring reduce-scatter and
all-gather) and the whole buffer for collective-permute; ring collectives take n-1 steps, a permute one. Every group
of a collective runs at once at the speed of the slowest link any group uses: inter-node if a group spans nodes,
however few of its hops do. A group of one costs nothing. Nothing overlaps: the figures are the communication a step
would expose if no compute hid it.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import re

import numpy as np

INTRA, INTER = "intra-node", "inter-node"

# HLO opcodes counted, by the collective each runs; an async pair counts once, by its start.
_KINDS = {"all-gather": "all-gather", "all-gather-start": "all-gather", "reduce-scatter": "reduce-scatter",
          "all-reduce": "all-reduce", "all-reduce-start": "all-reduce", "all-to-all": "all-to-all",
          "collective-permute": "collective-permute", "collective-permute-start": "collective-permute"}
# Starts whose result tuple holds (operands, results, ...): the results are element 1.
_RESULT_SECOND = {"all-gather-start", "collective-permute-start"}

_HEADER = re.compile(r"(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*)?\{$")
_NAME = re.compile(r"(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
# opcodes that run work on the GPU while an asynchronous collective is in flight
_COMPUTE = frozenset({"fusion", "custom-call", "dot", "convolution", "while", "call", "conditional", "reduce",
                      "scatter", "gather", "sort", "reduce-window", "select-and-scatter"})
_OPCODE = re.compile(r"\s*([\w\-]+)\(")
_COMMENT = re.compile(r"/\*.*?\*/")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_CALLS = re.compile(r"\b(calls|to_apply|body|condition|true_computation|false_computation|branch_computations|"
                    r"called_computations|select|scatter)=(\{[^}]*\}|%?[\w.\-]+)")
_TRIP = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"(\d+)')
_IOTA = re.compile(r"\[([\d,]*)\]<=\[([\d,]*)\](?:T\(([\d,]*)\))?")  # [4,2]<=[2,4]T(1,0)
_EXPLICIT = re.compile(r"\{(?:\s*\{[\d,\s]*\}\s*,?)*\s*\}")  # {{0,1},{2,3}}, {}
# mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b','a':(1)2}: the groups along named axes of a device mesh
_MESH = re.compile(r"mesh\[([^\]]*)\](?:,\s*device_ids=\(([^()]*(?:\([^()]*\))?)\))?\s*\{([^}]*)\}")
_GROUPS = re.compile(rf"\b(replica_groups|source_target_pairs)=({_MESH.pattern}|{_IOTA.pattern}|{_EXPLICIT.pattern})")
_MODULE = re.compile(r"^HloModule\b.*", re.MULTILINE)
_DEVICES = re.compile(r"\b(num_partitions|replica_count)=(\d+)")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: `bytes` is its whole buffer on each device (an all-gather's result, a
    reduce-scatter's operand), `groups` its device groups (a permute's: its source-target pairs), `count` how many
    times one execution of the program runs it."""

    kind: str
    bytes: int
    group_size: int
    groups: tuple[tuple[int, ...], ...]
    count: int
    computation: str
    count_known: bool = True  # False inside a loop whose trip count XLA did not know (counted once)
    overlapped: bool = False  # asynchronous, with compute scheduled between its start and its done


@dataclasses.dataclass(frozen=True)
class Links:
    """Bandwidth in bytes/s per GPU in one direction, latency in seconds per step, within a node and between."""

    gpus_per_node: int
    intra_bandwidth: float
    inter_bandwidth: float
    intra_latency: float
    inter_latency: float


def collectives(hlo_text: str, num_devices: int | None = None) -> list[Collective]:
    """Every collective of the optimized HLO `hlo_text`, in program text order. `num_devices` is the one group that
    empty replica groups name (default: the module header's partitions times replicas). Collectives in a
    conditional's branches count as often as the conditional runs, each branch: an upper bound."""
    entry, bodies = _computations(hlo_text)
    counts = _counts(entry, bodies)
    if num_devices is None:
        module = _MODULE.search(hlo_text)
        header = dict(_DEVICES.findall(module[0])) if module else {}
        num_devices = int(header.get("num_partitions", 1)) * int(header.get("replica_count", 1))
    beside = {name: _overlaps(lines) for name, lines in bodies.items()}
    in_async = {callee: beside[name].get(i, False) for name, lines in bodies.items()
                for i, (opcode, _, line) in enumerate(lines) if opcode == "async-start"
                for attr, value in _CALLS.findall(_QUOTED.sub("", line)) if attr == "calls"
                for callee in re.findall(r"[\w.\-]+", value.replace("%", ""))}
    found = []
    for name, lines in bodies.items():
        if name not in counts:
            continue  # not reachable from the entry: never runs
        for i, (opcode, shape, line) in enumerate(lines):
            if opcode in _KINDS:
                count, known = counts[name]
                overlapped = beside[name].get(i, False) if opcode.endswith("-start") else in_async.get(name, False)
                found.append(_collective(opcode, shape, line, num_devices, count, known, name, overlapped))
    return found


def _overlaps(lines) -> dict[int, bool]:
    """{index of each asynchronous start: whether the program computes between it and its done}, in one pass (the
    program is scheduled: its text order is its run order): the overlap XLA's scheduler gave the collective."""
    starts, out, last_compute = {}, {}, -1
    for i, (opcode, _, line) in enumerate(lines):
        if opcode.endswith("-start"):
            starts[_NAME.match(line)[1]] = i
        elif (opcode.endswith("-done") and (m := re.search(rf"\s{opcode}\(%?([\w.\-]+)", line))
              and (start := starts.pop(m[1], None)) is not None):
            out[start] = last_compute > start
        if opcode in _COMPUTE:
            last_compute = i
    return out


def replica_groups(text: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The device groups of an HLO `replica_groups` (or `source_target_pairs`) value: `{{0,1},{2,3}}`, the iota form
    `[4,2]<=[2,4]T(1,0)` (ids 0.. reshaped to the dims after `<=`, transposed, reshaped to the leading dims), the mesh
    form `mesh['x'=2,'y'=4] {'y'}` (`_mesh_groups`), or `{}` (all `num_devices` in one group)."""
    text = text.strip()
    if m := _MESH.fullmatch(text):
        return _mesh_groups(m[1], m[2], m[3])
    if m := _IOTA.fullmatch(text):
        shape, dims, perm = ([int(v) for v in g.split(",") if v] for g in (m[1], m[2], m[3] or ""))
        ids = np.arange(math.prod(dims)).reshape(dims).transpose(perm or range(len(dims))).reshape(shape)
        return tuple(tuple(int(d) for d in row) for row in ids)
    if not _EXPLICIT.fullmatch(text):
        raise ValueError(f"unreadable replica groups {text!r}")
    inner = re.findall(r"\{([\d,\s]*)\}", text[1:-1])
    if not inner:
        return (tuple(range(num_devices)),)
    return tuple(tuple(int(d) for d in group.split(",") if d.strip()) for group in inner)


def _mesh_groups(axes: str, device_ids: str | None, grouped: str) -> tuple[tuple[int, ...], ...]:
    """The groups of XLA's mesh form: devices laid out as the mesh (ids 0.. in order, or `device_ids`, an iota
    `[dims]T(perm)` or a list), each group the devices that differ only along the named axes; `'a':(p)s` names the
    part of size s of axis a that follows its major part of size p."""
    names, sizes = zip(*((n.strip().strip("'"), int(v)) for n, _, v in (a.rpartition("=") for a in axes.split(","))))
    total = math.prod(sizes)
    if not device_ids:
        ids = np.arange(total)
    elif m := re.fullmatch(r"\[([\d,]*)\](?:T\(([\d,]*)\))?", device_ids.strip()):
        dims, perm = ([int(v) for v in g.split(",") if v] for g in (m[1], m[2] or ""))
        ids = np.arange(total).reshape(dims).transpose(perm or range(len(dims)))
    else:
        ids = np.array([int(v) for v in re.findall(r"\d+", device_ids)])
    refs: dict[int, list[tuple[int, int]]] = {}  # mesh axis -> its grouped (pre, size) parts
    for ref in filter(None, (r.strip() for r in grouped.split(","))):
        name, _, sub = ref.partition(":")
        axis = names.index(name.strip("'"))
        m = re.fullmatch(r"\((\d+)\)(\d+)", sub) if sub else None
        refs.setdefault(axis, []).append((int(m[1]), int(m[2])) if m else (1, sizes[axis]))
    dims, keep = [], []  # the mesh with each grouped axis split into its parts; which dims are grouped
    for axis, size in enumerate(sizes):
        done = 1
        for pre, part in sorted(refs.get(axis, [])):
            if pre > done:
                dims.append(pre // done)
            keep.append(len(dims))
            dims.append(part)
            done = pre * part
        if done < size or axis not in refs:
            dims.append(size // done)
    order = [i for i in range(len(dims)) if i not in keep] + keep  # the grouped dims last, each row a group
    flat = ids.reshape(dims).transpose(order).reshape(-1, math.prod(dims[i] for i in keep))
    return tuple(tuple(int(d) for d in row) for row in flat)


def crosses_nodes(group, gpus_per_node: int) -> bool:
    """Whether the devices of `group` sit on more than one node (device d on node d // gpus_per_node)."""
    return len({d // gpus_per_node for d in group}) > 1


def link_class(c: Collective, links: Links) -> str:
    """The slowest link `c`'s groups use."""
    return INTER if any(crosses_nodes(g, links.gpus_per_node) for g in c.groups) else INTRA


def sent_bytes(c: Collective) -> float:
    """The bytes each device of a group sends in one run of `c`, by the module's model."""
    n = c.group_size
    if n <= 1:
        return 0.0
    return c.bytes * {"all-reduce": 2 * (n - 1) / n, "collective-permute": 1.0}.get(c.kind, (n - 1) / n)


def seconds(c: Collective, links: Links) -> float:
    """The time of all `c.count` runs of `c` on `links`, by the module's model."""
    n = c.group_size
    if n <= 1:
        return 0.0
    inter = link_class(c, links) == INTER
    bandwidth = links.inter_bandwidth if inter else links.intra_bandwidth
    latency = links.inter_latency if inter else links.intra_latency
    steps = 1 if c.kind == "collective-permute" else n - 1
    return c.count * (sent_bytes(c) / bandwidth + steps * latency)


def summary(cs: list[Collective], links: Links) -> dict[tuple[str, str], dict[str, float]]:
    """Per (kind, link class), over one execution of the program: `runs`, `bytes` (the buffers), `sent_bytes` (what
    each device sends) and `seconds`; ordered by seconds, most first."""
    rows = collections.defaultdict(lambda: {"runs": 0, "bytes": 0, "sent_bytes": 0.0, "seconds": 0.0})
    for c in cs:
        row = rows[c.kind, link_class(c, links)]
        row["runs"] += c.count
        row["bytes"] += c.count * c.bytes
        row["sent_bytes"] += c.count * sent_bytes(c)
        row["seconds"] += seconds(c, links)
    return dict(sorted(rows.items(), key=lambda item: -item[1]["seconds"]))


def _computations(hlo_text: str) -> tuple[str, dict[str, list[tuple[str, str, str]]]]:
    """The entry computation's name and each computation's instructions as (opcode, result shape, line)."""
    entry, bodies, current = None, {}, None
    for raw in hlo_text.splitlines():
        line = _COMMENT.sub("", raw).strip()
        if current is None:
            if not line.startswith("HloModule") and (m := _HEADER.match(line)):
                current = m[1]
                bodies[current] = []
                entry = current if line.startswith("ENTRY") else entry
        elif line.startswith("}"):
            current = None
        elif m := _NAME.match(line):
            shape, rest = _split_shape(line[m.end():])
            if op := _OPCODE.match(rest):
                bodies[current].append((op[1], shape, line))
    if entry is None:
        raise ValueError("the HLO text has no ENTRY computation")
    return entry, bodies


def _split_shape(text: str) -> tuple[str, str]:
    """The leading shape of `text` (an array shape, or a tuple in balanced parentheses) and what follows it."""
    if not text.startswith("("):
        shape, _, rest = text.partition(" ")
        return shape, rest
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return text[:i + 1], text[i + 1:]
    raise ValueError(f"unbalanced HLO shape in {text!r}")


def _counts(entry: str, bodies) -> dict[str, tuple[int, bool]]:
    """How many times one execution of the program runs each computation reachable from `entry`, and whether every
    loop on the way knew its trip count (a loop that did not counts once)."""
    edges = {name: list(_callees(lines)) for name, lines in bodies.items()}
    order, seen = [], set()

    def visit(name):  # post-order: a computation after all it calls
        seen.add(name)
        for callee, _ in edges.get(name, ()):
            if callee not in seen:
                visit(callee)
        order.append(name)
    visit(entry)
    counts = {name: (0, True) for name in order}
    counts[entry] = (1, True)
    for caller in reversed(order):  # callers before callees: the call graph is acyclic
        count, known = counts[caller]
        for callee, times in edges.get(caller, ()):
            total, callee_known = counts[callee]
            counts[callee] = (total + count * (times or 1), callee_known and known and times is not None)
    return counts


def _callees(lines):
    """(computation, times per call) for each computation the instructions call; times None: a loop of unknown
    trip count. The `-done` half of an async pair names the computation its start already ran."""
    for opcode, _, line in lines:
        if opcode.endswith(("-done", "-update")):
            continue
        trip = _TRIP.search(line) if opcode == "while" else None
        for attr, value in _CALLS.findall(_QUOTED.sub("", line)):
            times = 1
            if opcode == "while" and attr in ("body", "condition"):  # the condition runs once more than the body
                times = int(trip[1]) + (attr == "condition") if trip else None
            for callee in re.findall(r"[\w.\-]+", value.replace("%", "")):
                yield callee, times


def _collective(opcode, shape, line, num_devices, count, known, computation, overlapped) -> Collective:
    """The collective of one instruction line, whose opcode and result shape are read already."""
    kind = _KINDS[opcode]
    if opcode in _RESULT_SECOND:
        shape = _tuple_elements(shape)[1]
    found = {m[1]: m[2] for m in _GROUPS.finditer(_QUOTED.sub("", line))}
    if "replica_groups=" in line and "replica_groups" not in found:  # never guess a group: it sets the link
        raise ValueError(f"unreadable replica groups in {line[:300]!r}")
    if kind == "collective-permute":
        groups = replica_groups(found.get("source_target_pairs", "{{}}"), num_devices)
        groups = tuple(g for g in groups if g)
        group_size = 2 if groups else 1
    else:
        groups = replica_groups(found.get("replica_groups", "{}"), num_devices)
        group_size = max(len(g) for g in groups)
    size = _shape_bytes(shape) * (group_size if kind == "reduce-scatter" else 1)
    return Collective(kind, size, group_size, groups, count, computation, known, overlapped)


def _tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape."""
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(shape[1:-1], 1):
        depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(shape[start:i].strip())
            start = i + 1
    return parts + [shape[start:-1].strip()]


def _shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape: the sum of a tuple's arrays; dims like `<=8` (dynamic) at their bound."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        bits = 8 if dtype == "pred" else int(m[1]) if (m := re.match(r"[a-z]+(\d+)", dtype)) else 0
        total += math.ceil(math.prod(int(d.strip().lstrip("<=")) for d in dims.split(",") if d.strip()) * bits / 8)
    return total
