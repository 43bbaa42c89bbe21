"""Discrete-event simulation of a plan: all ranks' instruction lists together, under any cost model.

:func:`simulate` replays one training step of a :class:`~gnncompile.ir.plan.Plan` given a cost
function ``cost(rank, instruction) -> Cost`` (how long the instruction runs, on which stream, how
many bytes it allocates and releases); it knows nothing of how costs are computed.

Semantics
---------
- Every rank issues its instructions in program order. By default a rank runs one instruction at a
  time (blocking collectives, as the runtime does), except all-to-alls, which the runtime posts
  without waiting: they run in order on a stream of their own, and the instructions reading what
  they write (their data dependencies, below) wait for them. With ``overlap=True`` each rank has two
  in-order streams, ``compute`` and ``comm``: an instruction starts when its stream is free and the
  instructions of the same rank it depends on (its data dependencies, below) have finished, so
  computation does not wait for unrelated communication.
- Sends are eager (the runtime's ``isend``): a Send runs for its cost as soon as it is ready; the
  k-th Send from r to q matches the k-th Recv on q from r, which ends at the later of its own
  ready time and the Send's end (the data has arrived). A Send/Recv reads/writes its ``local`` name.
  Collectives (``kind == "collective"`` in :mod:`gnncompile.ir.rules`): the k-th collective over a
  group on each member is the same collective (it must agree in its rule's ``signature``: every
  field but the per-member ones, as the verifier checks); it starts when every member is ready
  and ends on all at ``start + max`` of the members' costs. Time between being ready and the start
  is *wait* time.
- Data dependencies (with ``overlap=True``, or for a plan with all-to-alls), per rank, from the
  effects table of :mod:`gnncompile.ir.dataflow` (``(value, chunk)`` pairs; the plan inputs,
  ``plan.info["inputs"]`` or ``g``/``x``, are there at time 0): an instruction waits for the last
  write of each value it reads, including the ``saved`` values of a Backward (so it follows its
  Forward); for every contribution issued before it to each gradient it reads; ``AR v`` reads and
  rewrites ``v`` on every chunk written so far; ``AR grads`` waits for the Backwards since the
  previous ``AR grads`` (and that one). Free waits for the write and every read of its value since
  (but an all-to-all's, which copied its input when it was posted); OPT waits for every earlier
  instruction and every later instruction waits for it.
- Memory: rank r starts at ``base_memory[r]``; ``alloc`` is added when an instruction starts,
  ``free`` subtracted when it ends (at equal times, frees of instructions that started earlier come
  first).
- With ``overlap=True``, ``wait`` is the time a stream sits on a posted Send/Recv/collective whose
  partners are not there yet (e.g. receives posted ahead); the rank may be computing meanwhile.
- If no rank can advance while some have instructions left, a
  :class:`~gnncompile.errors.VerificationError` lists every blocked rank, its step, its instruction
  and whom it waits for.

The simulation is a single pass over a dependency graph (no contention besides the in-order
streams, so start times follow from finish times): O(instructions + dependencies + group sizes).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, NamedTuple, Optional, Sequence, Union

from ..errors import VerificationError
from ..ir.dataflow import effects
from ..ir.plan import DevicePlan, Instruction, Plan
from ..ir.rules import channel, rule
from ..ir.verify_plan import instruction_window

__all__ = ["Cost", "CostFn", "SimEvent", "RankSim", "Simulation", "simulate", "STREAMS"]

#: The streams of a rank.
STREAMS = ("compute", "comm")


@dataclass(frozen=True)
class Cost:
    """What one instruction costs on one rank.

    ``seconds``: its duration on its stream (for communication: the transfer time); ``stream``:
    ``"compute"`` or ``"comm"``; ``alloc``: bytes allocated when it starts; ``free``: bytes released
    when it ends.
    """

    seconds: float
    stream: str = "compute"
    alloc: int = 0
    free: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.seconds, (int, float)) and math.isfinite(self.seconds) and self.seconds >= 0):
            raise ValueError(f"Cost.seconds must be a finite number >= 0, got {self.seconds!r}")
        if self.stream not in STREAMS:
            raise ValueError(f"Cost.stream must be one of {STREAMS}, got {self.stream!r}")
        if self.alloc < 0 or self.free < 0:
            raise ValueError(f"Cost.alloc and Cost.free must be >= 0, got {self.alloc!r} and {self.free!r}")


#: ``cost(rank, instruction) -> Cost``.
CostFn = Callable[[int, Instruction], Cost]


@dataclass(frozen=True)
class SimEvent:
    """One simulated instruction: ``instruction`` (step ``index`` of ``rank``) ran on ``stream`` from
    ``start`` to ``end`` (seconds from the step's start); it was ready on its side at ``wait_start``
    (``start - wait_start`` was spent waiting for partners)."""

    rank: int
    index: int
    instruction: Instruction
    label: str
    kind: str
    stream: str
    start: float
    end: float
    wait_start: float

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def wait(self) -> float:
        return self.start - self.wait_start

    @property
    def name(self) -> str:
        return self.label


@dataclass
class RankSim:
    """One rank's simulated step.

    ``compute`` / ``comm``: busy seconds on each stream; ``wait``: seconds blocked at rendezvous and
    collectives waiting for partners; ``idle``: ``step_time`` minus the time anything runs on the
    rank (includes waiting, dependency stalls and the tail after its last instruction);
    ``peak_memory`` and ``memory_curve`` (``(time, bytes)`` after each change, from ``(0, base)``);
    ``events`` in program order.
    """

    rank: int
    compute: float
    comm: float
    wait: float
    idle: float
    peak_memory: int
    memory_curve: list[tuple[float, int]]
    events: list[SimEvent]

    @property
    def end(self) -> float:
        """When the rank's last instruction ends."""
        return max((e.end for e in self.events), default=0.0)

    @property
    def busy(self) -> float:
        return self.compute + self.comm


class _Bar(NamedTuple):
    """The record :func:`gnncompile.viz.timeline.draw_timeline` reads."""

    step: int
    instruction: str
    start: float
    end: float


@dataclass
class Simulation:
    """The result of :func:`simulate`: ``step_time`` (the makespan) and one :class:`RankSim` per rank."""

    step_time: float
    ranks: list[RankSim]
    overlap: bool = False

    @property
    def bubble_fraction(self) -> float:
        """Share of the ranks' time with nothing running: ``sum(idle) / (ranks * step_time)``.

        For a pipeline this is the classic bubble, e.g. ``(S-1)/(S+C-1)`` for GPipe's forward pass
        with S stages and C chunks (leading waits and trailing tails both count).
        """
        return self._fraction(sum(r.idle for r in self.ranks))

    @property
    def wait_fraction(self) -> float:
        """Share of the ranks' time blocked waiting for partners: ``sum(wait) / (ranks * step_time)``."""
        return self._fraction(sum(r.wait for r in self.ranks))

    def _fraction(self, t: float) -> float:
        total = len(self.ranks) * self.step_time
        return t / total if total > 0 else 0.0

    @property
    def critical_rank(self) -> int:
        """The rank that finishes last (ties: the busiest, then the lowest)."""
        return max(self.ranks, key=lambda r: (r.end, r.busy, -r.rank)).rank

    def time_by_kind(self) -> dict[str, float]:
        """Seconds per instruction kind (``F``, ``B``, ``SEND``, ``AR``, ...) summed over ranks."""
        out: dict[str, float] = defaultdict(float)
        for r in self.ranks:
            for e in r.events:
                out[e.kind] += e.duration
        return dict(out)

    def summary(self, max_rows: int = 24) -> str:
        """A per-rank table (milliseconds, MiB); consecutive identical ranks share a row, and past
        ``max_rows`` rows the middle is elided."""
        head = ["rank", "compute ms", "comm ms", "wait ms", "idle ms", "peak MiB"]
        rows: list[list[str]] = []
        first: list[int] = []
        for r in self.ranks:  # consecutive ranks with identical numbers share a row ("0-63")
            row = [f"{x * 1e3:.3f}" for x in (r.compute, r.comm, r.wait, r.idle)] + [f"{r.peak_memory / 2 ** 20:.2f}"]
            if rows and rows[-1][1:] == row:
                rows[-1][0] = f"{first[-1]}-{r.rank}"
            else:
                rows.append([str(r.rank)] + row)
                first.append(r.rank)
        if len(rows) > max_rows:
            rows = rows[:max_rows - 1] + [["..."] * len(head)] + rows[-1:]
        widths = [max(len(row[j]) for row in [head] + rows) for j in range(len(head))]
        n = len(self.ranks)
        lines = [f"simulated step: {self.step_time * 1e3:.3f} ms on {n} rank{'s' if n != 1 else ''}"
                 f"{' (overlapped streams)' if self.overlap else ''}, bubble {self.bubble_fraction:.1%} "
                 f"(waiting {self.wait_fraction:.1%}), critical rank {self.critical_rank if n else '-'}"]
        lines += ["  " + "  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in [head] + rows]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def bars(self) -> list[list[_Bar]]:
        """Per rank, the events as the records :func:`gnncompile.viz.timeline.draw_timeline` draws (step 0)."""
        return [[_Bar(0, e.label, e.start, e.end) for e in r.events] for r in self.ranks]

    def timeline(self, path: Union[str, Path], *, title: str = "") -> Path:
        """Draw a Gantt chart (one row per rank; both streams share the row) into ``path``."""
        from ..viz.timeline import draw_timeline

        return draw_timeline(self.bars(), path, step=0,
                             title=title or f"simulated step: {self.step_time * 1e3:.3f} ms")


# --------------------------------------------------------------------------- dependencies
def _dependencies(dp: DevicePlan, inputs: frozenset[str], streams: list[str]) -> list[set[int]]:
    """Per instruction of ``dp``, the earlier instructions of the rank it depends on: the effects of
    :mod:`gnncompile.ir.dataflow` with the simulator's policy (module docstring)."""
    stages = {s.index: s for s in dp.stages}
    writer: dict[tuple[str, int], int] = {}
    readers: dict[tuple[str, int], list[int]] = defaultdict(list)
    chunks_of: dict[str, set[int]] = defaultdict(set)
    grad_writers: dict[tuple[str, int], list[int]] = defaultdict(list)
    accumulated: list[int] = []  # Backwards since the last `AR grads` (and that one)
    last_on: dict[str, int] = {}
    barrier: Optional[int] = None
    out: list[set[int]] = []

    def read(deps: set[int], i: int, v: str, c: int) -> None:
        if v in inputs:
            return
        w = writer.get((v, c))
        if w is not None:
            deps.add(w)
        readers[v, c].append(i)

    def write(i: int, v: str, c: int) -> None:
        writer[v, c] = i
        readers.pop((v, c), None)
        chunks_of[v].add(c)

    for i, inst in enumerate(dp.instructions):
        try:
            eff = effects(inst, stages)
        except KeyError:  # a Forward/Backward/Recompute of a stage the rank lacks
            raise VerificationError(
                f"rank {dp.rank} step {i} `{inst}`: rank {dp.rank} has no stage {inst.stage}") from None
        deps: set[int] = set()
        for v, c in eff.reads + eff.saved:
            read(deps, i, v, c)
        for key in eff.grad_reads:
            deps.update(grad_writers.get(key, ()))
        for v in eff.reduced:
            if v not in inputs:
                for c in sorted(chunks_of[v]):
                    read(deps, i, v, c)
                    write(i, v, c)
        for v, c in eff.writes:
            write(i, v, c)
        for key in eff.grad_writes:
            grad_writers[key].append(i)
        for key in eff.frees:
            if key in writer:
                deps.add(writer.pop(key))
            # an all-to-all packs its input into a send buffer of its own when it is posted: freeing
            # the input does not wait for the transfer
            deps.update(j for j in readers.pop(key, ()) if not rule(dp.instructions[j]).posted)
        if eff.params == "accumulate":
            accumulated.append(i)
        elif eff.params == "reduce":
            deps.update(accumulated)
            accumulated = [i]  # a later `AR grads` waits for this one (and so for these Backwards)
        elif eff.params == "update":
            deps.update(last_on.values())  # streams are in order: their last instructions end last
        if barrier is not None:
            deps.add(barrier)
        if eff.params == "update":
            barrier = i
        deps.discard(i)
        out.append(deps)
        last_on[streams[i]] = i
    return out


# --------------------------------------------------------------------------- simulation
def _signature(inst: Instruction) -> tuple:
    """What the sides of a rendezvous must agree on (the rule's ``signature``, as the verifier checks it)."""
    return rule(inst).signature(inst)


def simulate(plan: Plan, cost: CostFn, *, overlap: bool = False,
             base_memory: Optional[Sequence[int]] = None) -> Simulation:
    """Simulate one training step of ``plan`` on all ranks under ``cost`` (semantics: module docstring).

    ``overlap``: two streams per rank (compute, comm) ordered by data dependencies instead of one
    instruction at a time (with posted all-to-alls beside it). ``base_memory[r]``: bytes live on
    rank r before the step (default 0).
    Raises :class:`~gnncompile.errors.VerificationError` on a deadlock or a malformed peer/group.
    """
    n = plan.num_ranks
    progs = [dp.instructions for dp in plan.ranks]
    if base_memory is None:
        base = [0] * n
    else:
        base = list(base_memory)
        if len(base) != n:
            raise ValueError(f"base_memory has {len(base)} entries for a plan of {n} ranks")
    costs: list[list[Cost]] = []
    for r, prog in enumerate(progs):
        row = []
        for inst in prog:
            c = cost(r, inst)
            if not isinstance(c, Cost):
                raise TypeError(f"cost({r}, {inst}) returned {type(c).__name__}, expected Cost")
            row.append(c)
        costs.append(row)

    # in-order queues: the two streams, or the whole rank (with the posted all-to-alls on their own)
    streams = [[c.stream for c in row] for row in costs]
    posted = not overlap and any(rule(inst).posted for p in progs for inst in p)
    queues = streams if overlap else [["posted" if rule(inst).posted else "rank" for inst in p] for p in progs]
    prev = [[-1] * len(p) for p in progs]
    nxt = [[-1] * len(p) for p in progs]
    heads: list[list[int]] = []
    for r, q in enumerate(queues):
        last: dict[str, int] = {}
        for i, name in enumerate(q):
            if name in last:
                prev[r][i], nxt[r][last[name]] = last[name], i
            last[name] = i
        heads.append([i for i in range(len(q)) if prev[r][i] < 0])

    # data dependencies
    if overlap or posted:
        names = plan.info.get("inputs", ("g", "x"))
        inputs = frozenset((names,) if isinstance(names, str) else names)
        deps = [_dependencies(dp, inputs, queues[r]) for r, dp in enumerate(plan.ranks)]
    else:
        deps = [[set() for _ in p] for p in progs]
    dependents: list[list[list[int]]] = [[[] for _ in p] for p in progs]
    missing = [[len(d) for d in row] for row in deps]
    for r, row in enumerate(deps):
        for i, d in enumerate(row):
            for j in d:
                dependents[r][j].append(i)

    # rendezvous: key -> {rank: index}, the ranks expected there
    key_of: list[list[Optional[Hashable]]] = [[None] * len(p) for p in progs]
    sites: dict[Hashable, dict[int, int]] = defaultdict(dict)
    expected: dict[Hashable, tuple[int, ...]] = {}
    counts: Counter = Counter()
    for r, prog in enumerate(progs):
        for i, inst in enumerate(prog):
            kind = rule(inst).kind
            if kind == "p2p":
                if not (0 <= inst.peer < n) or inst.peer == r:
                    raise VerificationError(f"rank {r} step {i} `{inst}`: peer {inst.peer} is not another rank "
                                            f"of this {n}-rank plan")
                pair = channel(inst, r)
                side = rule(inst).side
                key: Hashable = ("p2p", pair, counts[side, pair])
                counts[side, pair] += 1
                expected[key] = pair
            elif kind == "collective":
                group = tuple(inst.group)
                if r not in group or not all(0 <= m < n for m in group) or len(set(group)) != len(group):
                    raise VerificationError(f"rank {r} step {i} `{inst}`: group {group} must hold distinct ranks "
                                            f"of this {n}-rank plan, including rank {r}")
                key = ("coll", group, counts["coll", group, r])
                counts["coll", group, r] += 1
                expected[key] = group
            else:
                continue
            key_of[r][i] = key
            sites[key][r] = i

    for key, at in sites.items():
        if key[0] == "p2p" and len(at) < 2:
            (r, i), = at.items()
            inst = progs[r][i]
            other = "RECV on" if rule(inst).side == "send" else "SEND from"
            raise VerificationError(f"rank {r} step {i} `{inst}` has no matching {other} rank {inst.peer}\n"
                                    + instruction_window(plan.ranks[r], i))

    # event loop over the dependency graph
    ready: list[list[Optional[float]]] = [[None] * len(p) for p in progs]
    start: list[list[float]] = [[math.nan] * len(p) for p in progs]
    end: list[list[Optional[float]]] = [[None] * len(p) for p in progs]
    pred_done = [[False] * len(p) for p in progs]
    arrived: dict[Hashable, list] = {}  # key -> [count, latest ready time]
    sent_end: dict[Hashable, float] = {}  # p2p key -> when its Send ended
    recv_waiting: dict[Hashable, tuple[int, int, float]] = {}  # p2p key -> the Recv waiting for it
    done = 0
    todo: list[tuple[int, int]] = []

    def finish(r: int, i: int, s: float, e: float) -> None:
        nonlocal done
        start[r][i], end[r][i] = s, e
        done += 1
        j = nxt[r][i]
        if j >= 0:
            pred_done[r][j] = True
            todo.append((r, j))
        for d in dependents[r][i]:
            missing[r][d] -= 1
            if not missing[r][d]:
                todo.append((r, d))

    for r, hs in enumerate(heads):
        for i in hs:
            pred_done[r][i] = True
            todo.append((r, i))
    while todo:
        r, i = todo.pop()
        if ready[r][i] is not None or missing[r][i] or not pred_done[r][i]:
            continue
        p = prev[r][i]
        t = end[r][p] if p >= 0 else 0.0
        for d in deps[r][i]:
            t = max(t, end[r][d])
        ready[r][i] = t
        key = key_of[r][i]
        if key is None:
            finish(r, i, t, t + costs[r][i].seconds)
            continue
        if key[0] == "p2p":
            inst = progs[r][i]
            if rule(inst).side == "send":
                e = t + costs[r][i].seconds
                finish(r, i, t, e)
                sent_end[key] = e
                waiting = recv_waiting.pop(key, None)
                if waiting is not None:
                    q, j, tq = waiting
                    finish(q, j, max(tq, e), max(tq, e))
            elif key in sent_end:
                e = max(t, sent_end[key])
                finish(r, i, e, e)
            else:
                recv_waiting[key] = (r, i, t)
            continue
        a = arrived.setdefault(key, [0, 0.0])
        a[0] += 1
        a[1] = max(a[1], t)
        members = sites[key]
        if a[0] == len(expected[key]) and len({_signature(progs[m][j]) for m, j in members.items()}) == 1:
            e = a[1] + max(costs[m][j].seconds for m, j in members.items())
            for m, j in members.items():
                finish(m, j, a[1], e)

    total = sum(len(p) for p in progs)
    if done < total:
        raise _deadlock(plan, queues, deps, ready, end, key_of, sites, expected, done, total)

    # results
    ranks: list[RankSim] = []
    for r, prog in enumerate(progs):
        events = [SimEvent(r, i, inst, str(inst), inst.kind, costs[r][i].stream, start[r][i], end[r][i], ready[r][i])
                  for i, inst in enumerate(prog)]
        busy = {s: sum((e.duration for e in events if e.stream == s), 0.0) for s in STREAMS}
        changes = []
        for e in events:
            c = costs[r][e.index]
            # at equal times: earlier instructions' frees, then starts in program order (an instant
            # instruction frees right after it allocates)
            if c.alloc:
                changes.append((e.start, 1, e.index, 0, c.alloc))
            if c.free:
                changes.append((e.end, 0, e.index, 0, -c.free) if e.end > e.start else (e.end, 1, e.index, 1, -c.free))
        changes.sort()
        cur = peak = base[r]
        curve = [(0.0, cur)]
        for t, *_, delta in changes:
            cur += delta
            peak = max(peak, cur)
            curve.append((t, cur))
        ranks.append(RankSim(rank=r, compute=busy["compute"], comm=busy["comm"],
                             wait=sum(e.wait for e in events), idle=0.0, peak_memory=peak,
                             memory_curve=curve, events=events))
    step_time = max((rs.end for rs in ranks), default=0.0)
    for rs in ranks:
        rs.idle = step_time - _covered(rs.events)
    return Simulation(step_time=step_time, ranks=ranks, overlap=overlap)


def _covered(events: Sequence[SimEvent]) -> float:
    """Length of the union of the events' [start, end] intervals."""
    total, lo, hi = 0.0, None, None
    for s, e in sorted((e.start, e.end) for e in events if e.end > e.start):
        if hi is None or s > hi:
            if hi is not None:
                total += hi - lo
            lo, hi = s, e
        else:
            hi = max(hi, e)
    return total + (hi - lo if hi is not None else 0.0)


# --------------------------------------------------------------------------- deadlock
def _deadlock(plan: Plan, queues: list[list[str]], deps: list[list[set[int]]], ready: list[list[Optional[float]]],
              end: list[list[Optional[float]]], key_of: list[list[Any]], sites: dict, expected: dict,
              done: int, total: int) -> VerificationError:
    """The error listing every blocked rank (its first unfinished instruction per stream) and whom it waits for."""
    progs = [dp.instructions for dp in plan.ranks]

    def head(q: int, stream: str) -> Optional[int]:
        return next((k for k, s in enumerate(queues[q]) if s == stream and end[q][k] is None), None)

    def at(q: int, k: Optional[int]) -> str:
        if k is None:
            return "which has finished its instructions"
        inst = progs[q][k]
        group = f" over group {tuple(inst.group)}" if rule(inst).kind == "collective" else ""
        return f"which is at step {k} `{inst}`{group}"

    lines, shown = [], []
    for r, prog in enumerate(progs):
        blocked = sorted({k for k in (head(r, s) for s in dict.fromkeys(queues[r])) if k is not None})
        for i in blocked:
            inst = prog[i]
            if ready[r][i] is None:  # waits for its own stream or data
                d = min((k for k in deps[r][i] if end[r][k] is None), default=None)
                waits = f"waits for its own step {d} `{prog[d]}`" if d is not None else "waits for its stream"
            else:
                key = key_of[r][i]
                mine = _signature(inst)
                others = []
                for m in expected[key]:
                    j = sites[key].get(m)
                    if m == r or (j is not None and ready[m][j] is not None and _signature(progs[m][j]) == mine):
                        continue
                    where = at(m, head(m, queues[m][j]) if j is not None else
                               next((k for k in range(len(progs[m])) if end[m][k] is None), None))
                    why = " (no matching instruction)" if j is None else \
                        " (a different one)" if ready[m][j] is not None else ""
                    others.append(f"rank {m}, {where}{why}")
                waits = (f"waits for {'; '.join(others)}" if rule(inst).kind == "p2p" else
                         f"waits for group {tuple(inst.group)}: " + "; ".join(others))
            lines.append(f"  rank {r} at step {i} `{inst}` {waits}")
            shown.append((r, i))
    windows = [instruction_window(plan.ranks[r], i) for r, i in shown[:4]]
    return VerificationError("\n".join([f"deadlock: no rank can advance after {done} of {total} instructions "
                                        f"completed"] + lines + windows))
