"""Discrete-event simulation of a plan: all ranks' instruction lists together, under any cost model.

:func:`simulate` replays one training step of a :class:`~gnncompile.ir.plan.Plan` given a cost
function ``cost(rank, instruction) -> Cost`` (how long the instruction runs, on which stream, how
many bytes it allocates and releases); it knows nothing of how costs are computed.

Semantics
---------
The replay itself (queues and streams, rendezvous, data dependencies, deadlocks) is the plan replay
engine :func:`gnncompile.ir.replay.replay`, the one the verifier's dry run uses with unit costs; its
module docstring states the rules. In short: by default a rank runs one instruction at a time
(blocking collectives, as the runtime does) with posted all-to-alls on a queue of their own; with
``overlap=True`` each rank has two in-order streams, ``compute`` and ``comm`` (the ``stream`` of
each instruction's :class:`Cost`), ordered by data dependencies, so computation does not wait for
unrelated communication. Sends are eager; a Recv ends when its Send has ended (taking no time of its
own); a collective starts when every member of its group is ready and ends on all at ``start + max``
of the members' costs. Time between being ready and the start is *wait* time (with
``overlap=True``: time a stream sits on a posted Send/Recv/collective whose partners are not there
yet, e.g. receives posted ahead; the rank may be computing meanwhile).

On top of the replay, this module accounts:

- Memory: rank r starts at ``base_memory[r]``; ``alloc`` is added when an instruction starts,
  ``release`` subtracted right after, ``free`` when it ends (at equal times, frees of instructions
  that started earlier come first).
- Busy, wait and idle time per rank, the makespan (``step_time``) and the bubble fraction.
- If no rank can advance while some have instructions left, the engine's
  :class:`~gnncompile.errors.VerificationError` lists every blocked rank, its step, its instruction
  and whom it waits for.

The simulation is a single pass over a dependency graph: O(instructions + dependencies + group sizes).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple, Optional, Sequence, Union

from ..ir.plan import Instruction, Plan
from ..ir.replay import replay

__all__ = ["Cost", "CostFn", "SimEvent", "RankSim", "Simulation", "simulate", "STREAMS"]

#: The streams of a rank.
STREAMS = ("compute", "comm")


@dataclass(frozen=True)
class Cost:
    """What one instruction costs on one rank.

    ``seconds``: its duration on its stream (for communication: the transfer time); ``stream``:
    ``"compute"`` or ``"comm"``; ``alloc``: bytes allocated when it starts; ``release``: bytes released
    right after that allocation (a posted instruction drops what it copied into its send buffer as it
    posts, long before its transfer ends); ``free``: bytes released when it ends.
    """

    seconds: float
    stream: str = "compute"
    alloc: int = 0
    free: int = 0
    release: int = 0

    def __post_init__(self) -> None:
        if not (isinstance(self.seconds, (int, float)) and math.isfinite(self.seconds) and self.seconds >= 0):
            raise ValueError(f"Cost.seconds must be a finite number >= 0, got {self.seconds!r}")
        if self.stream not in STREAMS:
            raise ValueError(f"Cost.stream must be one of {STREAMS}, got {self.stream!r}")
        if self.alloc < 0 or self.free < 0 or self.release < 0:
            raise ValueError(f"Cost.alloc, Cost.free and Cost.release must be >= 0, got {self.alloc!r}, "
                             f"{self.free!r} and {self.release!r}")


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
    kind: str
    stream: str
    start: float
    end: float
    wait_start: float

    @property
    def label(self) -> str:
        """The instruction's short form (made when asked: a plan of 200k instructions is simulated
        for every search candidate, and few of its events are ever printed)."""
        return str(self.instruction)

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


# --------------------------------------------------------------------------- simulation
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

    events_of = replay(plan, lambda r, i: costs[r][i].seconds, stream=lambda r, i: costs[r][i].stream,
                       overlap=overlap)

    # results
    ranks: list[RankSim] = []
    for r, prog in enumerate(progs):
        events = [SimEvent(r, ev.index, inst, inst.kind, ev.stream, ev.start, ev.end, ev.ready)
                  for inst, ev in zip(prog, events_of[r])]
        busy = {s: sum((e.duration for e in events if e.stream == s), 0.0) for s in STREAMS}
        changes = []
        for e in events:
            c = costs[r][e.index]
            # at equal times: earlier instructions' frees, then starts in program order (an instant
            # instruction frees right after it allocates, as ``release`` always does)
            if c.alloc:
                changes.append((e.start, 1, e.index, 0, c.alloc))
            if c.release:
                changes.append((e.start, 1, e.index, 1, -c.release))
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
