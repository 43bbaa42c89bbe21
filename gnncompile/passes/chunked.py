"""Chunked two-group lowering: ``rows`` stages on one device group, ``cols`` stages on another, and
graph chunks pipelined between them over point-to-point messages.

The shared machinery of the strategies that put dense (T) and sparse (P) work on different devices
and stream the graph through them in chunks: MixGCN's mixture of accelerators with its fine-grain
pipeline (``mop``, §3.2.2) and NeutronTask's T/P task placement with its chunk pipeline (``task``,
§4.2). A strategy module decides the layouts (:class:`~gnncompile.passes.lower.Decisions` with
``pure_stages``), the two groups and the chunking; this module

1. cuts the vertices into **chunks** (:class:`Chunking`: contiguous ranges of a vertex order,
   optionally a reordering such as reverse Cuthill–McKee) and finds, for every chunk of
   destinations, the chunks its in-edges read (:func:`chunk_reads`): a ``cols`` stage's chunk
   ``j`` waits for exactly those chunks of its source value (exact dependencies: nothing is
   skipped or stale);
2. builds each chunk's **graph slice** (:func:`chunk_graph`): the chunk's destinations and their
   in-edges, sources renumbered into the order the stage concatenates its source chunks (the chunk
   itself first, so self loops read its own rows), normalization coefficients of the whole graph;
3. **schedules** forward and backward tasks ``(stage, chunk)`` on the two groups by list scheduling
   (:func:`list_schedule`: each group runs one task at a time, a task starts when the tasks it
   depends on are done, ties by chunk then depth), and projects the resulting global order onto
   each rank (:func:`emit_programs`): a stage's outputs are sent (eager ``SEND``) right after it
   runs, received right before their first use, gradients likewise in reverse. Because every rank
   follows one global order in which each send precedes its receive, the program cannot deadlock.

Messages: for a ``rows -> cols`` conversion of ``v`` at chunk ``k``, rows-group rank ``i`` sends the
columns of ``cols`` rank ``q`` of its rows of the chunk (``SEND v ck [:,c0:c1] ->q``); rank ``q``
receives them into rows ``[lo, hi)`` of ``v@cols`` chunk ``k``. The gradient goes the opposite way.
A ``cols -> rows`` conversion is the mirror image. Each rank moves ``(rows of its chunk part) x
(columns of the peer)`` per message: the bytes of an all-to-all between the groups.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.fx

from ..errors import PlanningError
from ..graph.core import Graph
from ..graph.shard import LocalGraph
from ..ir.plan import Backward, Forward, Instruction, Recv, Send, StageSpec
from .lower import OUTPUT, Conversion, StagedModel

__all__ = ["Chunking", "chunk_bounds", "chunk_reads", "chunk_graph", "Task", "list_schedule", "TwoGroups",
           "emit_programs", "stage_groups"]


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
    """For every chunk ``j`` of destinations: the chunks its in-edges' sources lie in, ``j`` first
    (its own rows: self loops), then the others in ascending order."""
    b = torch.as_tensor(list(bounds), dtype=torch.int64)
    indptr, indices = graph.indptr.cpu(), graph.indices.cpu()
    out = []
    for j in range(len(bounds) - 1):
        src = indices[int(indptr[bounds[j]]):int(indptr[bounds[j + 1]])]
        chunks = torch.unique(torch.searchsorted(b, src, right=True) - 1).tolist()
        out.append((j,) + tuple(k for k in chunks if k != j))
    return tuple(out)


@dataclass(frozen=True)
class Chunking:
    """Contiguous chunks of a vertex order and what each chunk's propagation reads.

    ``bounds``: chunk ``k`` is positions ``[bounds[k], bounds[k+1])`` of the order; ``order``:
    position -> vertex id (``None``: the identity); ``reads[j]``: the chunks chunk ``j``'s in-edges
    read, ``j`` first.
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
    """Chunk ``j``'s destinations with all their in-edges; sources numbered in ``reads[j]`` order.

    ``graph`` is in the chunking's vertex order; ``edge_coef`` / ``loop_coef`` its normalization
    coefficients (what the model's propagations use), sliced to the chunk's edges.
    """
    lo, hi = chunking.bounds[j], chunking.bounds[j + 1]
    indptr, indices = graph.indptr.cpu(), graph.indices.cpu()
    e0, e1 = int(indptr[lo]), int(indptr[hi])
    src = indices[e0:e1]
    b = torch.as_tensor(chunking.bounds, dtype=torch.int64)
    of = torch.searchsorted(b, src, right=True) - 1
    local_start = torch.zeros(chunking.num_chunks, dtype=torch.int64)
    pos = 0
    for k in chunking.reads[j]:
        local_start[k] = pos
        pos += chunking.size(k)
    local_src = local_start[of] + (src - b[of])
    eids = torch.arange(e0, e1)
    return LocalGraph(
        indptr[lo:hi + 1] - e0, local_src, hi - lo, pos,
        edge_weight=None if graph.edge_weight is None else graph.edge_weight.cpu()[eids],
        norm_coef={nm: c.cpu()[eids] for nm, c in edge_coef.items()},
        loop_norm_coef={nm: (c[0].cpu()[eids], c[1].cpu()[lo:hi]) for nm, c in loop_coef.items()},
        name=f"{graph.name}[chunk {j}]")


# --------------------------------------------------------------------------- tasks and list scheduling
@dataclass(frozen=True, order=True)
class Task:
    """Forward (``backward=False``) or backward of ``stage`` on ``chunk``."""

    backward: bool
    stage: int
    chunk: int

    def __str__(self) -> str:
        return f"{'B' if self.backward else 'F'}{self.stage}c{self.chunk}"


def list_schedule(tasks: Iterable[Task], group_of: dict[int, str], deps: dict[Task, set[Task]],
                  cost: dict[Task, float]) -> list[tuple[float, Task]]:
    """Start times of ``tasks`` when each group runs one task at a time (list scheduling).

    Repeatedly starts, over both groups, the ready task that can start earliest; ties go to the
    lower chunk, then the deeper stage for forwards (a chunk goes through before the next enters)
    and the later stage for backwards. Returns ``(start, task)`` in start order.
    """
    tasks = list(tasks)
    remaining = {t: len(deps.get(t, ())) for t in tasks}
    users: dict[Task, list[Task]] = {t: [] for t in tasks}
    for t in tasks:
        for d in deps.get(t, ()):
            users[d].append(t)
    end: dict[Task, float] = {}
    free: dict[str, float] = {g: 0.0 for g in set(group_of.values())}
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
            start = max(at, free[group_of[t.stage]])
            key = (start, p)
            if best is None or key < best[0]:
                best = (key, i)
        (start, _), i = best
        _, _, t = ready.pop(i)
        heapq.heapify(ready)
        end[t] = start + cost.get(t, 1.0)
        free[group_of[t.stage]] = end[t]
        out.append((start, t))
        for u in users[t]:
            remaining[u] -= 1
            if not remaining[u]:
                heapq.heappush(ready, (max(end[d] for d in deps[u]), prio(u), u))
    if len(out) != len(tasks):
        stuck = sorted(t for t in tasks if t not in end)
        raise PlanningError(f"chunk schedule: tasks {', '.join(map(str, stuck[:6]))} depend on each other in a cycle")
    return out


def stage_groups(staged: StagedModel, layout_of: Any) -> dict[int, str]:
    """The layout (``rows`` / ``cols``) of every stage of a ``pure_stages`` split."""
    groups = {}
    for st in staged.stages:
        lays = {layout_of(op) for op in st.ops if op in staged.stage_of}
        if len(lays) != 1:
            raise PlanningError(f"stage {st.index} mixes layouts {sorted(lays)}; the chunked lowering needs one per stage")
        groups[st.index] = lays.pop()
    return groups


# --------------------------------------------------------------------------- programs
@dataclass(frozen=True)
class TwoGroups:
    """The ``rows`` group (vertex rows of every chunk split over its ranks) and the ``cols`` group
    (every vertex, feature columns split over its ranks)."""

    rows: tuple[int, ...]
    cols: tuple[int, ...]

    def sub_rows(self, chunking: Chunking, k: int) -> list[tuple[int, int]]:
        """Chunk ``k``'s positions held by each rank of the rows group (balanced, in rank order)."""
        n, t = chunking.size(k), len(self.rows)
        out, lo = [], chunking.bounds[k]
        for i in range(t):
            m = n // t + (1 if i < n % t else 0)
            out.append((lo, lo + m))
            lo += m
        return out

    def col_splits(self, width: int) -> list[tuple[int, int]]:
        p = len(self.cols)
        out, lo = [], 0
        for q in range(p):
            m = width // p + (1 if q < width % p else 0)
            out.append((lo, lo + m))
            lo += m
        return out


def _stage_deps(staged: StagedModel, groups: dict[int, str], chunking: Chunking,
                reads: dict[int, dict[str, tuple[tuple[int, ...], ...]]], training: bool) -> dict[Task, set[Task]]:
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


def emit_programs(staged: StagedModel, groups: dict[int, str], two: TwoGroups, chunking: Chunking,
                  reads: dict[int, dict[str, tuple[tuple[int, ...], ...]]], widths: dict[str, tuple[int, str]],
                  training: bool, cost: Optional[dict[Task, float]] = None
                  ) -> tuple[dict[int, list[Instruction]], list[tuple[float, Task]]]:
    """Per rank, the instructions of one step (forward only unless ``training``) and the global order.

    ``widths``: value -> (row width, dtype) of every converted value. The step ends without the
    gradient all-reduce / optimizer step (the strategy appends them).
    """
    K = chunking.num_chunks
    deps = _stage_deps(staged, groups, chunking, reads, training)
    order = list_schedule(deps.keys(), groups, deps, cost or {})
    members = {"rows": two.rows, "cols": two.cols}
    progs: dict[int, list[Instruction]] = {r: [] for r in two.rows + two.cols}
    by_value: dict[str, list[Conversion]] = {}
    for c in staged.conversions:
        if OUTPUT in c.consumers:
            raise PlanningError("the chunked lowering needs the model's output computed by the rows group")
        by_value.setdefault(c.value, []).append(c)
    conv_out = {c.output: c for c in staged.conversions}
    received: set[tuple[int, int, str, int, bool]] = set()  # (rank, from, value, chunk, grad) taken
    # contributions still missing before the gradient of (value@conv, chunk) is complete on a rank
    missing: dict[tuple[str, int], int] = {}
    for st in staged.stages:
        for v in dict.fromkeys(st.inputs):
            if v in conv_out:
                rd = reads.get(st.index, {}).get(v)
                for j in range(K):
                    for m in (rd[j] if rd is not None else (j,)):
                        missing[v, m] = missing.get((v, m), 0) + 1

    sub = [two.sub_rows(chunking, k) for k in range(K)]
    row_index = {r: i for i, r in enumerate(two.rows)}
    col_index = {r: q for q, r in enumerate(two.cols)}
    splits = {v: two.col_splits(w) for v, (w, _) in widths.items()}

    def pieces(c: Conversion, k: int, src_rank: int, dst_rank: int, grad: bool) -> tuple[Send, Recv]:
        """The message of conversion ``c`` at chunk ``k`` from ``src_rank`` to ``dst_rank`` (or, with
        ``grad``, its gradient going back from ``dst_rank`` to ``src_rank``)."""
        _, dtype = widths[c.value]
        cols = splits[c.value]
        if c.kind == "cols":  # rows group -> cols group
            i, q = row_index[src_rank], col_index[dst_rank]
        else:
            i, q = row_index[dst_rank], col_index[src_rank]
        lo, hi = sub[k][i]
        base = chunking.bounds[k]
        shape = (hi - lo, cols[q][1] - cols[q][0])
        row_part = (0, lo - base, hi - base)
        col_part = (1, cols[q][0], cols[q][1])
        # the rows side slices columns, the cols side places rows
        rows_part, cols_part = col_part, row_part
        src_part, dst_part = (rows_part, cols_part) if c.kind == "cols" else (cols_part, rows_part)
        if not grad:
            return (Send(c.value, k, dst_rank, shape, dtype, part=src_part),
                    Recv(c.value, k, src_rank, shape, dtype, local=c.output, part=dst_part))
        return (Send(c.value, k, src_rank, shape, dtype, grad=True, local=c.output, part=dst_part),
                Recv(c.value, k, dst_rank, shape, dtype, grad=True, part=src_part))

    def other(g: str) -> tuple[int, ...]:
        return members["cols" if g == "rows" else "rows"]

    # messages in flight per (src, dst), in send order: a receiver takes them in that order (FIFO
    # matching), so needing one message means receiving every earlier one first
    inflight: dict[tuple[int, int], list[Recv]] = {}

    def send(c: Conversion, k: int, src: int, dst: int, grad: bool) -> None:
        if not grad:
            s_, r_ = pieces(c, k, src, dst, False)
        else:  # the gradient goes from dst back to src
            s_, r_ = pieces(c, k, src, dst, True)
            src, dst = dst, src
        progs[src].append(s_)
        inflight.setdefault((src, dst), []).append(r_)

    def receive(r: int, src: int, value: str, k: int, grad: bool) -> None:
        if (r, src, value, k, grad) in received:
            return
        queue = inflight.get((src, r), [])
        while queue:
            m = queue.pop(0)
            progs[r].append(m)
            received.add((r, src, m.value, m.chunk, m.grad))
            if (m.value, m.chunk, m.grad) == (value, k, grad):
                return
        raise PlanningError(f"chunk schedule: rank {r} needs {'the gradient of ' if grad else ''}{value} c{k} from "
                            f"rank {src}, which was never sent")

    # conversions of model inputs (features read by a propagation): sent before anything else
    for v, convs in by_value.items():
        if any(v in st.outputs for st in staged.stages):
            continue
        for c in convs:
            src_g = "rows" if c.kind == "cols" else "cols"
            for k in range(K):
                for r in members[src_g]:
                    for q in other(src_g):
                        send(c, k, r, q, False)
    for _, t in order:
        g = groups[t.stage]
        st = staged.stages[t.stage]
        for r in members[g]:
            if not t.backward:
                for v in st.inputs:
                    c = conv_out.get(v)
                    if c is None:
                        continue
                    rd = reads.get(t.stage, {}).get(v)
                    for m in (rd[t.chunk] if rd is not None else (t.chunk,)):
                        for q in other(g):
                            receive(r, q, c.value, m, False)
                progs[r].append(Forward(t.stage, t.chunk))
                for o in st.outputs:
                    for c in by_value.get(o, []):
                        for q in other(g):
                            send(c, t.chunk, r, q, False)
            else:
                for o in st.outputs:
                    for c in by_value.get(o, []):
                        if c.needs_grad:
                            for q in other(g):
                                receive(r, q, c.value, t.chunk, True)
                progs[r].append(Backward(t.stage, t.chunk))
        if t.backward:
            for v in dict.fromkeys(st.inputs):
                c = conv_out.get(v)
                if c is None or not c.needs_grad:
                    continue
                rd = reads.get(t.stage, {}).get(v)
                done = []
                for m in (rd[t.chunk] if rd is not None else (t.chunk,)):
                    missing[v, m] -= 1
                    if missing[v, m] == 0:
                        done.append(m)
                for m in sorted(done):  # the gradient of (v@conv, m) is complete: send it back
                    for r in members[g]:
                        for q in other(g):
                            send(c, m, q, r, True)  # forward: q (producer) -> r (consumer)
    for (src, dst), queue in inflight.items():  # messages no task needed (not expected): receive them last
        progs[dst].extend(queue)
        queue.clear()
    return progs, order


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


def with_reads(stage: StageSpec, reads: dict[str, tuple[tuple[int, ...], ...]], group: str) -> StageSpec:
    """``stage`` carrying its cross-chunk reads and its group."""
    from dataclasses import replace

    return replace(stage, reads=tuple(sorted(reads.items())), group=group)


def elsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def message_bytes(progs: dict[int, list[Instruction]]) -> dict[int, tuple[int, int]]:
    """Bytes sent and received per rank by the messages of ``progs``."""
    out = {}
    for r, prog in progs.items():
        sent = sum(math.prod(i.shape) * elsize(i.dtype) for i in prog if isinstance(i, Send))
        recv = sum(math.prod(i.shape) * elsize(i.dtype) for i in prog if isinstance(i, Recv))
        out[r] = (sent, recv)
    return out
