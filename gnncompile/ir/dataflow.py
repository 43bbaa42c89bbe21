"""What each plan instruction reads and writes: the one table of the plan IR's dataflow rules.

Every :class:`~gnncompile.ir.plan.Instruction` class declares its effects on its rank's store, in the
style of an fx node's or a JAX primitive's declared effects: :data:`RULES` maps the class to a rule,
and :func:`effects` applies it to an instruction (and the rank's stages) to give an :class:`Effects`.
Values are ``(name, chunk)`` pairs (:data:`Key`); a Send/Recv acts on its ``local`` name (default its
``value``), a collective writes its ``output`` (``h@halo``, ``h@cols``, ``h@gathered``,
``h@scattered``).

========================  ===========================================================================
instruction               effects
========================  ===========================================================================
Forward, Recompute        ``reads`` its stage's inputs at its chunk (a cross-chunk input: at every chunk
                          ``StageSpec.chunks_read`` lists), ``writes`` its stage's outputs at its chunk
Backward                  ``grad_reads`` its outputs', ``grad_writes`` (adds to) its inputs' gradients
                          (the chunks its Forward read); its autograd graph holds the ``saved`` values
                          (outputs and inputs); ``params="accumulate"``: adds to the parameters' gradients
Send                      ``reads`` its value, or ``grad_reads`` its gradient (``grad=True``)
Recv                      ``writes`` its value (with ``part``, each block writes it), or ``grad_writes``
                          (adds to) its gradient
HaloExchange, AllToAll,   ``reads`` ``value``, ``writes`` ``output``; with ``grad=True`` ``grad_reads``
AllGather, ReduceScatter  ``output`` and ``grad_writes`` ``value`` (the gradient travels back)
AllReduce                 ``AR grads``: ``params="reduce"`` (sums the parameters' gradients); ``AR v``:
                          chunk-less, ``reduced``: sums ``v`` in place on every chunk the rank holds
Free                      ``frees`` its value
OptimizerStep             ``params="update"`` (applies the gradients to the parameters)
========================  ===========================================================================

The table states the facts; each user applies them with a policy of its own:

- :func:`~gnncompile.ir.verify_plan.verify_plan` (use before definition): ``reads`` and ``frees``
  need the value available, ``grad_reads`` the complete gradient (every ``grad_writes`` of the
  rank, unless the value is a loss root); ``saved`` values are not checked (autograd keeps them,
  even past a ``Free`` of the stored value); ``reduced`` needs the value on some chunk; ``params``
  is checked by the forward/backward accounting, not here.
- ``gnncompile.cost_models.simulate`` (dependencies): ``reads`` and ``saved`` wait for the last
  write; ``grad_reads`` for every ``grad_writes`` issued before; ``frees`` for the write and every
  read since (but a posted all-to-all's: it copied its input); ``reduced`` reads and rewrites every
  chunk written so far; ``params="reduce"`` waits for the accumulations since the previous reduce,
  and an ``update`` is a barrier (it waits for everything before it and everything after waits for it).
- ``gnncompile.passes.free.insert_frees`` (last forward use): ``reads`` and ``writes`` only; saved
  values are the autograd graph's, gradients are never freed, and ``reduced`` values (``AR v``,
  which no strategy emits on a freeable value) are not tracked.
- ``gnncompile.cost_models.model`` (memory liveness): a stored value lives at least to its last
  ``reads`` (or to its ``Free``).

Not in the table: the plan inputs (``g``, ``x``: chunk-independent and resident; every user is
given their names and ignores them) and a stage's stale reads (``StageSpec.stale``: the previous
step's copy, no dependency within the step).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Callable, Literal, Mapping, NamedTuple, Union

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

__all__ = ["Key", "Effects", "RULES", "effects", "stage_reads"]

#: A stored value of one chunk: ``(name, chunk)``.
Key = tuple[str, int]
#: A rank's stages by index.
Stages = Mapping[int, StageSpec]


class Effects(NamedTuple):
    """What one instruction does to its rank's store of values and gradients (see the module docstring).

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


def _outputs(spec: StageSpec, chunk: int) -> tuple[Key, ...]:
    return tuple((o, chunk) for o in spec.outputs)


def _forward(inst: Union[Forward, Recompute], stages: Stages) -> Effects:
    spec = stages[inst.stage]
    return Effects(reads=stage_reads(spec, inst.chunk), writes=_outputs(spec, inst.chunk))


def _backward(inst: Backward, stages: Stages) -> Effects:
    spec = stages[inst.stage]
    outputs, inputs = _outputs(spec, inst.chunk), stage_reads(spec, inst.chunk)
    return Effects(saved=outputs + inputs, grad_reads=outputs, grad_writes=inputs, params="accumulate")


def _send(inst: Send, stages: Stages) -> Effects:
    key = ((inst.name, inst.chunk),)
    return Effects(grad_reads=key) if inst.grad else Effects(reads=key)


def _recv(inst: Recv, stages: Stages) -> Effects:
    key = ((inst.name, inst.chunk),)
    return Effects(grad_writes=key) if inst.grad else Effects(writes=key)


def _conversion(inst: Union[HaloExchange, AllToAll, AllGather, ReduceScatter], stages: Stages) -> Effects:
    value, output = ((inst.value, inst.chunk),), ((inst.output, inst.chunk),)
    return Effects(grad_reads=output, grad_writes=value) if inst.grad else Effects(reads=value, writes=output)


def _all_reduce(inst: AllReduce, stages: Stages) -> Effects:
    return Effects(params="reduce") if inst.value == "grads" else Effects(reduced=(inst.value,))


def _free(inst: Free, stages: Stages) -> Effects:
    return Effects(frees=((inst.value, inst.chunk),))


def _optimizer_step(inst: OptimizerStep, stages: Stages) -> Effects:
    return Effects(params="update")


_RULES: dict[type[Instruction], Callable[[Any, Stages], Effects]] = {
    Forward: _forward, Recompute: _forward, Backward: _backward, Send: _send, Recv: _recv,
    HaloExchange: _conversion, AllToAll: _conversion, AllGather: _conversion, ReduceScatter: _conversion,
    AllReduce: _all_reduce, Free: _free, OptimizerStep: _optimizer_step,
}
#: The rule of each instruction class: ``rule(instruction, stages) -> Effects``.
RULES: Mapping[type[Instruction], Callable[[Any, Stages], Effects]] = MappingProxyType(_RULES)


def effects(inst: Instruction, stages: Stages) -> Effects:
    """The effects of ``inst`` on its rank, whose stages by index are ``stages``.

    Raises ``KeyError`` if ``inst`` runs a stage missing from ``stages`` and ``TypeError`` for an
    instruction class without a rule.
    """
    rule = _RULES.get(type(inst))
    if rule is None:
        raise TypeError(f"no dataflow rule for instruction type {type(inst).__name__}")
    return rule(inst, stages)
