"""What each plan instruction reads and writes: the one table of the plan IR's dataflow rules.

Every :class:`~gnncompile.ir.plan.Instruction` class declares its effects on its rank's store, in the
style of an fx node's or a JAX primitive's declared effects: the ``effects`` field of the class's
record in :mod:`gnncompile.ir.rules` (:data:`RULES` is a view of them), which :func:`effects` applies
to an instruction (and the rank's stages) to give an :class:`Effects`.
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
from typing import Any, Callable, Mapping

from .plan import Instruction
from .rules import RULE_TABLE, Effects, Key, Stages, rule, stage_reads

__all__ = ["Key", "Effects", "RULES", "effects", "stage_reads"]

#: The effects rule of each instruction class, ``rule(instruction, stages) -> Effects`` (a view of
#: the ``effects`` field of :data:`gnncompile.ir.rules.RULE_TABLE`).
RULES: Mapping[type[Instruction], Callable[[Any, Stages], Effects]] = MappingProxyType(
    {cls: r.effects for cls, r in RULE_TABLE.items()})


def effects(inst: Instruction, stages: Stages) -> Effects:
    """The effects of ``inst`` on its rank, whose stages by index are ``stages``.

    Raises ``KeyError`` if ``inst`` runs a stage missing from ``stages`` and
    :class:`~gnncompile.ir.rules.MissingRuleError` (a ``TypeError``) for an instruction class without a rule.
    """
    return rule(inst, "dataflow").effects(inst, stages)
