"""Step schedules as passes: one list scheduler orders the compute, two passes add the communication.

Every strategy's training step is built the same way, in the style of torch.distributed.pipelining
(a compute-only schedule, then a pass that adds the sends and receives):

1. **Compute dependencies** (:func:`compute_deps`): the step's compute is ``Forward(stage, chunk)``
   and ``Backward(stage, chunk)`` (the plan's own instructions). A forward waits for the forwards
   producing the chunks of its inputs it reads (``reads``: a chunked propagation's chunk ``j`` reads
   the source chunks its in-edges reach; other inputs their own chunk); a backward waits for its
   forward and for the backwards of every task reading its outputs' chunks.
2. **One list scheduler** (:func:`list_schedule`): every resource (a rank group, a member of a group
   that deals whole chunks, or the one group of a single-group strategy) runs one task at a time; a
   task starts when its dependencies are done. The result, an :data:`Order`, is the global
   compute-only order; :func:`rank_orders` projects it onto the ranks. An unchunked single-group
   step comes out as every forward in stage order, then the backwards in reverse.
3. **Communication insertion**, onto the global order, so that every rank's program follows one
   order (a message is sent before it is received, a collective's members issue it in the same
   order, and no program can deadlock):

   - :func:`insert_collectives` (every rank runs every stage: ``data``, ``tensor``): each
     conversion of chunk ``m`` becomes the rank's collective(s) ``convert(conversion, m, grad)``,
     posted as early as it can be: a model input's at the start of the step, a stage output's right
     after the forward producing it (so a posted all-to-all runs while the next task computes,
     NeutronTP Fig. 9c); the loss's conversion's gradient right before the backward of the stage
     producing the output, any other gradient right after the last backward reading that chunk (all
     its contributions are in);
   - :func:`insert_messages` (stages on different groups: ``mop``, ``task``): a value read by
     another group's stage moves per chunk as point-to-point blocks (the intersection of what each
     producer rank holds with what each consumer rank reads, :mod:`gnncompile.passes.chunked`): an
     eager ``SEND`` right after the producing forward, the ``RECV`` right before its first use;
     gradients likewise in reverse.

The driver (:mod:`gnncompile.passes.driver`) then appends the gradient reduction and the optimizer
step and inserts FREE.
"""

from __future__ import annotations

import heapq
from collections import deque
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Iterator, Mapping, Optional, Sequence, Union

from ..errors import PlanningError
from ..ir.plan import Backward, Forward, Instruction, RankSizes, Recv, Send, StageSpec
from .chunked import Block, Chunking, Placement, held_block, intersect, needed_block, slab
from .lower import OUTPUT, Conversion, StagedModel

__all__ = ["Compute", "Order", "Reads", "compute_deps", "list_schedule", "gpipe", "one_f_one_b", "rank_orders",
           "insert_collectives", "insert_messages", "count_messages", "MAX_MESSAGES", "StepOutline", "RankOutline", "Pruned", "checking_outlines", "check_rank"]

#: A task of the step: a stage's forward or backward on one chunk.
Compute = Union[Forward, Backward]

#: The global compute-only order of a step: ``(start time, task)`` in start order.
Order = list[tuple[float, Compute]]

#: Cross-chunk reads: stage -> input name -> ``reads[k]``, the chunks of the input chunk ``k`` reads
#: (inputs not listed read their own chunk).
Reads = Mapping[int, Mapping[str, Sequence[Sequence[int]]]]


def _read(reads: Optional[Reads], stage: int, name: str, k: int) -> Sequence[int]:
    rd = (reads or {}).get(stage, {}).get(name)
    return rd[k] if rd is not None else (k,)


def compute_deps(staged: StagedModel, chunks: int = 1, reads: Optional[Reads] = None,
                 training: bool = True) -> dict[Compute, set[Compute]]:
    """The tasks of one step (forwards, and backwards when ``training``) with their dependencies.

    Ensures: the keys are every ``Forward(s, k)`` (and ``Backward(s, k)``) of the ``chunks`` chunks;
    each value is the set of tasks that must be done before it starts (module docstring).
    """
    conv_out = {c.output: c for c in staged.conversions}
    producer = {o: st.index for st in staged.stages for o in st.outputs}
    consumers: dict[str, list[int]] = {}
    for st in staged.stages:
        for v in dict.fromkeys(st.inputs):
            consumers.setdefault(v, []).append(st.index)
    # every task made once (the sets below hold the same objects)
    fwd = {st.index: [Forward(st.index, k) for k in range(chunks)] for st in staged.stages}
    deps: dict[Compute, set[Compute]] = {}
    for st in staged.stages:
        read = [(fwd[producer[base]], v) for v in st.inputs
                for base in [conv_out[v].value if v in conv_out else v] if base in producer]  # else a model input
        for k in range(chunks):
            d: set[Compute] = set()
            for made, v in read:
                d.update(map(made.__getitem__, _read(reads, st.index, v, k)))
            deps[fwd[st.index][k]] = d
    if not training:
        return deps
    bwd = {st.index: [Backward(st.index, k) for k in range(chunks)] for st in staged.stages}
    readers: dict[tuple[int, str], list[list[int]]] = {}  # (stage, input) -> per chunk k, the chunks j reading k

    def reading(s2: int, name: str, k: int) -> list[int]:
        inv = readers.get((s2, name))
        if inv is None:
            inv = readers[s2, name] = [[] for _ in range(chunks)]
            for j in range(chunks):
                for m in dict.fromkeys(_read(reads, s2, name, j)):
                    inv[m].append(j)
        return inv[k]

    for st in staged.stages:
        read_by = [(s2, name) for o in st.outputs
                   for name in [o] + [c.output for c in staged.conversions if c.value == o and c.needs_grad]
                   for s2 in consumers.get(name, [])]
        for k in range(chunks):
            d = {fwd[st.index][k]}
            for s2, name in read_by:
                d.update(map(bwd[s2].__getitem__, reading(s2, name, k)))
            deps[bwd[st.index][k]] = d
    return deps


def gpipe(t: Compute) -> tuple:
    """Ties: forwards first, the lower chunk, then the deeper stage for forwards (a chunk goes
    through before the next enters) and the later stage for backwards (GPipe's order)."""
    return (isinstance(t, Backward), t.chunk, -t.stage)


def one_f_one_b(t: Compute) -> tuple:
    """1F1B's ties (PipeDream-flush, Megatron-LM): a ready backward before a ready forward, so a
    stage alternates one forward and one backward once its first backward is ready and frees a
    chunk's activations as early as its dependencies allow."""
    return (not isinstance(t, Backward), t.chunk, -t.stage if isinstance(t, Forward) else t.stage)


def list_schedule(deps: Mapping[Compute, Iterable[Compute]],
                  resource: Union[Callable[[Compute], Hashable], Mapping[int, Hashable], None] = None,
                  cost: Optional[Mapping[Compute, float]] = None,
                  delay: Optional[Callable[[Compute, Compute], float]] = None,
                  priority: Callable[[Compute], tuple] = gpipe) -> Order:
    """Start times of the tasks of ``deps`` when each resource runs one task at a time.

    ``resource``: a task's resource (a function), a mapping stage -> resource, or ``None`` (one
    resource runs everything). ``cost``: a task's duration (default 1). ``delay(d, t)``: time
    between the end of dependency ``d`` and the earliest start of ``t`` (the communication between
    them; default none). Repeatedly starts the ready task that can start earliest on its resource,
    ties by ``priority`` (default :func:`gpipe`, GPipe's order; :func:`one_f_one_b`). Returns
    ``(start, task)`` in start order; raises :class:`PlanningError` if the dependencies have a cycle.
    """
    if resource is None:
        def res(t: Compute) -> Hashable:
            return 0
    elif callable(resource):
        res = resource
    else:
        table = resource

        def res(t: Compute) -> Hashable:
            return table[t.stage]
    cost = cost or {}
    # the tasks by position: one hash per task and dependency, every key computed once
    tasks = list(deps)
    index = {t: i for i, t in enumerate(tasks)}
    n = len(tasks)
    needs: list[list[int]] = []
    users: list[list[int]] = [[] for _ in range(n)]
    for i, t in enumerate(tasks):
        mine = []
        for d in set(deps[t]):
            j = index.get(d)
            if j is None:
                raise PlanningError(f"schedule: task {t} depends on {d}, which is not a task of the step")
            mine.append(j)
            users[j].append(i)
        needs.append(mine)
    remaining = [len(m) for m in needs]
    resource_of = [res(t) for t in tasks]
    prio = [priority(t) for t in tasks]
    duration = [cost.get(t, 1.0) for t in tasks]
    end: list[Optional[float]] = [None] * n
    # per resource, its ready tasks: those whose data arrive after it is free, by (arrival, priority),
    # and those that could start the moment it is free, by priority; equal keys by readiness order
    later: dict[Hashable, list[tuple[float, tuple, int, int]]] = {}
    now: dict[Hashable, list[tuple[tuple, int, float, int]]] = {}
    free: dict[Hashable, float] = {}
    seq = 0

    def make_ready(i: int, at: float) -> None:
        nonlocal seq
        r = resource_of[i]
        seq += 1
        if at <= free.get(r, 0.0):
            heapq.heappush(now.setdefault(r, []), (prio[i], seq, at, i))
        else:
            heapq.heappush(later.setdefault(r, []), (at, prio[i], seq, i))

    for i in range(n):
        if not remaining[i]:
            make_ready(i, 0.0)
    out: Order = []
    while True:
        # the task that can start first on its resource (its data ready time vs the resource's free
        # time), ties by priority: a resource's best is its first task ready by the time it is free,
        # else the first to arrive
        best: Optional[tuple[tuple, Hashable]] = None
        for r in set(now) | set(later):
            if now.get(r):
                pr, order, _, _ = now[r][0]
                key = (free.get(r, 0.0), pr, order)
            elif later.get(r):
                key = later[r][0][:3]
            else:
                continue
            if best is None or key < best[0]:
                best = (key, r)
        if best is None:
            break
        (start, _, _), r = best
        i = heapq.heappop(now[r])[3] if now.get(r) else heapq.heappop(later[r])[3]
        e = end[i] = start + duration[i]
        free[r] = e
        waiting = later.get(r, [])
        while waiting and waiting[0][0] <= e:  # ready by the time the resource is free
            at, pr, order, u = heapq.heappop(waiting)
            heapq.heappush(now.setdefault(r, []), (pr, order, at, u))
        out.append((start, tasks[i]))
        for u in users[i]:
            remaining[u] -= 1
            if not remaining[u]:
                if delay is None:
                    make_ready(u, max(end[j] for j in needs[u]))
                else:
                    make_ready(u, max(end[index[d]] + delay(d, tasks[u]) for d in deps[tasks[u]]))
    if len(out) != n:
        stuck = sorted((t for i, t in enumerate(tasks) if end[i] is None), key=priority)
        raise PlanningError(f"schedule: tasks {', '.join(map(str, stuck[:6]))} depend on each other in a cycle")
    return out


def rank_orders(order: Order, runners: Callable[[Compute], Iterable[int]]) -> dict[int, list[Compute]]:
    """Each rank's compute-only order: the tasks of ``order`` that ``runners(task)`` run it, in order."""
    out: dict[int, list[Compute]] = {}
    for _, t in order:
        for r in runners(t):
            out.setdefault(r, []).append(t)
    return out


# --------------------------------------------------------------------------- one group: collectives
def insert_collectives(staged: StagedModel, order: Order, convert: Callable[[Conversion, int, bool], list[Instruction]],
                       chunks: int = 1, reads: Optional[Reads] = None) -> list[Instruction]:
    """One rank's step when every rank runs every task of ``order``: the compute with each
    conversion's collectives placed as the module docstring says.

    ``convert(conversion, chunk, grad)``: the rank's instructions for one chunk of a conversion (of
    its gradient when ``grad``); every rank's ``convert`` must issue the same collectives so that
    they line up. Ends without the gradient reduction and the optimizer step.
    """
    conv_out = {c.output: c for c in staged.conversions}
    producer = {o: st.index for st in staged.stages for o in st.outputs}
    after: dict[int, list[Conversion]] = {}  # stage -> the conversions of its outputs, in conversion order
    for c in staged.conversions:
        if c.value in producer:
            after.setdefault(producer[c.value], []).append(c)
    index = {c.output: i for i, c in enumerate(staged.conversions)}
    training = any(isinstance(t, Backward) for _, t in order)
    missing: dict[tuple[str, int], int] = {}  # contributions to a conversion chunk's gradient still to come
    if training:
        for st in staged.stages:
            for u in dict.fromkeys(st.inputs):
                if u in conv_out and conv_out[u].needs_grad:
                    for k in range(chunks):
                        for m in _read(reads, st.index, u, k):
                            missing[u, m] = missing.get((u, m), 0) + 1
    out: list[Instruction] = []
    for c in staged.conversions:
        if c.value not in producer:  # a model input's: before anything else
            for m in range(chunks):
                out.extend(convert(c, m, False))
    for _, t in order:
        st = staged.stages[t.stage]
        if isinstance(t, Forward):
            out.append(t)
            for c in after.get(t.stage, []):
                out.extend(convert(c, t.chunk, False))
            continue
        for c in reversed(after.get(t.stage, [])):
            if c.consumers == (OUTPUT,) and c.needs_grad:
                out.extend(convert(c, t.chunk, True))
        out.append(t)
        complete = []
        for u in dict.fromkeys(st.inputs):
            c = conv_out.get(u)
            if c is None or not c.needs_grad:
                continue
            for m in _read(reads, t.stage, u, t.chunk):
                missing[u, m] -= 1
                if missing[u, m] == 0:
                    complete.append((c, m))
        # gradients in the reverse of the forward's conversion order (chunks ascending)
        for c, m in sorted(complete, key=lambda cm: (-index[cm[0].output], cm[1])):
            out.extend(convert(c, m, True))
    return out


# --------------------------------------------------------------------------- several groups: messages
@dataclass(frozen=True)
class _Edge:
    """A value (``base``) read under the name ``name`` by stages of another group than its producer's."""

    base: str
    name: str
    src: int          # producer group index
    dst: int          # consumer group index
    needs_grad: bool


#: The most point-to-point messages one step of a candidate may post: the planner materializes,
#: costs and simulates every one (a 64-rank MoP step with 8 chunks posts ~200k; with 128 ranks
#: ~800k, 30 s of planning; with 1024 ranks ~50M, more memory than a planning host has). The count
#: is taken before any instruction is made.
MAX_MESSAGES = 300_000


@dataclass(frozen=True)
class StepOutline:
    """One training step of a point-to-point lowering, per rank, before its instructions exist.

    ``tasks[r]``: the compute tasks rank ``r`` runs, in its program order; ``sends[r]``: every
    message it sends, as ``(peer, shape, dtype)`` (the multiset of the step's ``Send`` instructions
    on ``r``, gradients included); ``stages``: the step's stages by index; ``sizes[r]``: the rank's
    :class:`~gnncompile.ir.plan.RankSizes` (what its plan will carry). The planner bounds a
    candidate's step time from it (:func:`checking_outlines`) without materializing its messages.
    """

    stages: Sequence[StageSpec]
    tasks: Mapping[int, Sequence[Compute]]
    sends: Mapping[int, Sequence[tuple[int, tuple[int, ...], str]]]
    sizes: Mapping[int, RankSizes]


@dataclass(frozen=True)
class RankOutline:
    """One rank's training step as a lowering made it, before it makes the other ranks' steps.

    ``instructions``: the rank's step without what the driver appends (the gradient reduction,
    the optimizer step, FREE); ``inputs``: the plan's model inputs (there from the start). A
    lowering whose ranks run alike (``tensor``) hands the planner one of them
    (:func:`check_rank`): a bound of one rank's step is a bound of the whole step."""

    rank: int
    stages: tuple[StageSpec, ...]
    instructions: tuple[Instruction, ...]
    sizes: RankSizes
    inputs: frozenset[str]


class Pruned(PlanningError):
    """A candidate the planner ruled out from its :class:`StepOutline` (it cannot win), before its
    messages were materialized; the message says why."""


_OUTLINE_CHECK: ContextVar[Optional[Callable[[Union[StepOutline, RankOutline]], None]]] = \
    ContextVar("outline_check", default=None)


@contextmanager
def checking_outlines(check: Callable[[Union[StepOutline, RankOutline]], None]) -> Iterator[None]:
    """While active, :func:`insert_messages` hands the outline of every training step it is given
    sizes for to ``check`` before making its instructions, and :func:`check_rank` the rank outlines
    lowerings give it; ``check`` raises :class:`Pruned` to stop the lowering (the planner's bound,
    :mod:`gnncompile.passes.search`)."""
    token = _OUTLINE_CHECK.set(check)
    try:
        yield
    finally:
        _OUTLINE_CHECK.reset(token)


def check_rank(outline: RankOutline) -> None:
    """Hand ``outline`` to the active check (:func:`checking_outlines`), if any; raises what it raises."""
    check = _OUTLINE_CHECK.get()
    if check is not None:
        check(outline)


class _CrossGroup:
    """The point-to-point traffic of one step of :func:`insert_messages`, before any instruction is
    made: every cross-group read (``edges``), the consumer chunks reading each chunk (``readers``),
    each chunk's messages (:meth:`messages`, memoized) and the gradient contributions a reader
    waits for (``missing``, which :func:`insert_messages` counts down)."""

    def __init__(self, staged: StagedModel, place: Placement, chunking: Chunking, reads: Reads,
                 dims: Mapping[str, tuple[tuple[int, ...], str]], needs_grad: set[str],
                 stale: Optional[Reads] = None) -> None:
        self.place, self.chunking, self.reads, self.dims = place, chunking, reads, dims
        K = self.K = chunking.num_chunks
        conv_out = {c.output: c for c in staged.conversions}
        self.producer = producer = {o: st.index for st in staged.stages for o in st.outputs}
        if staged.output not in producer:
            raise PlanningError(f"the chunked lowering needs the model's output computed by a stage, but "
                                f"{staged.output!r} is a conversion's output (a lowering whose loss runs on "
                                "another group than the output's producer ends the model in a stage there, as "
                                "mop's gather_output does)")
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
                        g = place.groups[gi]
                        across = reads.get(st.index, {}).get(u) is not None or \
                            (stale or {}).get(st.index, {}).get(u) is not None
                        if g.layout != "chunks" or len(g.members) == 1 or not across:
                            continue  # every chunk it reads is on the reading rank
                        # a group dealing whole chunks: chunks its members read across come from the
                        # member running them (GNNPipe's hybrid: graph parallelism inside a stage)
                elif u in conv_out and place.input_group is not None:
                    src = place.input_group
                else:
                    continue  # a model input the rank reads directly
                edges.setdefault((u, gi), _Edge(base, u, src, gi, base in needs_grad or
                                                (u in conv_out and conv_out[u].needs_grad)))
        self.edges = edges
        self.by_base: dict[str, list[_Edge]] = {}
        for e in edges.values():
            self.by_base.setdefault(e.base, []).append(e)
        # per (name, consumer group): the consumer tasks' chunks reading each chunk, and whether whole chunks
        self.readers: dict[tuple[str, int], dict[int, set[int]]] = {}
        self.whole: set[tuple[str, int]] = set()
        # contributions missing before the gradient of (name, consumer group, member, chunk) is complete
        self.missing: dict[tuple[str, int, int, int], int] = {}
        for st in staged.stages:
            gi = place.stage_group[st.index]
            g = place.groups[gi]
            for u in dict.fromkeys(st.inputs):
                if (u, gi) not in edges:
                    continue
                if reads.get(st.index, {}).get(u) is not None:
                    self.whole.add((u, gi))
                per = self.readers.setdefault((u, gi), {})
                sd = (stale or {}).get(st.index, {}).get(u)
                for k in range(K):
                    read = _read(reads, st.index, u, k)
                    for m in tuple(read) + (tuple(sd[k]) if sd is not None else ()):
                        per.setdefault(m, set()).add(k)
                    for j in g.runners(k):
                        for m in read:
                            key = (u, gi, g.members[j], m)
                            self.missing[key] = self.missing.get(key, 0) + 1
        self._cache: dict[tuple[_Edge, int], list[tuple[int, int, Block, Block, Block]]] = {}

    def messages(self, e: _Edge, m: int) -> list[tuple[int, int, Block, Block, Block]]:
        """(producer rank, consumer rank, held block, needed block, intersection) of ``e`` at chunk ``m``."""
        key = (e, m)
        out = self._cache.get(key)
        if out is None:
            out = self._cache[key] = list(self._pairs(e, m))
        return out

    def _pairs(self, e: _Edge, m: int) -> Iterator[tuple[int, int, Block, Block, Block]]:
        """The messages of ``e`` at chunk ``m``, one at a time (:meth:`messages`)."""
        place, chunking = self.place, self.chunking
        sg, dg = place.groups[e.src], place.groups[e.dst]
        d = self.dims[e.base][0]
        width = d[-1] if d else 1
        need_members = sorted({j for k in self.readers.get((e.name, e.dst), {}).get(m, ()) for j in dg.runners(k)})
        held_by = [(a, held_block(sg, i, chunking, m, width)) for i, a in enumerate(sg.members)]
        held_by = [(a, held) for a, held in held_by if held is not None]
        whole = (e.name, e.dst) in self.whole
        for j in need_members:
            need = needed_block(dg, j, chunking, m, width, whole)
            for a, held in held_by:
                inter = intersect(held, need)
                if inter[0] == inter[1] and inter[2] == inter[3] or a == dg.members[j]:
                    continue  # disjoint in both dimensions, or already on the reading rank: nothing to say
                yield a, dg.members[j], held, need, inter

    def shape_of(self, e: _Edge, inter: Block) -> tuple[int, ...]:
        d = self.dims[e.base][0]
        return (inter[1] - inter[0],) + tuple(d[:-1]) + ((inter[3] - inter[2],) if d else ())

    def count(self, training: bool) -> int:
        """The step's messages, counted before any is made: every chunk of a value goes to its
        readers once, and each reader's gradient of it back once it is complete. Raises
        :class:`PlanningError` past :data:`MAX_MESSAGES`."""
        count = 0
        for e in self.edges.values():
            grads = training and e.needs_grad
            for m in range(self.K):
                made = self._cache.get((e, m))
                fwd = [] if made is None else made
                # made one at a time: a step far too large is refused after MAX_MESSAGES of them
                for msg in (made if made is not None else self._pairs(e, m)):
                    if made is None:
                        fwd.append(msg)
                    count += 1 + (grads and (e.name, e.dst, msg[1], m) in self.missing)
                    if count > MAX_MESSAGES:
                        raise PlanningError(f"the step would post more than {MAX_MESSAGES:,} point-to-point "
                                            f"messages ({len(self.place.ranks)} ranks, {self.K} chunks); the planner "
                                            "does not simulate steps that large: fewer chunks or ranks per group")
                self._cache[e, m] = fwd
        return count


def count_messages(staged: StagedModel, place: Placement, chunking: Chunking, reads: Reads,
                   dims: Mapping[str, tuple[tuple[int, ...], str]], needs_grad: set[str],
                   stale: Optional[Reads] = None, training: bool = True) -> int:
    """The point-to-point messages :func:`insert_messages` would post for one step with these
    arguments (the order does not change them), counted before the step is scheduled, so that a
    lowering refuses a step too large to plan before it builds it. Raises :class:`PlanningError`
    when they exceed :data:`MAX_MESSAGES`."""
    return _CrossGroup(staged, place, chunking, reads, dims, needs_grad, stale).count(training)


def insert_messages(staged: StagedModel, order: Order, place: Placement, chunking: Chunking, reads: Reads,
                    dims: Mapping[str, tuple[tuple[int, ...], str]], needs_grad: set[str],
                    stale: Optional[Reads] = None,
                    sizes: Optional[Mapping[int, RankSizes]] = None) -> dict[int, list[Instruction]]:
    """Per rank of ``place``, the instructions of one step: the tasks of ``order`` it runs, with the
    point-to-point messages of every value crossing groups (module docstring).

    ``dims``: value -> (per-vertex shape, dtype) of every value that crosses groups; ``needs_grad``:
    the values whose gradients travel back (a conversion's own ``needs_grad`` too). ``stale``:
    reads served from the previous step's copy (no dependency; the chunk is still sent to the
    reading rank, which takes it at the end of the step). ``sizes``: the ranks' sizes of a training
    step, handed with its :class:`StepOutline` to the planner's check (:func:`checking_outlines`)
    before any instruction is made. Ends without the gradient all-reduce and the optimizer step.
    Raises :class:`PlanningError` when the step would post more than :data:`MAX_MESSAGES`
    messages (:func:`count_messages`), and whatever the check raises.
    """
    cross = _CrossGroup(staged, place, chunking, reads, dims, needs_grad, stale)
    K = cross.K
    progs: dict[int, list[Instruction]] = {r: [] for r in place.ranks}
    producer, edges, by_base, missing = cross.producer, cross.edges, cross.by_base, cross.missing
    messages, shape_of = cross.messages, cross.shape_of
    training = any(isinstance(t, Backward) for _, t in order)
    cross.count(training)
    check = _OUTLINE_CHECK.get()
    if check is not None and sizes is not None and training:
        check(_outline(staged, order, place, edges.values(), K, messages, shape_of, missing, dims, sizes))

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
                progs[a].append(Send(e.base, m, b, shape, dtype, part=slab(held, inter)))
                inflight.setdefault((a, b), deque()).append(
                    Recv(e.base, m, a, shape, dtype, local=local, part=slab(need, inter)))
            else:
                progs[b].append(Send(e.base, m, a, shape, dtype, grad=True, local=local, part=slab(need, inter)))
                inflight.setdefault((b, a), deque()).append(
                    Recv(e.base, m, b, shape, dtype, grad=True, part=slab(held, inter)))

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
        raise PlanningError(f"schedule: rank {r} needs {'the gradient of ' if grad else ''}{value} c{k} from "
                            f"rank {src}, which was never sent")

    for e in edges.values():  # model inputs held by the input group: sent before anything else
        if e.base not in producer:
            for m in range(K):
                send(e, m, False)
    for _, t in order:
        st = staged.stages[t.stage]
        gi = place.stage_group[t.stage]
        g = place.groups[gi]
        runners = [g.members[j] for j in g.runners(t.chunk)]
        if isinstance(t, Forward):
            for u in st.inputs:
                e = edges.get((u, gi))
                if e is None:
                    continue
                for m in _read(reads, t.stage, u, t.chunk):
                    for a, b, *_ in messages(e, m):
                        if b in runners:
                            receive(b, a, e.base, m, False)
            for r in runners:
                progs[r].append(t)
            for o in st.outputs:
                for e in by_base.get(o, []):
                    send(e, t.chunk, False)
            continue
        for o in st.outputs:
            for e in by_base.get(o, []):
                if e.needs_grad:
                    for a, b, *_ in messages(e, t.chunk):
                        # from every consumer reading the chunk fresh (a stale read sends no gradient)
                        if a in runners and (e.name, e.dst, b, t.chunk) in missing:
                            receive(a, b, e.base, t.chunk, True)
        for r in runners:
            progs[r].append(t)
        for u in dict.fromkeys(st.inputs):
            e = edges.get((u, gi))
            if e is None or not e.needs_grad:
                continue
            for r in runners:
                done = []
                for m in _read(reads, t.stage, u, t.chunk):
                    missing[u, gi, r, m] -= 1
                    if missing[u, gi, r, m] == 0:
                        done.append(m)
                for m in sorted(done):  # the gradient of (u, m) on r is complete: send it back
                    send(e, m, True, only=r)
    for (src, dst), queue in inflight.items():  # messages no task needed (stale reads): received last
        progs[dst].extend(queue)
        queue.clear()
    return progs


def _outline(staged: StagedModel, order: Order, place: Placement, edges: Iterable[_Edge], K: int,
             messages: Callable[[_Edge, int], list], shape_of: Callable[[_Edge, Block], tuple[int, ...]],
             missing: Mapping[tuple[str, int, int, int], int], dims: Mapping[str, tuple[tuple[int, ...], str]],
             sizes: Mapping[int, RankSizes]) -> StepOutline:
    """The :class:`StepOutline` of a training step of :func:`insert_messages` (same messages, unmade)."""
    tasks: dict[int, list[Compute]] = {r: [] for r in place.ranks}
    for _, t in order:
        g = place.groups[place.stage_group[t.stage]]
        for j in g.runners(t.chunk):
            tasks[g.members[j]].append(t)
    sends: dict[int, list[tuple[int, tuple[int, ...], str]]] = {r: [] for r in place.ranks}
    for e in edges:
        dtype = dims[e.base][1]
        for m in range(K):
            for a, b, _, _, inter in messages(e, m):
                shape = shape_of(e, inter)
                sends[a].append((b, shape, dtype))
                if e.needs_grad and (e.name, e.dst, b, m) in missing:
                    sends[b].append((a, shape, dtype))
    return StepOutline(stages=staged.stages, tasks=tasks, sends=sends, sizes=sizes)
