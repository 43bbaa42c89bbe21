"""One rule record per plan instruction class: what an instruction means, declared once.

Every :class:`~gnncompile.ir.plan.Instruction` class has one :class:`InstructionRule`, looked up
with :func:`rule` (an instruction) or :func:`rule_for` (a class, walking its MRO), in the style of
JAX's per-primitive rule tables: the layer that owns a meaning registers it on the one record.

The IR fills, here:

- ``kind``: ``"compute"`` (runs a stage), ``"p2p"`` (Send/Recv), ``"collective"`` (every member of
  ``group`` issues it, in the same order), ``"memory"`` (Free) or ``"optimizer"`` (OPT);
- ``effects(inst, stages) -> Effects``: what it reads and writes on its rank's store (the table of
  :mod:`gnncompile.ir.dataflow`, which documents it);
- ``volume(inst, rank) -> (sent, received)``: the bytes it moves for ``rank`` in one step
  (conventions in :mod:`gnncompile.ir.verify_plan`);
- ``signature(inst)``: what must match across ranks: between the members of a collective's group
  (every field but the per-member ones), or between a Send and its Recv;
- ``problem(inst, rank, n, stages)``: what is structurally wrong with it on ``rank`` of an
  ``n``-rank plan (``None``: nothing), beyond the checks common to every instruction;
- ``runs`` (the pass of its stage a compute instruction runs), ``side`` (a point-to-point
  instruction's end of the channel), ``posted`` (the runtime posts it and only its readers wait;
  it copies its input when posted) and ``per_member`` (a collective's fields saying what it sends
  to and receives from each member, and what they count: what ``group[i]`` sends to ``group[j]``
  is what ``group[j]`` receives from ``group[i]``).

Upper layers fill their slots when they are imported: ``cost`` by :mod:`gnncompile.cost_models.model`
(:func:`register_cost`), ``execute`` by :mod:`gnncompile.runtime.executor` (:func:`register_execute`).
The IR never looks into them. Adding an instruction class means one record here (or
:func:`register_rule` from elsewhere), one cost rule and one execution rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Literal, Mapping, NamedTuple, Optional, Sequence, Union

import torch

from ..errors import PlanningError, RuntimeFailure, VerificationError
from .plan import (
    AllGather,
    AllReduce,
    AllToAll,
    Backward,
    Forward,
    Free,
    HaloExchange,
    Instruction,
    OptimizerStep,
    Recompute,
    Recv,
    ReduceScatter,
    Send,
    StageSpec,
)

__all__ = ["Key", "Stages", "Effects", "stage_reads", "InstructionRule", "rule", "rule_for", "register_rule",
           "register_cost", "register_execute", "RULE_TABLE", "MissingRuleError", "elsize", "channel"]

#: A stored value of one chunk: ``(name, chunk)``.
Key = tuple[str, int]
#: A rank's stages by index.
Stages = Mapping[int, StageSpec]

Kind = Literal["compute", "p2p", "collective", "memory", "optimizer"]


class Effects(NamedTuple):
    """What one instruction does to its rank's store of values and gradients (see :mod:`gnncompile.ir.dataflow`).

    ``reads``: stored values it reads; ``writes``: values it stores (available from then on);
    ``saved``: values it uses through its autograd graph rather than the store; ``grad_reads``:
    gradients it reads, complete; ``grad_writes``: gradients it adds a contribution to; ``frees``:
    stored values it drops; ``reduced``: chunk-less values it reduces in place on every chunk the
    rank holds; ``params``: what it does to the parameters' gradients (``"accumulate"``,
    ``"reduce"``) or the parameters (``"update"``), ``""`` nothing. (A named tuple: the users
    compute the effects of every instruction of every plan they look at.)
    """

    reads: tuple[Key, ...] = ()
    writes: tuple[Key, ...] = ()
    saved: tuple[Key, ...] = ()
    grad_reads: tuple[Key, ...] = ()
    grad_writes: tuple[Key, ...] = ()
    frees: tuple[Key, ...] = ()
    reduced: tuple[str, ...] = ()
    params: Literal["", "accumulate", "reduce", "update"] = ""


def stage_reads(spec: StageSpec, chunk: int) -> tuple[Key, ...]:
    """The values ``Forward(spec.index, chunk)`` reads: each input once, at every chunk it reads."""
    return tuple((v, k) for v in dict.fromkeys(spec.inputs) for k in spec.chunks_read(v, chunk))


def elsize(dtype: str) -> Optional[int]:
    """Bytes per element of the torch dtype named ``dtype`` (None if there is no such dtype)."""
    t = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    return t.itemsize if isinstance(t, torch.dtype) else None


@dataclass
class InstructionRule:
    """Everything the compiler knows about one instruction class (fields: module docstring).

    ``cost`` and ``execute`` are ``None`` until their layer is imported; :meth:`cost_rule` and
    :meth:`execute_rule` raise a clear error for a class that has none.
    """

    cls: type
    kind: Kind
    effects: Callable[[Any, Stages], Effects]
    volume: Callable[[Any, int], tuple[float, float]]
    signature: Callable[[Any], tuple]
    problem: Callable[[Any, int, int, Stages], Optional[str]]
    runs: Literal["", "forward", "backward", "recompute"] = ""
    side: Literal["", "send", "recv"] = ""
    posted: bool = False
    per_member: tuple[str, str, str] = ()
    cost: Any = None
    execute: Any = None

    @property
    def communicates(self) -> bool:
        return self.kind in ("p2p", "collective")

    def cost_rule(self) -> Any:
        """The cost model's rule (registered by :mod:`gnncompile.cost_models.model`)."""
        if self.cost is None:
            raise PlanningError(f"no cost rule for instruction class {self.cls.__name__}: register one with "
                                f"gnncompile.ir.rules.register_cost (import gnncompile.cost_models.model first)")
        return self.cost

    def execute_rule(self) -> Any:
        """The runtime's rule (registered by :mod:`gnncompile.runtime.executor`)."""
        if self.execute is None:
            raise RuntimeFailure(f"no execution rule for instruction class {self.cls.__name__}: register one with "
                                 f"gnncompile.ir.rules.register_execute (import gnncompile.runtime.executor first)")
        return self.execute


class MissingRuleError(VerificationError, TypeError):
    """An instruction class has no rule record (a ``TypeError`` too: the object is not a known instruction)."""


_TABLE: dict[type, InstructionRule] = {}
#: The rule of each instruction class (read-only view; register with :func:`register_rule`).
RULE_TABLE: Mapping[type, InstructionRule] = _TABLE


def register_rule(r: InstructionRule) -> InstructionRule:
    """Add the rule record of ``r.cls`` (one per class)."""
    if r.cls in _TABLE:
        raise VerificationError(f"instruction class {r.cls.__name__} already has a rule")
    _TABLE[r.cls] = r
    _LOOKUP.clear()
    return r


_LOOKUP: dict[type, InstructionRule] = {}


def rule_for(cls: type, what: str = "") -> InstructionRule:
    """The rule of instruction class ``cls`` (its own, or its nearest base class's); ``what`` names the
    rule the caller wants in the :class:`MissingRuleError` raised when there is none."""
    r = _LOOKUP.get(cls)
    if r is not None:
        return r
    for base in getattr(cls, "__mro__", ()):
        r = _TABLE.get(base)
        if r is not None:
            _LOOKUP[cls] = r
            return r
    raise MissingRuleError(f"no {what + ' ' if what else ''}rule for instruction type "
                           f"{getattr(cls, '__name__', cls)}; known: {', '.join(c.__name__ for c in _TABLE)} "
                           f"(add one with gnncompile.ir.rules.register_rule)")


def rule(inst: Instruction, what: str = "") -> InstructionRule:
    """The rule of ``inst``'s class (see :func:`rule_for`)."""
    r = _LOOKUP.get(type(inst))
    return r if r is not None else rule_for(type(inst), what)


def _own(cls: type) -> InstructionRule:
    try:
        return _TABLE[cls]
    except KeyError:
        raise VerificationError(f"instruction class {getattr(cls, '__name__', cls)!r} has no rule record of its own: "
                                f"register one with register_rule first") from None


def register_cost(cls: type, fn: Any) -> None:
    """Set the cost model's rule of ``cls`` (called by the cost models when they are imported)."""
    _own(cls).cost = fn


def register_execute(cls: type, fn: Any) -> None:
    """Set the runtime's execution rule of ``cls`` (called by the runtime when it is imported)."""
    _own(cls).execute = fn


def channel(inst: Union[Send, Recv], rank: int) -> tuple[int, int]:
    """The ordered pair ``(source, destination)`` of the messages a Send/Recv on ``rank`` belongs to."""
    return (rank, inst.peer) if rule(inst).side == "send" else (inst.peer, rank)


# --------------------------------------------------------------------------- effects
def _outputs(spec: StageSpec, chunk: int) -> tuple[Key, ...]:
    return tuple((o, chunk) for o in spec.outputs)


def _forward_effects(inst: Union[Forward, Recompute], stages: Stages) -> Effects:
    spec = stages[inst.stage]
    return Effects(reads=stage_reads(spec, inst.chunk), writes=_outputs(spec, inst.chunk))


def _backward_effects(inst: Backward, stages: Stages) -> Effects:
    spec = stages[inst.stage]
    outputs, inputs = _outputs(spec, inst.chunk), stage_reads(spec, inst.chunk)
    return Effects(saved=outputs + inputs, grad_reads=outputs, grad_writes=inputs, params="accumulate")


def _send_effects(inst: Send, stages: Stages) -> Effects:
    key = ((inst.name, inst.chunk),)
    return Effects(grad_reads=key) if inst.grad else Effects(reads=key)


def _recv_effects(inst: Recv, stages: Stages) -> Effects:
    key = ((inst.name, inst.chunk),)
    return Effects(grad_writes=key) if inst.grad else Effects(writes=key)


def _conversion_effects(inst: Union[HaloExchange, AllToAll, AllGather, ReduceScatter], stages: Stages) -> Effects:
    value, output = ((inst.value, inst.chunk),), ((inst.output, inst.chunk),)
    return Effects(grad_reads=output, grad_writes=value) if inst.grad else Effects(reads=value, writes=output)


def _all_reduce_effects(inst: AllReduce, stages: Stages) -> Effects:
    return Effects(params="reduce") if inst.value == "grads" else Effects(reduced=(inst.value,))


def _free_effects(inst: Free, stages: Stages) -> Effects:
    return Effects(frees=((inst.value, inst.chunk),))


def _optimizer_effects(inst: OptimizerStep, stages: Stages) -> Effects:
    return Effects(params="update")


# --------------------------------------------------------------------------- volume
def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _no_volume(inst: Instruction, rank: int) -> tuple[float, float]:
    return 0.0, 0.0


def _send_volume(inst: Send, rank: int) -> tuple[float, float]:
    return float(_numel(inst.shape) * elsize(inst.dtype)), 0.0


def _recv_volume(inst: Recv, rank: int) -> tuple[float, float]:
    return 0.0, float(_numel(inst.shape) * elsize(inst.dtype))


def _ring_volume(inst: Union[AllGather, ReduceScatter], rank: int) -> tuple[float, float]:
    n = len(inst.group)
    v = float((n - 1) * _numel(inst.shape) * elsize(inst.dtype) // n)
    return v, v


def _all_reduce_volume(inst: AllReduce, rank: int) -> tuple[float, float]:
    n = len(inst.group)
    v = float(2 * (n - 1) * inst.numel * elsize(inst.dtype) // n)   # whole bytes, as the runtime counts them
    return v, v


def _halo_volume(inst: HaloExchange, rank: int) -> tuple[float, float]:
    es = elsize(inst.dtype)
    out, into = sum(inst.send_rows) * inst.width * es, sum(inst.recv_rows) * inst.width * es
    return (float(into), float(out)) if inst.grad else (float(out), float(into))


def _all_to_all_volume(inst: AllToAll, rank: int) -> tuple[float, float]:
    es = elsize(inst.dtype)
    me = inst.group.index(rank)
    out = sum(_numel(s) for j, s in enumerate(inst.send_shapes) if j != me) * es
    into = sum(_numel(s) for j, s in enumerate(inst.recv_shapes) if j != me) * es
    return (float(into), float(out)) if inst.grad else (float(out), float(into))


# --------------------------------------------------------------------------- signatures
#: Collective fields that legitimately differ between the members of a group.
PER_MEMBER_FIELDS = frozenset({"group", "send_rows", "recv_rows", "send_shapes", "recv_shapes"})
#: The fields a Send and its Recv must agree on, in the order errors list them.
MESSAGE_FIELDS = ("value", "chunk", "grad", "shape", "dtype")


def _local_signature(inst: Instruction) -> tuple:
    return (type(inst).__name__,)


def _message_signature(inst: Union[Send, Recv]) -> tuple:
    return ("p2p",) + tuple((name, getattr(inst, name)) for name in MESSAGE_FIELDS)


def _collective_signature(inst: Instruction) -> tuple:
    return (type(inst).__name__,) + tuple(
        (f.name, getattr(inst, f.name)) for f in fields(inst) if f.name not in PER_MEMBER_FIELDS)


# --------------------------------------------------------------------------- structure
def _no_problem(inst: Instruction, rank: int, n: int, stages: Stages) -> Optional[str]:
    return None


def _stage_problem(inst: Union[Forward, Backward, Recompute], rank: int, n: int, stages: Stages) -> Optional[str]:
    if inst.stage not in stages:
        return f"stage {inst.stage} is not one of rank {rank}'s stages {sorted(stages)}"
    return None


def _peer_problem(inst: Union[Send, Recv], rank: int, n: int, stages: Stages) -> Optional[str]:
    if not 0 <= inst.peer < n:
        return f"peer {inst.peer} is not a rank of this {n}-rank plan"
    if inst.peer == rank:
        return f"rank {rank} cannot {'send to' if rule(inst).side == 'send' else 'receive from'} itself"
    return None


def _group_problem(inst: Instruction, rank: int, n: int) -> Optional[str]:
    group = inst.group
    if not group or list(group) != sorted(set(group)):
        return f"group {group} must be non-empty, sorted and without duplicates"
    if not all(0 <= m < n for m in group):
        return f"group {group} names ranks outside 0..{n - 1}"
    if rank not in group:
        return f"rank {rank} issues a collective over group {group}, which does not include it"
    return None


def _collective_problem(inst: Instruction, rank: int, n: int, stages: Stages) -> Optional[str]:
    return _group_problem(inst, rank, n)


def _halo_problem(inst: HaloExchange, rank: int, n: int, stages: Stages) -> Optional[str]:
    problem = _group_problem(inst, rank, n)
    if problem:
        return problem
    group, me = inst.group, inst.group.index(rank)
    if len(inst.send_rows) != len(group) or len(inst.recv_rows) != len(group):
        return (f"send_rows {inst.send_rows} and recv_rows {inst.recv_rows} need one entry per member "
                f"of group {group}")
    if inst.send_rows[me] or inst.recv_rows[me]:
        return f"a rank exchanges no halo rows with itself: entry {me} (rank {rank}) must be 0"
    if inst.width < 0 or min(inst.send_rows + inst.recv_rows) < 0:
        return "row counts and width must not be negative"
    return None


def _all_to_all_problem(inst: AllToAll, rank: int, n: int, stages: Stages) -> Optional[str]:
    problem = _group_problem(inst, rank, n)
    if problem:
        return problem
    for name in ("send_shapes", "recv_shapes"):
        if len(getattr(inst, name)) not in (0, len(inst.group)):
            return f"{name} needs one shape per member of group {inst.group} (or none)"
    return None


def _all_reduce_problem(inst: AllReduce, rank: int, n: int, stages: Stages) -> Optional[str]:
    problem = _group_problem(inst, rank, n)
    if problem:
        return problem
    if inst.numel < 0:
        return f"numel {inst.numel} is negative"
    return None


# --------------------------------------------------------------------------- the table
def _compute(cls: type, runs: Literal["forward", "backward", "recompute"], eff: Callable) -> InstructionRule:
    return InstructionRule(cls, "compute", eff, _no_volume, _local_signature, _stage_problem, runs=runs)


def _conversion(cls: type, volume: Callable, problem: Callable, posted: bool = False,
                per_member: tuple[str, str, str] = ()) -> InstructionRule:
    return InstructionRule(cls, "collective", _conversion_effects, volume, _collective_signature, problem,
                           posted=posted, per_member=per_member)


for _r in (
    _compute(Forward, "forward", _forward_effects),
    _compute(Backward, "backward", _backward_effects),
    _compute(Recompute, "recompute", _forward_effects),
    InstructionRule(Send, "p2p", _send_effects, _send_volume, _message_signature, _peer_problem, side="send"),
    InstructionRule(Recv, "p2p", _recv_effects, _recv_volume, _message_signature, _peer_problem, side="recv"),
    _conversion(HaloExchange, _halo_volume, _halo_problem, per_member=("send_rows", "recv_rows", "halo row counts")),
    _conversion(AllToAll, _all_to_all_volume, _all_to_all_problem, posted=True,
                per_member=("send_shapes", "recv_shapes", "all-to-all shapes")),
    _conversion(AllGather, _ring_volume, _collective_problem),
    _conversion(ReduceScatter, _ring_volume, _collective_problem),
    InstructionRule(AllReduce, "collective", _all_reduce_effects, _all_reduce_volume, _collective_signature,
                    _all_reduce_problem),
    InstructionRule(Free, "memory", _free_effects, _no_volume, _local_signature, _no_problem),
    InstructionRule(OptimizerStep, "optimizer", _optimizer_effects, _no_volume, _local_signature, _no_problem),
):
    register_rule(_r)
del _r
