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
           "insert_collectives", "insert_messages", "MAX_MESSAGES", "StepOutline", "Pruned", "checking_outlines"]

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
    deps: dict[Compute, set[Compute]] = {}
    for st in staged.stages:
        for k in range(chunks):
            d: set[Compute] = set()
            for v in st.inputs:
                base = conv_out[v].value if v in conv_out else v
                if base in producer:  # else a model input
                    d.update(Forward(producer[base], m) for m in _read(reads, st.index, v, k))
            deps[Forward(st.index, k)] = d
    if not training:
        return deps
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
        for k in range(chunks):
            d = {Forward(st.index, k)}
            for o in st.outputs:
                for name in [o] + [c.output for c in staged.conversions if c.value == o and c.needs_grad]:
                    for s2 in consumers.get(name, []):
                        d.update(Backward(s2, j) for j in reading(s2, name, k))
            deps[Backward(st.index, k)] = d
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
    tasks = list(deps)
    remaining = {t: len(set(deps[t])) for t in tasks}
    users: dict[Compute, list[Compute]] = {t: [] for t in tasks}
    for t in tasks:
        for d in set(deps[t]):
            if d not in users:
                raise PlanningError(f"schedule: task {t} depends on {d}, which is not a task of the step")
            users[d].append(t)
    end: dict[Compute, float] = {}
    # per resource, its ready tasks: those whose data arrive after it is free, by (arrival, priority),
    # and those that could start the moment it is free, by priority; equal keys by readiness order
    later: dict[Hashable, list[tuple[float, tuple, int, Compute]]] = {}
    now: dict[Hashable, list[tuple[tuple, int, float, Compute]]] = {}
    free: dict[Hashable, float] = {}
    seq = 0

    def make_ready(t: Compute, at: float) -> None:
        nonlocal seq
        r = res(t)
        seq += 1
        if at <= free.get(r, 0.0):
            heapq.heappush(now.setdefault(r, []), (priority(t), seq, at, t))
        else:
            heapq.heappush(later.setdefault(r, []), (at, priority(t), seq, t))

    for t in tasks:
        if not remaining[t]:
            make_ready(t, 0.0)
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
        t = heapq.heappop(now[r])[3] if now.get(r) else heapq.heappop(later[r])[3]
        end[t] = start + cost.get(t, 1.0)
        free[r] = end[t]
        waiting = later.get(r, [])
        while waiting and waiting[0][0] <= end[t]:  # ready by the time the resource is free
            at, pr, order, u = heapq.heappop(waiting)
            heapq.heappush(now.setdefault(r, []), (pr, order, at, u))
        out.append((start, t))
        for u in users[t]:
            remaining[u] -= 1
            if not remaining[u]:
                make_ready(u, max(end[d] + (delay(d, u) if delay is not None else 0.0) for d in deps[u]))
    if len(out) != len(tasks):
        stuck = sorted((t for t in tasks if t not in end), key=priority)
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


class Pruned(PlanningError):
    """A candidate the planner ruled out from its :class:`StepOutline` (it cannot win), before its
    messages were materialized; the message says why."""


_OUTLINE_CHECK: ContextVar[Optional[Callable[[StepOutline], None]]] = ContextVar("outline_check", default=None)


@contextmanager
def checking_outlines(check: Callable[[StepOutline], None]) -> Iterator[None]:
    """While active, :func:`insert_messages` hands the outline of every training step it is given
    sizes for to ``check`` before making its instructions; ``check`` raises :class:`Pruned` to stop
    the lowering (the planner's bound, :mod:`gnncompile.passes.search`)."""
    token = _OUTLINE_CHECK.set(check)
    try:
        yield
    finally:
        _OUTLINE_CHECK.reset(token)


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
    messages, and whatever the check raises.
    """
    K = chunking.num_chunks
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
            if reads.get(st.index, {}).get(u) is not None:
                whole.add((u, gi))
            per = readers.setdefault((u, gi), {})
            sd = (stale or {}).get(st.index, {}).get(u)
            for k in range(K):
                for m in tuple(_read(reads, st.index, u, k)) + (tuple(sd[k]) if sd is not None else ()):
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
        held_by = [(a, held_block(sg, i, chunking, m, width)) for i, a in enumerate(sg.members)]
        held_by = [(a, held) for a, held in held_by if held is not None]
        for j in need_members:
            need = needed_block(dg, j, chunking, m, width, (e.name, e.dst) in whole)
            for a, held in held_by:
                inter = intersect(held, need)
                if inter[0] == inter[1] and inter[2] == inter[3] or a == dg.members[j]:
                    continue  # disjoint in both dimensions, or already on the reading rank: nothing to say
                out.append((a, dg.members[j], held, need, inter))
        cache[key] = out
        return out

    def shape_of(e: _Edge, inter: Block) -> tuple[int, ...]:
        d = dims[e.base][0]
        return (inter[1] - inter[0],) + tuple(d[:-1]) + ((inter[3] - inter[2],) if d else ())

    # contributions missing before the gradient of (name, consumer group, member, chunk) is complete
    missing: dict[tuple[str, int, int, int], int] = {}
    for st in staged.stages:
        gi = place.stage_group[st.index]
        g = place.groups[gi]
        for u in dict.fromkeys(st.inputs):
            if (u, gi) in edges:
                for k in range(K):
                    for j in g.runners(k):
                        for m in _read(reads, st.index, u, k):
                            key = (u, gi, g.members[j], m)
                            missing[key] = missing.get(key, 0) + 1

    # the step's messages before any is made: every chunk of a value goes to its readers once, and
    # each reader's gradient of it back once it is complete (below: the order they are posted in)
    training = any(isinstance(t, Backward) for _, t in order)
    count = 0
    for e in edges.values():
        for m in range(K):
            fwd = messages(e, m)
            count += len(fwd)
            if training and e.needs_grad:
                count += sum((e.name, e.dst, b, m) in missing for _, b, *_ in fwd)
            if count > MAX_MESSAGES:
                raise PlanningError(f"the step would post more than {MAX_MESSAGES:,} point-to-point messages "
                                    f"({len(place.ranks)} ranks, {K} chunks); the planner does not simulate steps "
                                    "that large: fewer chunks or ranks per group")
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
