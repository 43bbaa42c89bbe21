"""``gnncompile.plan``: trace a model, apply a strategy's lowering, return a runnable :class:`Plan`.

:class:`Plan` is the IR's plan data (:class:`gnncompile.ir.plan.Plan`) plus what needs the layers
above it (running, explaining, plotting); :func:`load_plan` reads a saved plan back."""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch

from .errors import ArgumentError, PlanningError, VerificationError
from .paths import output_problem
from .graph.core import Graph, GraphStats
from .cost_models.hardware import Cluster
from .ir.plan import Plan as PlanData
from .ir.plan import human_bytes, plan_differences, read_plan
from .ir.verify_plan import verify_plan
from .passes import registry as _registry
from .passes.strategy import ANY as _ANY
from .passes.search import rank_counts, search

__all__ = ["plan", "Plan", "runnable", "load_plan", "STRATEGIES"]

#: The registered strategies (:mod:`gnncompile.passes.registry`), in search order.
STRATEGIES = tuple(_registry.STRATEGIES)


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
         semantics: str = "exact", devices: str = "all", overlap: bool = False, verify: bool = True,
         features: str = "auto", **options: Any) -> "Plan":
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
        ``None`` (default): the cost models choose among every registered strategy and its options
        (:func:`gnncompile.passes.search.search`); ``plan.explain()`` says why. A strategy name
        (``gnncompile.api.STRATEGIES``) lowers that strategy over all the devices with the given
        options; its options marked *pinned* (partitioner, recompute, decouple) take their defaults
        when not given, the others (chunks, reorder) are still searched.
    semantics:
        ``"exact"`` (default: plans that change the model's results are never returned) or
        ``"relaxed"`` (relaxed transformations allowed, and recorded in ``plan.relaxations``).
        Under ``"exact"`` a model that one strategy cannot run exactly over several ranks (BatchNorm
        under ``data``) gets another strategy, or a ``PlanningError`` saying why none is exact.
    devices:
        ``"all"`` (default): the plan has one program per device of the cluster. ``"any"``: the
        search may also use fewer devices (halvings), which wins where communication costs more
        than the parallelism gains (small graphs).
    overlap:
        Simulate every transfer overlapping independent computation (the bound for a runtime
        with a communication stream). The default ``False`` simulates what ``plan.run`` does:
        blocking collectives, except sends and all-to-alls, which are posted and waited for by
        their first reader (so a chunked ``tensor`` plan's all-to-alls overlap the next chunk).
    features:
        How ranks hold the input features (:mod:`gnncompile.passes.features`): ``"auto"`` (default)
        stores a dense feature matrix that is mostly zeros as CSR when only linear layers read it and
        the cost models predict those layers faster so (exact: the products skip zero terms);
        ``"dense"`` keeps it as given; ``"csr"`` always converts it (a ``PlanningError`` if the model
        reads it otherwise). Recorded in ``plan.options["features"]``; ``plan.explain()`` says why.
    verify:
        Check the plan with :func:`gnncompile.verify_plan` (matching sends and receives, collective
        order, a deadlock dry run) before returning it; a violation raises ``VerificationError``.
    options:
        The strategies' options, as each strategy's options class declares them
        (:class:`gnncompile.passes.data.DataOptions`: ``partitioner``, ``seed``, ``dropout``,
        ``recompute``; :class:`~gnncompile.passes.tensor.TensorOptions`: ``decouple``, ``chunks``;
        :class:`~gnncompile.passes.mop.MopOptions`: ``chunks``, ``sparse_ranks``, ``reorder``;
        :class:`~gnncompile.passes.task.TaskOptions`: ``chunks``, ``p_ranks``, ``dependencies``,
        ``subgraph_chunks``...; ``gnncompile plan --help`` lists them all). An option given is
        fixed; one left out (or ``None``) is searched. A strategy without an option is a candidate
        only while that option is at its neutral value (``chunks=1``: no chunking).

    Returns a :class:`Plan`: ``print(plan)`` shows it, ``plan.explain()`` the choice,
    ``plan.run(epochs, lr)`` trains with it. Raises :class:`PlanningError` when no plan fits the
    devices' memory (saying by how much and what would help).
    """
    cluster = _cluster(gpus)
    named = _registry.get(strategy) if strategy is not None else None
    if semantics not in ("exact", "relaxed"):
        raise PlanningError(f"unknown semantics {semantics!r}; valid: 'exact', 'relaxed'")
    if not isinstance(model, torch.nn.Module):
        raise PlanningError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not any(p.requires_grad for p in model.parameters()):
        raise PlanningError(f"model: {type(model).__name__} has no trainable parameters, so there is nothing to "
                            "train (plans are training plans)")
    if not isinstance(graph, (Graph, GraphStats)):
        raise PlanningError(f"graph: expected a gnncompile Graph or GraphStats, got {type(graph).__name__}")
    if (options.get("batch_size") is None) != (options.get("fanouts") is None):
        given = "batch_size" if options.get("batch_size") is not None else "fanouts"
        raise PlanningError(f"{given} without {'fanouts' if given == 'batch_size' else 'batch_size'}: sampled "
                            "mini-batch training needs both batch_size and fanouts, e.g. batch_size=1024, "
                            "fanouts=[10, 5]")
    fixed = _fixed_options(options, named)
    if devices not in ("all", "any"):
        raise PlanningError(f"devices: expected 'all' or 'any', got {devices!r}")
    for name, flag in (("overlap", overlap), ("verify", verify)):  # ("no" is truthy)
        if not isinstance(flag, bool):
            raise PlanningError(f"{name}: expected True or False, got {flag!r}")
    ranks = rank_counts(cluster) if devices == "any" else [cluster.num_devices]
    if max(ranks) > max(graph.num_nodes, 1) and devices == "all":
        asked = gpus if isinstance(gpus, str) else cluster.num_devices   # (a spec as given: "64xA100")
        raise PlanningError(f"gpus={asked}: the rank count {cluster.num_devices} exceeds the graph's {graph.num_nodes} "
                            "vertices (each rank holds at least one)")
    result = search(model, graph, cluster, semantics=semantics, strategies=None if named is None else [named.name],
                    fixed=fixed, ranks=ranks, overlap=overlap, features=features)
    best = result.best
    chosen = best.plan
    chosen.search = result
    chosen.prediction = best.prediction
    if isinstance(graph, Graph):  # what a checkpoint of a run is compared with (once: not per candidate)
        chosen.info["data_hash"] = graph.data_hash()
    if verify:
        verify_plan(chosen)
    return runnable(chosen)


def _fixed_options(options: dict[str, Any], named: Any) -> dict[str, Any]:
    """The strategy options the caller fixed, checked against the declarations (``None``: searched);
    with a ``named`` strategy, its pinned options not given take their defaults."""
    specs = _registry.option_specs()
    unknown = sorted(set(options) - set(specs))
    if unknown:
        raise PlanningError(f"unknown planning option(s) {', '.join(unknown)}; the options are strategy, semantics, "
                            f"devices, overlap, verify and the strategies' options: {', '.join(sorted(specs))}")
    fixed = {}
    neutral = _registry.neutral_values()
    for name, value in options.items():
        if value is None:
            continue
        owner, spec = specs[name][0]
        if named is not None:
            mine = {s.name: s for s in named.options.specs()}
            if name in mine:
                spec = mine[name]
            elif neutral[name] is _ANY or value != neutral[name]:   # (given for this strategy: not ignored)
                raise PlanningError(f"strategy {named.name!r} has no option {name} (its options: "
                                    f"{', '.join(named.options.names())})")
        value = spec.coerce(value)
        spec.check(value, searched=True)
        fixed[name] = value
    if named is not None:
        for spec in named.options.specs():
            if spec.pinned and spec.name not in fixed:
                fixed[spec.name] = spec.default
    return fixed


def _check_picture(path: Union[str, Path]) -> None:
    """Raise :class:`ArgumentError` unless a picture can be written to ``path`` (a file type
    matplotlib writes, by its suffix: :func:`gnncompile.viz.image_path`)."""
    from .viz.timeline import image_path

    try:
        written = image_path(path)
    except ValueError as exc:
        raise ArgumentError(f"path: {exc}") from None
    problem = output_problem(written)
    if problem is not None:
        raise ArgumentError(f"path: cannot write {str(written)!r}: {problem}")


# --------------------------------------------------------------------------- runnable plans
class Plan(PlanData):
    """What :func:`plan` and :func:`load_plan` return: the plan's data (:class:`gnncompile.ir.plan.Plan`,
    every field, printing, ``save``) plus what needs the layers above the IR: :meth:`run` (the
    runtime), :meth:`explain` (the planner's search), :meth:`timeline` and :meth:`memory_plot`
    (the cost models' prediction, drawn by :mod:`gnncompile.viz`).

    It adds no data: it equals the data-only plan it was made from (:func:`runnable`).
    """

    @classmethod
    def load(cls, path: Union[str, Path], model: Any = None, graph: Any = None) -> "Plan":
        """Deprecated alias of :func:`load_plan`."""
        warnings.warn("gnncompile.Plan.load is deprecated; use gnncompile.load_plan(path, model, graph)",
                      DeprecationWarning, stacklevel=2)
        return load_plan(path, model, graph)

    # ------------------------------------------------------------------ the planner's choice
    def explanation(self) -> str:
        """The text :meth:`explain` prints."""
        from .passes.search import explain_plan

        return explain_plan(self)

    def explain(self) -> None:
        """Print why the planner chose this plan: the top alternatives (strategy, decisions,
        predicted step time, peak memory per rank, bytes, bubbles), the winner's margin, the
        candidates rejected and why, and the chosen plan's per-rank prediction."""
        print(self.explanation())

    # ------------------------------------------------------------------ predictions, drawn
    def _require_prediction(self, what: str) -> Any:
        if self.prediction is None:
            raise PlanningError(f"plan.{what} needs the cost models' prediction, which this plan lacks (loaded "
                                "from a file without its model and graph?); gnncompile.load_plan(path, model, graph) "
                                "plans it again, or set plan.prediction = "
                                "gnncompile.cost_models.model.predict(plan, cluster)")
        return self.prediction

    def timeline(self, path: Union[str, Path], *, measured: Any = None) -> Path:
        """Gantt chart of one step per rank as simulated by the cost models, and below it the measured
        step of ``measured`` (a ``RunResult``; default: the last :meth:`run`, if any)."""
        from .viz.timeline import draw_timelines

        _check_picture(path)
        pred = self._require_prediction("timeline")
        sim = pred.simulation
        panels = [(f"predicted: {sim.step_time * 1e3:.3f} ms per step{pred.cluster.prediction_label} on {self.cluster}",
                   sim.bars(), 0)]
        run = measured if measured is not None else self.last_run
        if run is not None:
            events = [r.timeline for r in run.ranks]
            last = max(e.step for ev in events for e in ev)
            t = [e for ev in events for e in ev if e.step == last]
            span = max(e.end for e in t) - min(e.start for e in t)
            panels.append((f"measured (last step): {span * 1e3:.3f} ms", events, last))
        return draw_timelines(panels, path)

    def memory_plot(self, path: Union[str, Path]) -> Path:
        """Predicted memory per rank over one step, with the device capacity (see the cost models)."""
        from .viz.timeline import draw_memory

        _check_picture(path)
        return draw_memory(path=path, **self.memory_plot_data())

    def memory_plot_data(self) -> dict[str, Any]:
        """What :meth:`memory_plot` draws, as :func:`gnncompile.viz.timeline.memory_figure`'s arguments:
        each rank's predicted memory curve, the step time, the memory a rank may use and its label.

        On a CPU host the ranks share the host's memory, so the capacity is the host's memory divided
        among them, and the label says so (the cluster's description names the whole host's memory).
        """
        pred = self._require_prediction("memory_plot")
        cluster = pred.cluster
        whole, per_rank = cluster.device.memory, pred.capacity
        if per_rank != whole:
            label = (f"memory per rank (this host's {human_bytes(whole)} shared by {cluster.devices_per_node} "
                     f"ranks)")
        else:
            label = f"memory of one {cluster.device.name}"
        return {"curves": [r.memory_curve for r in pred.simulation.ranks], "capacity": per_rank,
                "step_time": pred.simulation.step_time, "capacity_label": label,
                "title": f"predicted memory per rank over one step ({pred.simulation.step_time * 1e3:.3g} ms): "
                         f"{self.strategy} on {self.num_ranks} ranks, {cluster.nodes} node(s) x "
                         f"{cluster.devices_per_node} {cluster.device.name}"}

    # ------------------------------------------------------------------ running
    def run(self, epochs: int = 200, lr: float = 0.01, *, device: Any = None, backend: Union[str, None] = None,
            **kwargs: Any) -> Any:
        """Train with this plan across its ranks; see :func:`gnncompile.runtime.executor.run_plan`.

        ``device``: ``None`` (``$GNNCOMPILE_DEVICE`` if set, else auto: the GPUs when CUDA is
        available, else the CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; ``backend``: ``None``
        (auto: NCCL with a GPU per rank, else gloo, ranks sharing GPUs), ``"gloo"`` or ``"nccl"``.
        The result's ``describe_placement()`` says where the ranks ran and what the plan was planned
        for. Checkpoints and early stopping: ``checkpoint_dir=``, ``checkpoint_every=``,
        ``resume=``, ``patience=`` (passed on to ``run_plan``); ``result.best_state_dict()``."""
        if self.program is None:
            raise PlanningError("this plan holds no program to run: it was planned from graph statistics "
                                "(GraphStats), or loaded from a file without a model; plan with a Graph, or "
                                "rebuild it with gnncompile.load_plan(path, model, graph)")
        from .runtime.executor import run_plan

        self.last_run = run_plan(self, epochs=epochs, lr=lr, device=device, backend=backend, **kwargs)
        return self.last_run


def runnable(plan: PlanData) -> Plan:
    """``plan`` as a :class:`Plan`, with every field value, including those that are not data
    (``program``, ``search``, ``prediction``, ``last_run``).

    A plain :class:`gnncompile.ir.plan.Plan` is converted in place (a :class:`Plan` adds methods,
    no state), so the object keeps its identity: the search's record of the chosen plan
    (``plan.search.ranked[0].plan``) is the returned plan. Another subclass is copied field by field.
    """
    if isinstance(plan, Plan):
        return plan
    if not isinstance(plan, PlanData):
        raise PlanningError(f"runnable: expected a gnncompile.ir.plan.Plan, got {type(plan).__name__}")
    if type(plan) is PlanData:
        plan.__class__ = Plan
        return plan  # type: ignore[return-value]
    return Plan(**{f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)})


def load_plan(path: Union[str, Path], model: Optional[torch.nn.Module] = None,
              graph: Union[Graph, GraphStats, None] = None) -> Plan:
    """Read a plan saved by :meth:`Plan.save`.

    Without ``model`` and ``graph`` the result is data only (print it, verify it; ``run`` refuses).
    With them, the recorded decisions are lowered again for this model and graph
    (:func:`plan` with the saved options), the instruction lists are checked to be the saved ones
    (a :class:`~gnncompile.VerificationError` lists what differs otherwise), and the returned plan
    can run. An unreadable file or only one of ``model`` and ``graph`` raises
    :class:`PlanningError`.
    """
    if (model is None) != (graph is None):
        raise PlanningError("load_plan: pass both model and graph to rebuild a runnable plan (or neither)")
    saved = read_plan(path)
    if model is None:
        return runnable(saved)
    options = dict(saved.options)
    options.setdefault("features", "dense")  # plans saved before the layout was a decision held x as given
    # plan()'s own arguments are not decisions a plan records (a hand-edited file: they were a TypeError,
    # or turned the check of the rebuilt plan off)
    foreign = sorted(set(options) & {"model", "graph", "gpus", "devices", "overlap", "verify"})
    if foreign:
        raise VerificationError(f"plan file {str(path)!r}: its options hold {', '.join(foreign)}, which a plan does "
                                "not record (they are gnncompile.plan's arguments, not decisions); save the plan "
                                "again with Plan.save")
    # the devices it was planned for (plans saved before they were recorded: as many local ranks)
    gpus = Cluster.from_dict(saved.info["cluster"]) if "cluster" in saved.info else saved.num_ranks
    try:
        rebuilt = runnable(plan(model, graph, gpus=gpus, **options))
    except PlanningError as exc:  # the saved decisions do not apply to this model or graph
        raise VerificationError(
            f"plan file {str(path)!r} does not match this model and graph: its decisions ("
            f"{', '.join(f'{k}={v!r}' for k, v in sorted(options.items()) if v is not None)}) cannot be planned for "
            f"them ({exc}); plan the model again or pass the model and graph it was made for") from exc
    diffs = plan_differences(saved, rebuilt)
    if diffs:
        shown = diffs[:8] + ([f"... {len(diffs) - 8} more"] if len(diffs) > 8 else [])
        raise VerificationError(
            f"plan file {str(path)!r} does not match this model and graph (saved = the file, rebuilt = "
            f"planned again for them; plan the model again or pass the model and graph it was made for):\n"
            + "\n".join(f"  {d}" for d in shown))
    return rebuilt
