"""`verify_plan(plan)`: the one verifier of parallel training plans.

Checks, in order (the first violation raises :class:`~gnncompile.errors.VerificationError` naming the
rank, the step (instruction index) and a window of the rank's instructions with the faulty one
marked ``>>``):

1. **structure**: ranks are numbered ``0..N-1`` in order; every field has its declared type; stage
   indices and stage outputs are unique per rank; Forward/Backward/Recompute name a stage of the
   rank; chunks lie in ``range(plan.options.get("chunks", 1))``; Send/Recv peers are other ranks of
   the plan; collective groups are sorted, without duplicates, of valid ranks, and include the
   issuing rank; HaloExchange has one ``send_rows``/``recv_rows`` entry per group member, zero for
   itself; AllToAll shapes are absent or one per member; dtypes are torch dtypes.
2. **forward/backward accounting** per rank: every stage runs Forward and Backward exactly once per
   chunk, the Backward after the Forward; Recompute(s, c) lies between them; OptimizerStep runs
   exactly once, after every Backward and every ``AR grads``.
3. **matching** across ranks: the k-th Send from rank r to rank q matches the k-th Recv on q from r
   (value, chunk, grad, shape, dtype); per group, every member issues the same sequence of
   collectives over exactly that group (type, value, chunk, grad, dtype, layouts, width, shape,
   numel); halo row counts and all-to-all shapes agree pairwise (what group[i] sends to group[j] is
   what group[j] receives from group[i]).
4. **dataflow** per rank (use before def, see below).
5. **dry run**: all ranks are replayed together by the plan replay engine
   (:func:`gnncompile.ir.replay.replay`, the simulator's) with unit costs and no overlap: each rank
   runs one instruction at a time (posted all-to-alls on a queue of their own, as the runtime posts
   them), every instruction takes one time unit, except a Recv, which ends when its matching Send has
   ended; a Send is eager (the runtime's ``isend``); a collective starts when every member of its
   group is at it. If no rank can advance before all have finished, the engine's deadlock error lists every
   blocked rank, its step, its instruction and whom it waits for.

Dataflow rules. What each instruction reads, writes, frees and which gradients it reads and adds
to is the table of :mod:`gnncompile.ir.dataflow` (values are ``(name, chunk)`` pairs; a chunked
stage's cross-chunk input, ``StageSpec.reads``, is read at every chunk it lists, and its Backward
contributes to the gradient of each). The verifier applies it as follows. The plan ``inputs``
(``g``, ``x``) are chunk-independent and always available. A value becomes available when an
instruction writes it; ``FREE`` needs it and makes it unavailable until it is written again. Reads
need the value available; the values a Backward holds in its autograd graph (``saved``) are not
checked. ``AR v`` (``v != "grads"``) has no chunk and reduces ``v`` in place, so it needs ``v`` for
some chunk.

The gradient of ``(v, c)`` is complete once *every* contribution to it on the rank has run: the
Backward of each stage of the rank consuming ``v``, each ``grad=True`` Recv of ``(v, c)`` and each
``grad=True`` collective of ``(v, c)`` (which needs the complete gradient of its ``output``). A
stage output that no stage of the rank consumes and that no grad Recv or grad collective mentions
is a loss root (e.g. the logits): its gradient comes from the loss. Backward(s, c) needs the
complete gradients of all of s's outputs; a ``grad=True`` Send needs the gradient it sends.

Per-step sizes. A shape entry (``shape``, ``send_shapes``, ``recv_shapes``, halo ``send_rows`` /
``recv_rows``) may be a :class:`~gnncompile.ir.plan.StepSize`: a size that changes every step (a
sampled mini-batch's rows), named and bounded; the runtime resolves it each step. The checks
compare it by name and bound (a Send and its Recv, or a collective's members, must name the same
one; it never matches a fixed size), and the accounting counts its bound: the volumes of a plan
with per-step sizes are upper bounds. No other field may hold one.

Communication volume (:class:`PlanReport`) is counted from each rank's own instructions, in bytes
(``getattr(torch, dtype).itemsize`` per element):

- Send / Recv: ``numel(shape)`` elements sent / received.
- HaloExchange: ``sum(send_rows) * width`` sent and ``sum(recv_rows) * width`` received. The row
  counts describe the forward exchange; a ``grad=True`` exchange moves the same rows back, so its
  sent and received volumes are swapped. AllToAll likewise, from ``send_shapes``/``recv_shapes``
  without the member's own entry (a local copy); zero when no shapes are given.
- AllGather / ReduceScatter (``shape`` is the full, gathered tensor): ring algorithm,
  ``(n-1) * numel(shape) * itemsize // n`` bytes sent and as much received by each of the ``n``
  members, whatever their row counts (the runtime counts the same integer).
- AllReduce: ring all-reduce, ``2 (n-1)/n * numel`` sent and as much received per member.
"""

from __future__ import annotations

import functools
import math
import typing
from collections import Counter, defaultdict
from dataclasses import dataclass, fields
from typing import Any, Iterable, Optional

from ..errors import VerificationError
from .dataflow import effects
from .plan import AllToAll, Backward, DevicePlan, Instruction, Plan, StageSpec, StepSize, human_bytes
from .replay import instruction_window, replay
from .rules import MESSAGE_FIELDS, MissingRuleError, elsize, rule

__all__ = ["verify_plan", "plan_bytes", "PlanReport", "instruction_window"]

Site = tuple[int, int]  # (rank, instruction index)


# --------------------------------------------------------------------------- report
@dataclass
class PlanReport:
    """What :func:`verify_plan` learned about a valid plan.

    ``instructions[r]`` is rank r's instruction count; ``steps`` the dry run (the unit-cost replay of
    the module docstring), one list per round: ``steps[t]`` holds the ``(rank, index)`` instructions
    that start at time ``t``, by rank then index (every time from 0 to the last start has some);
    ``bytes_sent[r]`` / ``bytes_recv[r]`` rank r's communication volume of one training step
    (conventions in the module docstring).
    """

    instructions: list[int]
    steps: list[list[Site]]
    bytes_sent: list[float]
    bytes_recv: list[float]

    @property
    def order(self) -> list[Site]:
        """The dry run's global order, ``(rank, index)`` pairs by start time, then rank, then index: each
        rank's instructions in program order (a posted all-to-all may come after later instructions
        not depending on it), each Recv after its Send, a collective's members in the same round."""
        return [site for round_ in self.steps for site in round_]

    @property
    def num_rounds(self) -> int:
        """The dry run's rounds: the time units of the unit-cost replay up to its last start."""
        return len(self.steps)

    def __str__(self) -> str:
        n = len(self.instructions)
        head = ["rank", "instructions", "sent", "received"]
        rows = [[str(r), str(self.instructions[r]), human_bytes(self.bytes_sent[r]), human_bytes(self.bytes_recv[r])]
                for r in range(n)]
        widths = [max(len(row[j]) for row in [head] + rows) for j in range(len(head))]
        lines = [f"plan verified: {n} rank{'s' if n != 1 else ''}, {sum(self.instructions)} instructions, "
                 f"dry run in {self.num_rounds} round{'s' if self.num_rounds != 1 else ''}"]
        lines += ["  " + "  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in [head] + rows]
        return "\n".join(lines)


# --------------------------------------------------------------------------- entry point
def verify_plan(plan: Plan, *, inputs: Optional[Iterable[str]] = None, check_types: bool = True,
                dry_run: bool = True) -> PlanReport:
    """Check every invariant of ``plan`` (see the module docstring) and dry-run it.

    ``inputs`` are the names of the model inputs every rank holds from the start (default: the
    plan's ``info["inputs"]``, else ``g`` and ``x``). ``check_types=False`` skips the per-field
    type checks of the instructions and stages (the costliest check on plans of thousands of
    messages) and ``dry_run=False`` the dry run (``steps`` is then empty): for a lowering verifying
    the plan it has just built from typed constructors, which the planner then simulates (the
    same replay, which raises the same deadlock error); :func:`gnncompile.plan` verifies the
    chosen plan in full. Returns a
    :class:`PlanReport`; raises :class:`~gnncompile.errors.VerificationError` at the first violation.
    """
    if not isinstance(plan, Plan):
        raise VerificationError(f"verify_plan expects a Plan, got {type(plan).__name__}")
    if inputs is None:
        inputs = plan.info.get("inputs", ("g", "x"))
    names = frozenset((inputs,) if isinstance(inputs, str) else inputs)
    chunks = plan.options.get("chunks", 1)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise VerificationError(f"plan option 'chunks' must be a positive int, got {chunks!r}")
    _check_structure(plan, chunks, check_types)
    for dp in plan.ranks:
        _check_accounting(dp, chunks)
    _check_point_to_point(plan)
    _check_collectives(plan)
    for dp in plan.ranks:
        _check_dataflow(dp, names, chunks, plan.info.get("output"))
    steps = _dry_run(plan) if dry_run else []
    sent, recv = plan_bytes(plan)
    return PlanReport(instructions=[len(dp.instructions) for dp in plan.ranks], steps=steps,
                      bytes_sent=sent, bytes_recv=recv)


def plan_bytes(plan: Plan) -> tuple[list[float], list[float]]:
    """Bytes every rank sends and receives in one training step: the sum of its instructions'
    volumes (their rules' ``volume``), the accounting :func:`verify_plan` reports, without its checks."""
    sent, recv = [0.0] * plan.num_ranks, [0.0] * plan.num_ranks
    totals: dict[int, tuple[tuple, int]] = {}  # id(shapes) -> (shapes, total elements): ranks share shape tuples
    for dp in plan.ranks:
        for inst in dp.instructions:
            if type(inst) is AllToAll and inst.send_shapes and inst.recv_shapes:
                out, into = _all_to_all_volume(inst, dp.rank, totals)
            else:
                out, into = _volume(inst, dp.rank)
            sent[dp.rank] += out
            recv[dp.rank] += into
    return sent, recv


def _all_to_all_volume(inst: AllToAll, rank: int, totals: dict[int, tuple[tuple, int]]) -> tuple[float, float]:
    """The all-to-all's volume (its rule's, :mod:`gnncompile.ir.rules`) in O(1) per shape tuple seen
    before: the elements of every member's shape but the rank's own (a local copy)."""
    def total(shapes: tuple) -> int:
        hit = totals.get(id(shapes))
        if hit is None or hit[0] is not shapes:
            hit = totals[id(shapes)] = (shapes, sum(math.prod(s) for s in shapes))
        return hit[1]

    es = elsize(inst.dtype)
    me = inst.group.index(rank)
    out = (total(inst.send_shapes) - math.prod(inst.send_shapes[me])) * es
    into = (total(inst.recv_shapes) - math.prod(inst.recv_shapes[me])) * es
    return (float(into), float(out)) if inst.grad else (float(out), float(into))


# --------------------------------------------------------------------------- errors
def _where(dp: DevicePlan, index: int) -> str:
    return f"rank {dp.rank} step {index} `{dp.instructions[index]}`"


def _error(msg: str, *sites: tuple[DevicePlan, Optional[int]]) -> VerificationError:
    return VerificationError("\n".join([msg] + [instruction_window(dp, index) for dp, index in sites]))


def _fail(dp: DevicePlan, index: Optional[int], msg: str) -> VerificationError:
    """An error at rank ``dp``'s step ``index`` (the whole rank when ``index`` is None)."""
    where = f"rank {dp.rank}" if index is None else _where(dp, index)
    return _error(f"{where}: {msg}", (dp, index))


# --------------------------------------------------------------------------- 1. structure
@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` has the type ``hint`` (int, str, bool, and tuples of them: ``tuple[X, ...]``
    or fixed ``tuple[X, Y]``, nested)."""
    return _checker(hint)(value)


@functools.lru_cache(maxsize=None)
def _checker(hint: Any, sized: bool = False) -> Any:
    """A fast predicate for ``hint`` (built once per annotation); an ``int`` may be a per-step size
    (:class:`~gnncompile.ir.plan.StepSize`) only where ``sized``."""
    if hint is bool:
        return lambda v: isinstance(v, bool)
    if hint is int:
        if sized:
            return lambda v: isinstance(v, int) and not isinstance(v, bool)
        return lambda v: type(v) is int
    if hint is str:
        return lambda v: isinstance(v, str)
    if typing.get_origin(hint) is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis or len(args) == 1:  # tuple[X, ...]
            simple = _type_checker(args[0], sized)
            if simple is not None:  # by the entries' distinct types (a halo's row counts: one per rank)
                return lambda v: isinstance(v, tuple) and all(simple(t) for t in set(map(type, v)))
            inner = _checker(args[0], sized)
            return lambda v: isinstance(v, tuple) and all(inner(x) for x in v)
        parts = tuple(_checker(a, sized) for a in args)
        return lambda v: isinstance(v, tuple) and len(v) == len(parts) and all(f(x) for f, x in zip(parts, v))
    return lambda v: True


def _type_checker(hint: Any, sized: bool) -> Optional[Any]:
    """For a hint :func:`_checker` decides from the value's type alone (int, str, bool): that
    predicate on the type; None for others."""
    if hint is bool:
        return lambda t: t is bool
    if hint is int:
        return (lambda t: issubclass(t, int) and t is not bool) if sized else (lambda t: t is int)
    if hint is str:
        return lambda t: issubclass(t, str)
    return None


#: The instruction fields whose entries may be per-step sizes (:class:`~gnncompile.ir.plan.StepSize`).
SIZED_FIELDS = frozenset({"shape", "send_shapes", "recv_shapes", "send_rows", "recv_rows"})


@functools.lru_cache(maxsize=None)
def _field_checkers(cls: type) -> tuple[tuple[str, Any, Any], ...]:
    """(name, predicate, hint) of every dataclass field of ``cls`` (built once per class)."""
    hints = _hints(cls)
    return tuple((f.name, _checker(hints[f.name], f.name in SIZED_FIELDS), hints[f.name]) for f in fields(cls))


def _holds_step_size(value: Any) -> bool:
    return isinstance(value, StepSize) or isinstance(value, tuple) and any(map(_holds_step_size, value))


def _type_problem(obj: Any) -> Optional[str]:
    for name, ok, hint in _field_checkers(type(obj)):
        value = getattr(obj, name)
        if not ok(value):
            if _holds_step_size(value):
                return f"field {name!r} holds a per-step size ({value!r}); only {', '.join(sorted(SIZED_FIELDS))} may"
            want = getattr(hint, "__name__", None) or str(hint)
            return f"field {name!r} is {value!r}, expected {want}"
    return None


def _check_structure(plan: Plan, chunks: int, check_types: bool = True) -> None:
    """Check 1: rank numbering, field types, stage tables and each instruction on its own."""
    n = plan.num_ranks
    if n == 0:
        raise VerificationError("plan has no ranks")
    # instructions that passed the checks of their own, by their fields' identities (ranks repeat
    # them and share their shape tuples; a repr would cost as much as the checks, and equality is
    # not enough: True == 1, and a malformed field may be unhashable)
    alone: set[tuple] = set()
    field_names: dict[type, tuple[str, ...]] = {}
    for pos, dp in enumerate(plan.ranks):
        if not isinstance(dp, DevicePlan):
            raise VerificationError(f"plan.ranks[{pos}] is a {type(dp).__name__}, not a DevicePlan")
        if dp.rank != pos:
            raise VerificationError(f"ranks must be numbered 0..{n - 1} in order: position {pos} holds rank {dp.rank}")
        indices: dict[int, StageSpec] = {}
        producer: dict[str, int] = {}
        for spec in dp.stages:
            problem = _type_problem(spec) if isinstance(spec, StageSpec) else f"{spec!r} is not a StageSpec"
            if problem:
                raise _fail(dp, None, f"stage {getattr(spec, 'index', '?')}: {problem}")
            if spec.index in indices:
                raise _fail(dp, None, f"two stages have index {spec.index}")
            indices[spec.index] = spec
            for out in spec.outputs:
                if out in producer:
                    raise _fail(dp, None, f"value {out!r} is an output of stages {producer[out]} and {spec.index}")
                producer[out] = spec.index
        for i, inst in enumerate(dp.instructions):
            if not isinstance(inst, Instruction):
                raise VerificationError(f"rank {dp.rank} step {i}: {inst!r} is not an Instruction")
            names = field_names.get(type(inst))
            if names is None:
                names = field_names[type(inst)] = tuple(f.name for f in fields(inst))
            key = (type(inst), *[id(getattr(inst, f)) for f in names])
            problem = None
            if key not in alone:
                problem = (check_types and _type_problem(inst)) or _instruction_problem(inst, chunks)
                if not problem:
                    alone.add(key)
            problem = problem or _rule_problem(inst, dp.rank, n, indices)
            if problem:
                raise _fail(dp, i, problem)


def _instruction_problem(inst: Instruction, chunks: int) -> Optional[str]:
    """What is structurally wrong with ``inst`` wherever it is issued (None if nothing): the checks
    common to every instruction (its rule, chunk, dtype and shapes)."""
    try:
        rule(inst)
    except MissingRuleError as e:
        return str(e)
    chunk = getattr(inst, "chunk", 0)
    if not 0 <= chunk < chunks:
        return f"chunk {chunk} is outside the plan's chunks 0..{chunks - 1} (options['chunks'] = {chunks})"
    if hasattr(inst, "dtype") and elsize(inst.dtype) is None:
        return f"unknown dtype {inst.dtype!r} (not a torch dtype)"
    shapes = [getattr(inst, "shape", ()), *getattr(inst, "send_shapes", ()), *getattr(inst, "recv_shapes", ())]
    if any(d < 0 for shape in shapes for d in shape):
        return "shapes must not have negative dimensions"
    return None


def _rule_problem(inst: Instruction, rank: int, n: int, stages: dict[int, StageSpec]) -> Optional[str]:
    """What is wrong with ``inst`` issued by ``rank`` of ``n`` with ``stages``: its rule's ``problem``."""
    return rule(inst).problem(inst, rank, n, stages)


# --------------------------------------------------------------------------- 2. accounting
def _check_accounting(dp: DevicePlan, chunks: int) -> None:
    """Check 2: one Forward and one later Backward per stage and chunk, Recompute between, one final OPT."""
    forward: dict[tuple[int, int], int] = {}
    backward: dict[tuple[int, int], int] = {}
    opt: Optional[int] = None
    for i, inst in enumerate(dp.instructions):
        r = rule(inst)
        if r.runs:
            key = (inst.stage, inst.chunk)
            f, b = f"F{inst.stage}c{inst.chunk}", f"B{inst.stage}c{inst.chunk}"
            if r.runs == "forward":
                if key in forward:
                    raise _fail(dp, i, f"stage {inst.stage} runs its Forward on chunk {inst.chunk} twice "
                                       f"(first at step {forward[key]})")
                forward[key] = i
            elif r.runs == "backward":
                if key not in forward:
                    raise _fail(dp, i, f"Backward before its Forward {f}")
                if key in backward:
                    raise _fail(dp, i, f"stage {inst.stage} runs its Backward on chunk {inst.chunk} twice "
                                       f"(first at step {backward[key]})")
                if opt is not None:
                    raise _fail(dp, i, f"Backward after the optimizer step (OPT at step {opt})")
                backward[key] = i
            elif key not in forward or key in backward:
                raise _fail(dp, i, f"Recompute must come between {f} and {b}")
        elif r.kind == "collective" and opt is not None and r.effects(inst, {}).params == "reduce":
            raise _fail(dp, i, f"gradient all-reduce after the optimizer step (OPT at step {opt})")
        elif r.kind == "optimizer":
            if opt is not None:
                raise _fail(dp, i, f"second optimizer step (first OPT at step {opt})")
            opt = i
    for (stage, c), i in forward.items():
        spec = next((s for s in dp.stages if s.index == stage), None)
        if spec is not None and spec.runs and c not in spec.runs:
            raise _fail(dp, i, f"stage {stage} runs chunk {c}, which is not one of its chunks {list(spec.runs)}")
    for spec in dp.stages:
        for c in (spec.runs or range(chunks)):
            if (spec.index, c) not in forward:
                raise _fail(dp, None, f"stage {spec.index} never runs its Forward on chunk {c} (no F{spec.index}c{c})")
            if (spec.index, c) not in backward:
                raise _fail(dp, forward[spec.index, c], f"no Backward B{spec.index}c{c} for this Forward")
    if opt is None:
        raise _fail(dp, None, "no optimizer step (OPT)")


# --------------------------------------------------------------------------- 3. matching
def _check_point_to_point(plan: Plan) -> None:
    """FIFO matching of Send/Recv per ordered pair of ranks."""
    sends: dict[tuple[int, int], list[int]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for dp in plan.ranks:
        for i, inst in enumerate(dp.instructions):
            side = rule(inst).side
            if side == "send":
                sends[dp.rank, inst.peer].append(i)
            elif side == "recv":
                recvs[inst.peer, dp.rank].append(i)
    for src, dst in sorted(set(sends) | set(recvs)):
        a, b = plan.ranks[src], plan.ranks[dst]
        ss, rr = sends[src, dst], recvs[src, dst]
        for k, (si, ri) in enumerate(zip(ss, rr)):
            s, r = a.instructions[si], b.instructions[ri]
            diffs = [f"{name} {getattr(s, name)!r} on the SEND vs {getattr(r, name)!r} on the RECV"
                     for name in MESSAGE_FIELDS if getattr(s, name) != getattr(r, name)]
            if diffs:
                raise _error(f"SEND/RECV mismatch: message #{k} from rank {src} to rank {dst} is "
                             f"{_where(a, si)} but {_where(b, ri)}: {'; '.join(diffs)}", (a, si), (b, ri))
        if len(ss) > len(rr):
            si = ss[len(rr)]
            raise _error(f"{_where(a, si)} has no matching RECV on rank {dst} (rank {dst} receives "
                         f"{len(rr)} message(s) from rank {src}, rank {src} sends {len(ss)})", (a, si), (b, None))
        if len(rr) > len(ss):
            ri = rr[len(ss)]
            raise _error(f"{_where(b, ri)} has no matching SEND on rank {src} (rank {src} sends "
                         f"{len(ss)} message(s) to rank {dst}, rank {dst} receives {len(rr)})", (b, ri), (a, None))


def _check_collectives(plan: Plan) -> None:
    """Same collective sequence per group on all members; pairwise halo rows / all-to-all shapes agree."""
    seqs: dict[tuple[int, ...], dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    for dp in plan.ranks:
        for i, inst in enumerate(dp.instructions):
            if rule(inst).kind == "collective":
                seqs[inst.group][dp.rank].append(i)
    for group in sorted(seqs):
        pos = {m: seqs[group][m] for m in group}
        ref = plan.ranks[group[0]]
        ref_sig = [rule(x).signature(x) for x in (ref.instructions[i] for i in pos[group[0]])]
        for m in group[1:]:
            dp = plan.ranks[m]
            sig = [rule(x).signature(x) for x in (dp.instructions[i] for i in pos[m])]
            if sig != ref_sig:
                raise _collective_mismatch(group, (ref, pos[ref.rank], ref_sig), (dp, pos[m], sig))
        for k in range(len(ref_sig)):
            insts = [plan.ranks[m].instructions[pos[m][k]] for m in group]
            _check_pairwise(plan, group, [pos[m][k] for m in group], insts)


def _collective_mismatch(group: tuple[int, ...],
                         *sides: tuple[DevicePlan, list[int], list[tuple]]) -> VerificationError:
    """The error for two members of ``group`` issuing different collective sequences over it."""
    (a, apos, asig), (b, bpos, bsig) = sides
    k = next((j for j, (x, y) in enumerate(zip(asig, bsig)) if x != y), min(len(asig), len(bsig)))
    kind = "order mismatch" if Counter(asig) == Counter(bsig) else "mismatch"

    def at(dp: DevicePlan, p: list[int]) -> str:
        return f"`{dp.instructions[p[k]]}` (step {p[k]}) on rank {dp.rank}" if k < len(p) else \
            f"missing on rank {dp.rank} (it issues {len(p)} collective(s) over this group)"

    detail = ""
    if k < len(apos) and k < len(bpos) and str(a.instructions[apos[k]]) == str(b.instructions[bpos[k]]):
        x, y = dict(asig[k][1:]), dict(bsig[k][1:])
        detail = ": " + "; ".join(f"{f} {x[f]!r} vs {y[f]!r}" for f in x if x[f] != y[f])
    return _error(f"collective {kind} over group {group}: collective #{k} is {at(a, apos)} but {at(b, bpos)}{detail}",
                  (a, apos[k] if k < len(apos) else None), (b, bpos[k] if k < len(bpos) else None))


def _check_pairwise(plan: Plan, group: tuple[int, ...], idx: list[int], insts: list[Instruction]) -> None:
    """What group[i] sends to group[j] is what group[j] expects from group[i]."""
    per_member = rule(insts[0]).per_member
    if not per_member:
        return
    out, into, counted = per_member
    what = f"{counted} disagree"
    sent_all, expected_all = [getattr(a, out) for a in insts], [getattr(b, into) for b in insts]
    n = len(insts)
    if all(len(x) == n for x in sent_all) and all(len(x) == n for x in expected_all):
        # every member lists every member: what i sends is column i of what they expect (compared
        # as tuples, O(n^2) in C); a disagreement is located below
        if all(tuple(s) == col for s, col in zip(sent_all, zip(*expected_all))):
            return
    for i, a in enumerate(insts):
        for j, b in enumerate(insts):
            sent, expected = getattr(a, out), getattr(b, into)
            if sent and expected and sent[j] != expected[i]:
                da, db = plan.ranks[group[i]], plan.ranks[group[j]]
                raise _error(f"{what}: {_where(da, idx[i])} sends {sent[j]} to rank {group[j]}, "
                             f"{_where(db, idx[j])} expects {expected[i]} from rank {group[i]}",
                             (da, idx[i]), (db, idx[j]))


# --------------------------------------------------------------------------- 4. dataflow
def _check_dataflow(dp: DevicePlan, inputs: frozenset[str], chunks: int, output: Optional[str] = None) -> None:
    """Check 4: every value and gradient rank ``dp`` uses is available at that step (the effects of
    :mod:`gnncompile.ir.dataflow`, applied as the module docstring says)."""
    stages = {s.index: s for s in dp.stages}
    effs = [effects(inst, stages) for inst in dp.instructions]
    consumers: dict[str, list[int]] = defaultdict(list)
    for s in dp.stages:
        for v in dict.fromkeys(s.inputs):
            consumers[v].append(s.index)
    # contributions expected to the gradient of (v, c): each Backward of the stage table (one per
    # consuming stage and chunk it runs, or per chunk reading c for a cross-chunk read), and each
    # grad RECV and grad collective of the program
    contributions = {b: effects(b, stages).grad_writes
                     for b in (Backward(s.index, c) for s in dp.stages for c in (s.runs or range(chunks)))}
    expected: Counter[tuple[str, int]] = Counter(k for keys in contributions.values() for k in keys)
    incoming: Counter[tuple[str, int]] = Counter(k for inst, e in zip(dp.instructions, effs)
                                                 if rule(inst).runs != "backward" for k in e.grad_writes)
    with_incoming = {v for v, _ in incoming}
    loss_roots = {o for s in dp.stages for o in s.outputs if not consumers[o] and o not in with_incoming}
    if output is not None and output not in consumers:  # the loss reads it (a converted output, e.g. value@rows)
        loss_roots.add(output)
    available: set[tuple[str, int]] = set()
    freed: dict[tuple[str, int], int] = {}
    grads: Counter[tuple[str, int]] = Counter()  # contributions received so far

    def need(i: int, v: str, c: int) -> None:
        if v in inputs or (v, c) in available:
            return
        if (v, c) in freed:
            why = f"it was freed at step {freed[v, c]}"
        else:
            later = next((k for k in range(i + 1, len(effs)) if (v, c) in effs[k].writes), None)
            why = f"it is produced only later, at step {later}" if later is not None else \
                f"it is never produced on rank {dp.rank} (not a plan input, stage output, RECV or collective output)"
        raise _fail(dp, i, f"needs {v} c{c}, which is not available: {why}")

    def need_grad(i: int, v: str, c: int) -> None:
        if v in loss_roots:
            return
        if expected[v, c] + incoming[v, c] == 0:
            raise _fail(dp, i, f"needs the gradient of {v} c{c}, which is never produced on rank {dp.rank} (no stage "
                               f"here consumes {v}, and there is no grad RECV or grad collective of {v} c{c})")
        if grads[v, c] < expected[v, c] + incoming[v, c]:
            done = set(dp.instructions[:i])
            pending = [str(b) for b, keys in contributions.items() if (v, c) in keys and b not in done]
            pending += [f"`{x}` (step {k})" for k, (x, e) in enumerate(zip(dp.instructions, effs))
                        if k > i and rule(x).runs != "backward" and (v, c) in e.grad_writes]
            raise _fail(dp, i, f"needs the gradient of {v} c{c}, which is not complete yet: it still waits for "
                               f"{', '.join(pending)}")

    for i, e in enumerate(effs):
        for v, c in e.reads:
            need(i, v, c)
        for v, c in e.grad_reads:
            need_grad(i, v, c)
        for v in e.reduced:
            if v not in inputs and not any((v, c) in available for c in range(chunks)):
                raise _fail(dp, i, f"all-reduces {v}, which is not available on any chunk")
        for v, c in e.frees:
            need(i, v, c)
            if v in inputs:
                raise _fail(dp, i, f"{v} is a plan input (chunk-independent); it cannot be freed")
            available.discard((v, c))
            freed[v, c] = i
        for key in e.writes:
            available.add(key)
            freed.pop(key, None)
        for key in e.grad_writes:
            grads[key] += 1


# --------------------------------------------------------------------------- 5. dry run
def _dry_run(plan: Plan) -> list[list[Site]]:
    """The rounds of the unit-cost replay (:class:`PlanReport` ``steps``), or the engine's deadlock error."""
    by_start: dict[float, list[Site]] = defaultdict(list)
    for events in replay(plan, _unit):
        for e in events:
            by_start[e.start].append((e.rank, e.index))
    return [by_start[t] for t in sorted(by_start)]


def _unit(rank: int, index: int) -> float:
    return 1.0


# --------------------------------------------------------------------------- volume
def _volume(inst: Instruction, rank: int) -> tuple[float, float]:
    """(bytes sent, bytes received) by ``rank`` for ``inst`` (the rule's ``volume``; conventions in the
    module docstring)."""
    return rule(inst).volume(inst, rank)
