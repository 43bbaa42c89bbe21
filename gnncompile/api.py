"""``gnncompile.plan``: trace a model, apply a strategy's lowering, return a runnable :class:`Plan`."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from .errors import PlanningError
from .graph.core import Graph, GraphStats
from .cost_models.hardware import Cluster
from .ir.plan import Plan
from .ir.verify_plan import verify_plan

__all__ = ["plan", "STRATEGIES"]

#: The strategies of DESIGN.md; those with a lowering are registered in
#: :data:`gnncompile.passes.search.LOWERINGS`.
STRATEGIES = ("data", "task", "layer", "tensor", "mop", "split")


def _cluster(gpus: Any) -> Cluster:
    """The cluster ``gpus`` describes: a :class:`Cluster`, a description for :meth:`Cluster.parse`
    (``"4xA100"``, ``"2x4xA5000-ib200"``), or a number of local ranks (GPUs of this machine's kind when
    CUDA is available, else CPU processes costed with the calibrated CPU profile, if one was saved)."""
    if isinstance(gpus, Cluster):
        return gpus
    if isinstance(gpus, str):
        return Cluster.parse(gpus)
    if isinstance(gpus, bool) or not isinstance(gpus, int):
        raise PlanningError(f"gpus: expected a number of ranks, a cluster description such as '2x4xA100-ib200', "
                            f"or a Cluster; got {gpus!r}")
    if gpus < 1:
        raise PlanningError(f"gpus: need at least one rank, got {gpus}")
    return Cluster.local(gpus)


def plan(model: torch.nn.Module, graph: Union[Graph, GraphStats], gpus: Any = 4, *, strategy: Optional[str] = None,
         semantics: str = "exact", partitioner: Optional[str] = None, seed: int = 0, dropout: str = "replicated",
         recompute: Optional[bool] = None, decouple: Optional[bool] = None, chunks: Optional[int] = None,
         sparse_ranks: Optional[int] = None, reorder: Optional[str] = None, p_ranks: Optional[int] = None,
         dependencies: Optional[str] = None, subgraph_chunks: Optional[int] = None, devices: str = "all",
         overlap: bool = False, verify: bool = True, **options: Any) -> Plan:
    """Plan parallel training of ``model`` on ``graph`` over the devices ``gpus`` describes.

    Parameters
    ----------
    model:
        A gnncompile model (``forward(g, x)``); it is traced with :func:`gnncompile.trace`.
    graph:
        The graph to train on, or only its :class:`GraphStats`: the plan is then built from
        estimates (replication factor, per-rank sizes) and can be printed, explained and simulated,
        not run.
    gpus:
        A number of local ranks, a cluster description (``"4xA5000"``, ``"8x8xA100-ib200"``, see
        :meth:`Cluster.parse`) or a :class:`Cluster`.
    strategy:
        ``None`` (default): the cost models choose among every registered strategy, its options
        (:func:`gnncompile.passes.search.search`);
        ``plan.explain()`` says why. A strategy name (``"data"``) lowers that strategy over all
        the devices, with the given options (partitioner defaults to METIS, no recomputation).
    semantics:
        ``"exact"`` (default: plans that change the model's results are never returned) or
        ``"relaxed"`` (relaxed transformations allowed, and recorded in ``plan.relaxations``).
        Under ``"exact"`` a model that one strategy cannot run exactly over several ranks (BatchNorm
        under ``data``) gets another strategy, or a ``PlanningError`` saying why none is exact.
    partitioner, seed, dropout, recompute:
        Options of the ``data`` strategy (:class:`gnncompile.passes.data.DataOptions`; ``tensor``
        and ``task`` take all but the partitioner); an option given here is fixed, one left ``None``
        is searched.
    decouple:
        ``tensor`` and ``task``: lower the decoupled model (all T ops, then all propagations;
        NeutronTP §4.1, NeutronTask §5.1). It changes non-linear models, so it needs ``semantics="relaxed"`` for them; ``None``
        lets the search try it where relaxations are allowed.
    chunks, sparse_ranks, reorder:
        ``mop`` only (:class:`gnncompile.passes.mop.MopOptions`): vertex chunks pipelined between
        the sparse (aggregation) and dense (update) groups, the size of the sparse group (default
        half the ranks), and ``"rcm"`` to renumber vertices by reverse Cuthill–McKee first. ``None``
        lets the search choose (1 chunk, or 8 RCM-ordered chunks). ``chunks`` also sets the
        ``task`` strategy's chunk count (default: a multiple of its group sizes, at least 4).
    p_ranks:
        ``task`` only (:class:`gnncompile.passes.task.TaskOptions`): ranks for the P tasks
        (NeutronTask Eq. 7's ``N_p``); ``None``: from the cost model.
    dependencies:
        ``task`` only: ``"exact"`` (default), or relaxed (NeutronTask's vertex dependency
        management; needs ``semantics="relaxed"``): ``"regrouped"`` (Algorithm 1: every epoch the
        chunks are shuffled into ``chunks`` subgraphs of ``subgraph_chunks`` chunks each, default
        2, and a subgraph's propagation skips the in-edges from later subgraphs;
        :mod:`gnncompile.graph.regroup`), ``"skip-later"`` (the same skipping in one fixed chunk
        order) or ``"cached"`` (a chunk's propagation reads later chunks from the previous step's
        copy).
    devices:
        ``"all"`` (default): the plan has one program per device of the cluster. ``"any"``: the
        search may also use fewer devices (halvings), which wins where communication costs more
        than the parallelism gains (small graphs).
    overlap:
        Simulate every transfer overlapping independent computation (the bound for a runtime
        with a communication stream). The default ``False`` simulates what ``plan.run`` does:
        blocking collectives, except sends and all-to-alls, which are posted and waited for by
        their first reader (so a chunked ``tensor`` plan's all-to-alls overlap the next chunk).
    verify:
        Check the plan with :func:`gnncompile.verify_plan` (matching sends and receives, collective
        order, a deadlock dry run) before returning it; a violation raises ``VerificationError``.

    Returns a :class:`Plan`: ``print(plan)`` shows it, ``plan.explain()`` the choice,
    ``plan.run(epochs, lr)`` trains with it. Raises :class:`PlanningError` when no plan fits the
    devices' memory (saying by how much and what would help).
    """
    from .passes.search import LOWERINGS, rank_counts, search

    cluster = _cluster(gpus)
    if strategy is not None and strategy not in STRATEGIES:
        raise PlanningError(f"unknown strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
    if strategy is not None and strategy not in LOWERINGS:
        raise PlanningError(f"strategy {strategy!r} has no lowering yet; implemented: {', '.join(LOWERINGS)}")
    if options:
        raise PlanningError(f"unknown planning option(s) {', '.join(sorted(options))}; the options are strategy, "
                            "semantics, partitioner, seed, dropout, recompute, decouple, chunks, sparse_ranks, "
                            "reorder, p_ranks, dependencies, subgraph_chunks, devices, overlap, verify")
    if semantics not in ("exact", "relaxed"):
        raise PlanningError(f"unknown semantics {semantics!r}; valid: 'exact', 'relaxed'")
    if not isinstance(model, torch.nn.Module):
        raise PlanningError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(graph, (Graph, GraphStats)):
        raise PlanningError(f"graph: expected a gnncompile Graph or GraphStats, got {type(graph).__name__}")
    from .graph.partition import PARTITIONERS
    from .passes.data import DROPOUT_MODES

    if partitioner is not None and partitioner not in PARTITIONERS:
        raise PlanningError(f"unknown partitioner {partitioner!r}; valid: {', '.join(PARTITIONERS)}")
    if dropout not in DROPOUT_MODES:
        raise PlanningError(f"unknown dropout mode {dropout!r}; valid: {', '.join(DROPOUT_MODES)}")
    for name, value in (("recompute", recompute), ("decouple", decouple)):
        if value is not None and not isinstance(value, bool):
            raise PlanningError(f"{name}: expected True, False or None (searched), got {value!r}")
    fixed: dict[str, Any] = {"seed": seed, "dropout": dropout}
    if partitioner is not None:
        fixed["partitioner"] = partitioner
    if recompute is not None:
        fixed["recompute"] = recompute
    if decouple is not None:
        fixed["decouple"] = decouple
    for name, value in (("chunks", chunks), ("sparse_ranks", sparse_ranks), ("p_ranks", p_ranks),
                        ("subgraph_chunks", subgraph_chunks)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise PlanningError(f"{name}: expected a positive integer or None (searched), got {value!r}")
        if value is not None:
            fixed[name] = value
    if dependencies is not None:
        from .passes.task import DEPENDENCIES

        if dependencies not in DEPENDENCIES:
            raise PlanningError(f"unknown dependencies {dependencies!r}; valid: {', '.join(DEPENDENCIES)}")
        fixed["dependencies"] = dependencies
    if reorder is not None:
        from .passes.mop import REORDERINGS

        if reorder not in REORDERINGS:
            raise PlanningError(f"unknown reorder {reorder!r}; valid: {', '.join(REORDERINGS)}")
        fixed["reorder"] = reorder
    if devices not in ("all", "any"):
        raise PlanningError(f"devices: expected 'all' or 'any', got {devices!r}")
    ranks = rank_counts(cluster) if devices == "any" else [cluster.num_devices]
    if max(ranks) > max(graph.num_nodes, 1) and devices == "all":
        raise PlanningError(f"gpus={cluster.num_devices} exceeds the graph's {graph.num_nodes} vertices")
    if strategy is not None:
        fixed.setdefault("partitioner", "metis")
        fixed.setdefault("recompute", False)
        fixed.setdefault("decouple", False)
    result = search(model, graph, cluster, semantics=semantics, strategies=None if strategy is None else [strategy],
                    fixed=fixed, ranks=ranks, overlap=overlap)
    best = result.best
    chosen = best.plan
    chosen.search = result
    chosen.prediction = best.prediction
    if verify:
        verify_plan(chosen)
    return chosen
