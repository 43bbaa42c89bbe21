"""Chunked multi-group lowering: stages placed on device groups, graph chunks pipelined between them
over point-to-point messages.

The shared machinery of the strategies that put different stages on different devices and stream
the graph through them in chunks: MixGCN's mixture of accelerators with its fine-grain pipeline
(``mop``, §3.2.2: a dense group and a sparse group) and NeutronTask's task placement with its chunk
pipeline (``task``, §4.1–4.3: a group per run of tasks). A strategy module decides the stages
(:class:`~gnncompile.passes.lower.Decisions` with ``pure_stages``), the :class:`Placement` (which
:class:`Group` runs every stage, and how a group shares a chunk: ``rows`` split, ``cols`` split,
or whole ``chunks`` dealt round robin) and the chunking; this module

1. cuts the vertices into **chunks** (:class:`Chunking`: contiguous ranges of a vertex order,
   optionally a reordering such as reverse Cuthill–McKee) and finds, for every chunk of
   destinations, the chunks its in-edges read (:func:`chunk_reads`): a propagation's chunk ``j``
   waits for exactly those chunks of its source value (exact dependencies: nothing is skipped or
   stale);
2. builds each chunk's **graph slice** (:func:`chunk_graph`): the chunk's destinations and their
   in-edges, sources renumbered into the order the stage concatenates its source chunks (ascending;
   self loops read the chunk's own rows at its offset), normalization coefficients of the whole
   graph;
3. **schedules** forward and backward tasks ``(stage, chunk)`` by list scheduling
   (:func:`list_schedule`: each resource — a group, or a group's member for dealt chunks — runs one
   task at a time, a task starts when the tasks it depends on are done, ties by chunk then depth),
   and projects the global order onto each rank (:func:`emit_programs`): a stage's outputs are sent
   (eager ``SEND``) right after it runs, received right before their first use, gradients likewise
   in reverse. Every rank follows one global order in which each send precedes its receive, and a
   receiver takes a peer's messages in send order, so the program cannot deadlock.

Messages: a value read by a stage of another group moves, per chunk, as the intersection of the
block each producer rank holds (its rows, or its columns, of the chunk) with the block each
consumer rank reads (its rows, every row for a propagation's sources, or its columns): ``SEND v
ck [slab] ->q`` / ``RECV v ck (name[slab]) <-p``. Rows -> columns is the all-to-all of feature
parallelism; rows -> rows between whole-chunk groups moves each row once.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from ..errors import PlanningError
from ..graph.core import Graph
from ..graph.shard import LocalGraph, chunk_edges, chunk_subgraph, propagation_coefficients
from ..ir.plan import Backward, Forward, Instruction, Recv, Send, StageSpec
from .lower import OUTPUT, Conversion, StagedModel

__all__ = ["Chunking", "chunk_bounds", "chunk_reads", "chunk_graph", "propagation_coefficients", "Task",
           "list_schedule", "Group", "Placement", "emit_programs", "stage_deps", "stage_groups",
           "collective_chunk_program"]


def chunk_bounds(num_nodes: int, num_chunks: int) -> tuple[int, ...]:
    """Boundaries of ``num_chunks`` contiguous chunks of ``num_nodes`` vertices (sizes within one)."""
    if not 1 <= num_chunks <= max(num_nodes, 1):
        raise PlanningError(f"chunks must be in 1..{num_nodes} (the number of vertices), got {num_chunks}")
    sizes = [num_nodes // num_chunks + (1 if q < num_nodes % num_chunks else 0) for q in range(num_chunks)]
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return tuple(out)


def chunk_reads(graph: Graph, bounds: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """For every chunk ``j`` of destinations: the chunks its in-edges' sources lie in, ``j``
    included (its own rows: self loops), in ascending order (chunks reading the same set read the
    same concatenation, which the runtime then builds once per step)."""
    b = torch.as_tensor(list(bounds), dtype=torch.int64)
    indptr, indices = graph.indptr.cpu(), graph.indices.cpu()
    out = []
    for j in range(len(bounds) - 1):
        src = indices[int(indptr[bounds[j]]):int(indptr[bounds[j + 1]])]
        chunks = torch.unique(torch.searchsorted(b, src, right=True) - 1).tolist()
        out.append(tuple(sorted(set(chunks) | {j})))
    return tuple(out)


@dataclass(frozen=True)
class Chunking:
    """Contiguous chunks of a vertex order and what each chunk's propagation reads.

    ``bounds``: chunk ``k`` is positions ``[bounds[k], bounds[k+1])`` of the order; ``order``:
    position -> vertex id (``None``: the identity); ``reads[j]``: the chunks chunk ``j``'s in-edges
    read, ``j`` included, ascending.
    """

    bounds: tuple[int, ...]
    reads: tuple[tuple[int, ...], ...]
    order: Optional[torch.Tensor] = field(default=None, compare=False)

    @property
    def num_chunks(self) -> int:
        return len(self.bounds) - 1

    def size(self, k: int) -> int:
        return self.bounds[k + 1] - self.bounds[k]

    def vertices(self, lo: int, hi: int) -> torch.Tensor:
        """Vertex ids at positions ``[lo, hi)`` of the order."""
        return torch.arange(lo, hi) if self.order is None else self.order[lo:hi]

    def lag(self) -> int:
        """How many chunks ahead a chunk's propagation reads at most (the pipeline's lag)."""
        return max((max(r) - j for j, r in enumerate(self.reads)), default=0)


def chunk_graph(graph: Graph, chunking: Chunking, j: int, edge_coef: dict[str, torch.Tensor],
                loop_coef: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> LocalGraph:
    """Chunk ``j``'s destinations with their in-edges from the chunks ``reads[j]`` (all of them
    unless a relaxed chunking dropped some); sources numbered in ``reads[j]`` order (the chunk's own
    rows at ``own_offset``).

    ``graph`` is in the chunking's vertex order; ``edge_coef`` / ``loop_coef`` its normalization
    coefficients (what the model's propagations use), sliced to the chunk's edges
    (:func:`~gnncompile.graph.shard.chunk_subgraph`).
    """
    return chunk_subgraph(graph, chunking.bounds, j, chunking.reads[j], edge_coef, loop_coef)[0]


def chunk_edge_ids(graph: Graph, chunking: Chunking, j: int) -> torch.Tensor:
    """Ids of the in-edges of chunk ``j``'s destinations whose sources lie in ``reads[j]``."""
    return chunk_edges(graph, chunking.bounds, j, chunking.reads[j])


# --------------------------------------------------------------------------- tasks and list scheduling
@dataclass(frozen=True, order=True)
class Task:
    """Forward (``backward=False``) or backward of ``stage`` on ``chunk``."""

    backward: bool
    stage: int
    chunk: int

    def __str__(self) -> str:
        return f"{'B' if self.backward else 'F'}{self.stage}c{self.chunk}"


def list_schedule(tasks: Iterable[Task], group_of: Any, deps: dict[Task, set[Task]],
                  cost: dict[Task, float], delay: Optional[Callable[[Task, Task], float]] = None
                  ) -> list[tuple[float, Task]]:
    """Start times of ``tasks`` when each resource runs one task at a time (list scheduling).

    ``group_of``: stage -> resource (a dict), or a function task -> resource (e.g.
    :meth:`Placement.resource`). ``delay(d, t)``: time between the end of dependency ``d`` and the
    earliest start of ``t`` (the communication between them; default none). Repeatedly starts the
    ready task that can start earliest on its resource; ties go to the lower chunk, then the deeper
    stage for forwards (a chunk goes through before the next enters) and the later stage for
    backwards. Returns ``(start, task)`` in start order; raises :class:`PlanningError` if the
    dependencies have a cycle.
    """
    resource = group_of if callable(group_of) else (lambda t: group_of[t.stage])
    tasks = list(tasks)
    remaining = {t: len(deps.get(t, ())) for t in tasks}
    users: dict[Task, list[Task]] = {t: [] for t in tasks}
    for t in tasks:
        for d in deps.get(t, ()):
            users[d].append(t)
    end: dict[Task, float] = {}
    free: dict[Any, float] = {}
    ready: list[tuple[float, tuple, Task]] = []

    def prio(t: Task) -> tuple:
        return (t.backward, t.chunk, -t.stage)

    for t in tasks:
        if not remaining[t]:
            heapq.heappush(ready, (0.0, prio(t), t))
    out: list[tuple[float, Task]] = []
    while ready:
        # the task that can start first on its group (its data ready time vs its group's free time)
        best = None
        for i, (at, p, t) in enumerate(ready):
            start = max(at, free.get(resource(t), 0.0))
            key = (start, p)
            if best is None or key < best[0]:
                best = (key, i)
        (start, _), i = best
        _, _, t = ready.pop(i)
        heapq.heapify(ready)
        end[t] = start + cost.get(t, 1.0)
        free[resource(t)] = end[t]
        out.append((start, t))
        for u in users[t]:
            remaining[u] -= 1
            if not remaining[u]:
                at = max(end[d] + (delay(d, u) if delay is not None else 0.0) for d in deps[u])
                heapq.heappush(ready, (at, prio(u), u))
    if len(out) != len(tasks):
        stuck = sorted(t for t in tasks if t not in end)
        raise PlanningError(f"chunk schedule: tasks {', '.join(map(str, stuck[:6]))} depend on each other in a cycle")
    return out


# --------------------------------------------------------------------------- placement
#: How a group's members share a chunk: ``rows`` (each member computes a balanced slice of every
#: chunk's vertices), ``cols`` (each member computes every vertex of every chunk for a slice of the
#: last dimension), ``chunks`` (whole chunks dealt round robin: member ``k mod t`` runs chunk ``k``).
GROUP_LAYOUTS = ("rows", "cols", "chunks")


@dataclass(frozen=True)
class Group:
    """Ranks that run some stages together, and how they share the chunks (:data:`GROUP_LAYOUTS`)."""

    name: str
    members: tuple[int, ...]
    layout: str = "rows"

    def __post_init__(self) -> None:
        if self.layout not in GROUP_LAYOUTS:
            raise PlanningError(f"group {self.name!r}: layout must be one of {GROUP_LAYOUTS}, got {self.layout!r}")
        if not self.members:
            raise PlanningError(f"group {self.name!r} has no ranks")

    def runners(self, k: int) -> tuple[int, ...]:
        """Indices of the members that run chunk ``k``."""
        return (k % len(self.members),) if self.layout == "chunks" else tuple(range(len(self.members)))

    def sub_rows(self, chunking: Chunking, k: int) -> list[tuple[int, int]]:
        """Chunk ``k``'s positions computed by each member (empty where the member does not run it)."""
        lo, hi = chunking.bounds[k], chunking.bounds[k + 1]
        t = len(self.members)
        if self.layout == "cols":
            return [(lo, hi)] * t
        if self.layout == "chunks":
            return [(lo, hi) if i == k % t else (lo, lo) for i in range(t)]
        n = hi - lo
        out = []
        for i in range(t):
            m = n // t + (1 if i < n % t else 0)
            out.append((lo, lo + m))
            lo += m
        return out

    def col_splits(self, width: int) -> list[tuple[int, int]]:
        """Each member's slice of a last dimension of ``width`` (all of it unless ``cols``)."""
        p = len(self.members)
        if self.layout != "cols":
            return [(0, width)] * p
        out, lo = [], 0
        for q in range(p):
            m = width // p + (1 if q < width % p else 0)
            out.append((lo, lo + m))
            lo += m
        return out


@dataclass(frozen=True)
class Placement:
    """Which group runs every stage.

    ``input_group``: the group holding the model's vertex inputs (features), which sends their
    converted copies; ``None``: a rank reading a model input gets its block of it directly.
    """

    groups: tuple[Group, ...]
    stage_group: dict[int, int]
    input_group: Optional[int] = None

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for g in self.groups:
            if seen & set(g.members):
                raise PlanningError(f"group {g.name!r} shares ranks {sorted(seen & set(g.members))} with another group")
            seen |= set(g.members)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for g in self.groups for r in g.members))

    def resource(self, t: Task) -> Any:
        """What task ``t`` occupies: its group, or the member of a ``chunks`` group running its chunk."""
        gi = self.stage_group[t.stage]
        g = self.groups[gi]
        return (gi, t.chunk % len(g.members)) if g.layout == "chunks" else gi


#: A block of a chunk's value: positions ``[r0, r1)`` of the vertex order, last-dimension ``[c0, c1)``.
Block = tuple[int, int, int, int]


def held_block(g: Group, i: int, chunking: Chunking, k: int, width: int) -> Optional[Block]:
    """The block of chunk ``k`` that member ``i`` of ``g`` computes (``None``: a ``chunks`` group's
    member that does not run chunk ``k``; a ``rows`` member may hold an empty block)."""
    if i not in g.runners(k):
        return None
    r0, r1 = g.sub_rows(chunking, k)[i]
    c0, c1 = g.col_splits(width)[i]
    return (r0, r1, c0, c1)


def needed_block(g: Group, i: int, chunking: Chunking, k: int, width: int, whole_chunk: bool) -> Block:
    """The block of chunk ``k`` member ``i`` of ``g`` reads: its rows (every row of the chunk for a
    propagation's source side, ``whole_chunk``, and in ``cols`` / ``chunks`` groups) and its columns."""
    if whole_chunk or g.layout != "rows":
        r0, r1 = chunking.bounds[k], chunking.bounds[k + 1]
    else:
        r0, r1 = g.sub_rows(chunking, k)[i]
    c0, c1 = g.col_splits(width)[i]
    return (r0, r1, c0, c1)


def _intersect(a: Block, b: Block) -> Block:
    """The overlap of two blocks, clamped to an empty range where they do not overlap (an empty
    block is still a message: the receiver of an empty slice of rows takes part in the exchange)."""
    r0, c0 = max(a[0], b[0]), max(a[2], b[2])
    return (r0, max(r0, min(a[1], b[1])), c0, max(c0, min(a[3], b[3])))


def _slab(block: Block, inter: Block) -> tuple[int, int, int]:
    """``inter`` as a ``(dim, start, stop)`` slab of ``block`` (dim 0 rows, 1 the last dimension)."""
    if (inter[2], inter[3]) == (block[2], block[3]):
        return (0, inter[0] - block[0], inter[1] - block[0])
    if (inter[0], inter[1]) == (block[0], block[1]):
        return (1, inter[2] - block[2], inter[3] - block[2])
    raise PlanningError(f"block {inter} of {block} is neither whole rows nor whole columns")


def stage_deps(staged: StagedModel, chunking: Chunking, reads: dict[int, dict[str, tuple[tuple[int, ...], ...]]],
                training: bool) -> dict[Task, set[Task]]:
    """Dependencies of the forward (and backward) tasks of ``staged``."""
    K = chunking.num_chunks
    conv_out = {c.output: c for c in staged.conversions}
    producer = {o: st.index for st in staged.stages for o in st.outputs}
    consumers: dict[str, list[int]] = {}
    for st in staged.stages:
        for v in dict.fromkeys(st.inputs):
            consumers.setdefault(v, []).append(st.index)
    deps: dict[Task, set[Task]] = {}
    for st in staged.stages:
        for k in range(K):
            d: set[Task] = set()
            for v in st.inputs:
                base = conv_out[v].value if v in conv_out else v
                if base not in producer:
                    continue  # a model input
                rd = reads.get(st.index, {}).get(v)
                for m in (rd[k] if rd is not None else (k,)):
                    d.add(Task(False, producer[base], m))
            deps[Task(False, st.index, k)] = d
    if not training:
        return deps
    for st in staged.stages:
        for k in range(K):
            d = {Task(False, st.index, k)}
            for o in st.outputs:
                names = [o] + [c.output for c in staged.conversions if c.value == o and c.needs_grad]
                for name in names:
                    for s2 in consumers.get(name, []):
                        rd = reads.get(s2, {}).get(name)
                        for j in range(K):
                            if k in (rd[j] if rd is not None else (j,)):
                                d.add(Task(True, s2, j))
            deps[Task(True, st.index, k)] = d
    return deps


@dataclass(frozen=True)
class _Edge:
    """A value (``base``) read under the name ``name`` by stages of another group than its producer's."""

    base: str
    name: str
    src: int          # producer group index
    dst: int          # consumer group index
    needs_grad: bool


def emit_programs(staged: StagedModel, place: Placement, chunking: Chunking,
                  reads: dict[int, dict[str, tuple[tuple[int, ...], ...]]],
                  dims: dict[str, tuple[tuple[int, ...], str]], needs_grad: set[str], training: bool,
                  cost: Optional[dict[Task, float]] = None,
                  stale: Optional[dict[int, dict[str, tuple[tuple[int, ...], ...]]]] = None
                  ) -> tuple[dict[int, list[Instruction]], list[tuple[float, Task]]]:
    """Per rank, the instructions of one step (forward only unless ``training``) and the global order.

    ``dims``: value -> (per-vertex shape, dtype) of every value that crosses groups; ``needs_grad``:
    the values whose gradients travel back. ``stale``: reads served from the previous step's copy
    (no dependency; the chunk is still sent to the reading rank, which takes it at the end of the
    step). The step ends without the gradient all-reduce / optimizer step (the strategy appends
    them).
    """
    K = chunking.num_chunks
    deps = stage_deps(staged, chunking, reads, training)
    order = list_schedule(deps.keys(), place.resource, deps, cost or {})
    progs: dict[int, list[Instruction]] = {r: [] for r in place.ranks}
    conv_out = {c.output: c for c in staged.conversions}
    producer = {o: st.index for st in staged.stages for o in st.outputs}
    if staged.output not in producer:
        raise PlanningError("the chunked lowering needs the model's output computed by a stage")
    # every cross-group read
    edges: dict[tuple[str, int], _Edge] = {}
    for st in staged.stages:
        gi = place.stage_group[st.index]
        for u in dict.fromkeys(st.inputs):
            base = conv_out[u].value if u in conv_out else u
            if base in producer:
                src = place.stage_group[producer[base]]
                if src == gi:
                    if u in conv_out:
                        raise PlanningError(f"stage {st.index} converts {base!r} within group "
                                            f"{place.groups[gi].name!r}")
                    continue
            elif u in conv_out and place.input_group is not None:
                src = place.input_group
            else:
                continue  # a model input the rank reads directly
            edges.setdefault((u, gi), _Edge(base, u, src, gi, base in needs_grad or
                                            (u in conv_out and conv_out[u].needs_grad)))
    by_base: dict[str, list[_Edge]] = {}
    for e in edges.values():
        by_base.setdefault(e.base, []).append(e)
    # per (name, consumer group): the consumer tasks' chunks reading each chunk, and whether whole chunks
    readers: dict[tuple[str, int], dict[int, set[int]]] = {}
    whole: set[tuple[str, int]] = set()
    for st in staged.stages:
        gi = place.stage_group[st.index]
        for u in dict.fromkeys(st.inputs):
            if (u, gi) not in edges:
                continue
            rd = reads.get(st.index, {}).get(u)
            if rd is not None:
                whole.add((u, gi))
            per = readers.setdefault((u, gi), {})
            sd = (stale or {}).get(st.index, {}).get(u)
            for k in range(K):
                for m in (rd[k] if rd is not None else (k,)) + (sd[k] if sd is not None else ()):
                    per.setdefault(m, set()).add(k)

    cache: dict[tuple[_Edge, int], list[tuple[int, int, Block, Block, Block]]] = {}

    def messages(e: _Edge, m: int) -> list[tuple[int, int, Block, Block, Block]]:
        """(producer rank, consumer rank, held block, needed block, intersection) of ``e`` at chunk ``m``."""
        key = (e, m)
        if key in cache:
            return cache[key]
        sg, dg = place.groups[e.src], place.groups[e.dst]
        d = dims[e.base][0]
        width = d[-1] if d else 1
        need_members = sorted({j for k in readers.get((e.name, e.dst), {}).get(m, ()) for j in dg.runners(k)})
        out = []
        for j in need_members:
            need = needed_block(dg, j, chunking, m, width, (e.name, e.dst) in whole)
            for i, a in enumerate(sg.members):
                held = held_block(sg, i, chunking, m, width)
                if held is None:
                    continue
                inter = _intersect(held, need)
                if inter[0] == inter[1] and inter[2] == inter[3]:
                    continue  # disjoint in both dimensions: nothing to say
                out.append((a, dg.members[j], held, need, inter))
        cache[key] = out
        return out

    def shape_of(e: _Edge, inter: Block) -> tuple[int, ...]:
        d = dims[e.base][0]
        return (inter[1] - inter[0],) + tuple(d[:-1]) + ((inter[3] - inter[2],) if d else ())

    inflight: dict[tuple[int, int], deque[Recv]] = {}
    received: set[tuple[int, int, str, int, bool]] = set()  # (rank, from, value, chunk, grad) taken

    def send(e: _Edge, m: int, grad: bool, only: Optional[int] = None) -> None:
        dtype = dims[e.base][1]
        local = "" if e.name == e.base else e.name
        for a, b, held, need, inter in messages(e, m):
            if only is not None and b != only:
                continue
            shape = shape_of(e, inter)
            if not grad:
                progs[a].append(Send(e.base, m, b, shape, dtype, part=_slab(held, inter)))
                inflight.setdefault((a, b), deque()).append(
                    Recv(e.base, m, a, shape, dtype, local=local, part=_slab(need, inter)))
            else:
                progs[b].append(Send(e.base, m, a, shape, dtype, grad=True, local=local, part=_slab(need, inter)))
                inflight.setdefault((b, a), deque()).append(
                    Recv(e.base, m, b, shape, dtype, grad=True, part=_slab(held, inter)))

    def receive(r: int, src: int, value: str, k: int, grad: bool) -> None:
        if (r, src, value, k, grad) in received:
            return
        queue = inflight.get((src, r), ())
        while queue:
            msg = queue.popleft()
            progs[r].append(msg)
            received.add((r, src, msg.value, msg.chunk, msg.grad))
            if (msg.value, msg.chunk, msg.grad) == (value, k, grad):
                return
        raise PlanningError(f"chunk schedule: rank {r} needs {'the gradient of ' if grad else ''}{value} c{k} from "
                            f"rank {src}, which was never sent")

    # contributions missing before the gradient of (name, consumer group, member, chunk) is complete
    missing: dict[tuple[str, int, int, int], int] = {}
    for st in staged.stages:
        gi = place.stage_group[st.index]
        g = place.groups[gi]
        for u in dict.fromkeys(st.inputs):
            if (u, gi) in edges:
                rd = reads.get(st.index, {}).get(u)
                for k in range(K):
                    for j in g.runners(k):
                        for m in (rd[k] if rd is not None else (k,)):
                            key = (u, gi, g.members[j], m)
                            missing[key] = missing.get(key, 0) + 1

    for e in edges.values():  # model inputs held by the input group: sent before anything else
        if e.base not in producer:
            for m in range(K):
                send(e, m, False)
    for _, t in order:
        st = staged.stages[t.stage]
        gi = place.stage_group[t.stage]
        g = place.groups[gi]
        runners = [g.members[j] for j in g.runners(t.chunk)]
        if not t.backward:
            for u in st.inputs:
                e = edges.get((u, gi))
                if e is None:
                    continue
                rd = reads.get(t.stage, {}).get(u)
                for m in (rd[t.chunk] if rd is not None else (t.chunk,)):
                    for a, b, *_ in messages(e, m):
                        if b in runners:
                            receive(b, a, e.base, m, False)
            for r in runners:
                progs[r].append(Forward(t.stage, t.chunk))
            for o in st.outputs:
                for e in by_base.get(o, []):
                    send(e, t.chunk, False)
        else:
            for o in st.outputs:
                for e in by_base.get(o, []):
                    if e.needs_grad:
                        for a, b, *_ in messages(e, t.chunk):
                            if a in runners:
                                receive(a, b, e.base, t.chunk, True)
            for r in runners:
                progs[r].append(Backward(t.stage, t.chunk))
            for u in dict.fromkeys(st.inputs):
                e = edges.get((u, gi))
                if e is None or not e.needs_grad:
                    continue
                rd = reads.get(t.stage, {}).get(u)
                for r in runners:
                    done = []
                    for m in (rd[t.chunk] if rd is not None else (t.chunk,)):
                        missing[u, gi, r, m] -= 1
                        if missing[u, gi, r, m] == 0:
                            done.append(m)
                    for m in sorted(done):  # the gradient of (u, m) on r is complete: send it back
                        send(e, m, True, only=r)
    for (src, dst), queue in inflight.items():  # messages no task needed (not expected): receive them last
        progs[dst].extend(queue)
        queue.clear()
    return progs, order


def stage_groups(staged: StagedModel, layout_of: Any) -> dict[int, str]:
    """The layout label (``rows`` / ``cols``) of every stage of a ``pure_stages`` split."""
    groups = {}
    for st in staged.stages:
        lays = {layout_of(op) for op in st.ops if op in staged.stage_of}
        if len(lays) != 1:
            raise PlanningError(f"stage {st.index} mixes layouts {sorted(lays)}; the chunked lowering needs one per "
                                "stage")
        groups[st.index] = lays.pop()
    return groups


def stage_reads(staged: StagedModel, groups: dict[int, str], chunking: Chunking,
                source_inputs: dict[int, set[str]]) -> dict[int, dict[str, tuple[tuple[int, ...], ...]]]:
    """Cross-chunk reads of every ``cols`` stage: the converted source values of its propagations."""
    out: dict[int, dict[str, tuple[tuple[int, ...], ...]]] = {}
    for st in staged.stages:
        if groups[st.index] != "cols":
            continue
        for v in source_inputs.get(st.index, set()):
            out.setdefault(st.index, {})[v] = chunking.reads
    return out


def with_reads(stage: StageSpec, reads: dict[str, tuple[tuple[int, ...], ...]], group: str,
               stale: Optional[dict[str, tuple[tuple[int, ...], ...]]] = None) -> StageSpec:
    """``stage`` carrying its cross-chunk reads (fresh, and stale ones), and its group."""
    from dataclasses import replace

    return replace(stage, reads=tuple(sorted(reads.items())), group=group,
                   stale=tuple(sorted((stale or {}).items())))


# --------------------------------------------------------------------------- one group, chunk-level collectives
def collective_chunk_program(staged: StagedModel, chunking: Chunking,
                             reads: dict[int, dict[str, tuple[tuple[int, ...], ...]]], order: list[tuple[float, Task]],
                             convert: Callable[[Conversion, int, bool], list[Instruction]],
                             training: bool) -> list[Instruction]:
    """The instructions of one step on a rank of a group that runs *every* stage together, chunk by
    chunk, with each conversion cut into chunk-level collectives (NeutronTP §4.2, Fig. 9c–d).

    ``order``: the global task order (:func:`list_schedule` over one resource); every member runs
    the same order, so their collectives line up. ``convert(conversion, chunk, grad)``: the rank's
    collective for one chunk of a conversion (or of its gradient). Placement of the collectives:

    - a conversion of a model input runs for every chunk before anything else;
    - a conversion of a stage output for chunk ``k`` runs right after ``Forward(stage, k)`` (the
      split of chunk ``k + 1`` is posted while chunk ``k`` is aggregated, Fig. 9c), once per chunk
      whatever the number of chunks that read it: a vertex's slice crosses once (§4.2.2's
      deduplication at chunk granularity);
    - the gradient of the loss's conversion runs right before the Backward of the stage producing
      the output; the gradient of any other conversion of chunk ``m`` right after the last Backward
      that reads chunk ``m`` (all its contributions are in).

    The step ends without the gradient all-reduce and optimizer step (the strategy appends them).
    """
    K = chunking.num_chunks
    conv_out = {c.output: c for c in staged.conversions}
    by_value: dict[str, list[Conversion]] = {}
    for c in staged.conversions:
        by_value.setdefault(c.value, []).append(c)
    producer = {o: st.index for st in staged.stages for o in st.outputs}

    def read(stage: int, name: str, k: int) -> tuple[int, ...]:
        rd = reads.get(stage, {}).get(name)
        return rd[k] if rd is not None else (k,)

    missing: dict[tuple[str, int], int] = {}
    for st in staged.stages:
        for u in dict.fromkeys(st.inputs):
            if u in conv_out and conv_out[u].needs_grad:
                for k in range(K):
                    for m in read(st.index, u, k):
                        missing[u, m] = missing.get((u, m), 0) + 1
    out: list[Instruction] = []
    for c in staged.conversions:
        if c.value not in producer:
            for m in range(K):
                out.extend(convert(c, m, False))
    for _, t in order:
        st = staged.stages[t.stage]
        if not t.backward:
            out.append(Forward(t.stage, t.chunk))
            for o in st.outputs:
                for c in by_value.get(o, []):
                    out.extend(convert(c, t.chunk, False))
            continue
        if not training:
            continue
        for o in st.outputs:
            for c in by_value.get(o, []):
                if c.consumers == (OUTPUT,) and c.needs_grad:
                    out.extend(convert(c, t.chunk, True))
        out.append(Backward(t.stage, t.chunk))
        for u in dict.fromkeys(st.inputs):
            c = conv_out.get(u)
            if c is None or not c.needs_grad:
                continue
            for m in read(t.stage, u, t.chunk):
                missing[u, m] -= 1
                if missing[u, m] == 0:
                    out.extend(convert(c, m, True))
    return out
