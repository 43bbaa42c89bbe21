"""``gnncompile.plan``: trace a model, apply a strategy's lowering, return a runnable :class:`Plan`."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from .errors import PlanningError
from .frontend.tracer import trace
from .graph.core import Graph, GraphStats
from .ir.plan import Plan
from .ir.verify_plan import verify_plan

__all__ = ["plan", "STRATEGIES", "IMPLEMENTED_STRATEGIES"]

STRATEGIES = ("data", "task", "layer", "tensor", "mop", "split")
#: strategies with a lowering in this version
IMPLEMENTED_STRATEGIES = ("data",)


def _num_ranks(gpus: Any) -> int:
    if isinstance(gpus, bool) or not isinstance(gpus, int):
        raise PlanningError(f"gpus: expected a positive number of ranks, got {gpus!r} "
                            "(cluster descriptions come with the cost models)")
    if gpus < 1:
        raise PlanningError(f"gpus: need at least one rank, got {gpus}")
    return gpus


def plan(model: torch.nn.Module, graph: Union[Graph, GraphStats], gpus: Any = 4, *, strategy: Optional[str] = None,
         semantics: str = "exact", partitioner: str = "metis", seed: int = 0, dropout: str = "replicated",
         verify: bool = True, **options: Any) -> Plan:
    """Plan parallel training of ``model`` on ``graph`` over ``gpus`` ranks.

    Parameters
    ----------
    model:
        A gnncompile model (``forward(g, x)``); it is traced with :func:`gnncompile.trace`.
    graph:
        The graph to train on.
    gpus:
        Number of ranks (processes; one per GPU when there are GPUs, else CPU processes).
    strategy:
        ``"data"`` (graph parallelism with halo exchange). ``None`` picks ``"data"`` until the cost
        models choose among strategies.
    semantics:
        ``"exact"`` (default: relaxed transformations are refused) or ``"relaxed"``.
    partitioner, seed:
        Vertex partitioner (``"metis"``, ``"random"``, ``"contiguous"``) and its seed.
    dropout:
        ``"replicated"`` (default; ranks draw single-device training's dropout masks, so a run
        matches ``gc.train`` for the same seed) or ``"local"`` (each rank draws its own rows' masks:
        no redundant random draws). See :class:`gnncompile.passes.data.DataOptions`.
    verify:
        Check the plan with :func:`gnncompile.verify_plan` (matching sends and receives, collective
        order, a deadlock dry run) before returning it; a violation raises ``VerificationError``.

    Returns a :class:`Plan`: ``print(plan)`` shows it, ``plan.run(epochs, lr)`` trains with it.
    """
    from .passes.data import DataOptions, lower_data

    n = _num_ranks(gpus)
    strategy = strategy or "data"
    if strategy not in STRATEGIES:
        raise PlanningError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    if strategy not in IMPLEMENTED_STRATEGIES:
        raise PlanningError(f"strategy {strategy!r} has no lowering yet; implemented: "
                            f"{', '.join(IMPLEMENTED_STRATEGIES)}")
    if options:
        raise PlanningError(f"strategy {strategy!r} takes no option(s) {', '.join(sorted(options))}; "
                            "its options are semantics, partitioner, seed, dropout")
    if not isinstance(model, torch.nn.Module):
        raise PlanningError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if isinstance(graph, Graph) and n > max(graph.num_nodes, 1):
        raise PlanningError(f"gpus={n} exceeds the graph's {graph.num_nodes} vertices")
    opts = DataOptions(partitioner=partitioner, seed=seed, semantics=semantics, dropout=dropout)
    was_training = model.training
    try:
        tp = trace(model, graph, training=True)
        tp_eval = trace(model, graph, training=False)
    finally:
        model.train(was_training)
    result = lower_data(tp, tp_eval, model, graph, n, opts)
    if verify:
        verify_plan(result)
    return result
