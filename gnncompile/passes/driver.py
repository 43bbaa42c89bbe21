"""The one lowering driver: everything a plan needs that is not particular to a strategy.

:func:`lower` takes a registered :class:`~gnncompile.passes.strategy.Strategy`, the traced
training and evaluation graphs, and the strategy's options, and

1. checks the model against the strategy's semantics (row-mixing ops: refused under ``"exact"``,
   recorded as a relaxation otherwise);
2. runs the graph passes the options ask for through the :class:`~gnncompile.passes.infra.PassManager`
   (IR verified around each; ``instruments`` observe them): ``decouple`` (or ``decouple_exact``),
   ``replicate_dropout_masks`` (concrete graphs, ``dropout="replicated"``) and
   ``insert_recomputation``;
3. calls the strategy's lowering with a :class:`Job` (the prepared graphs and the facts every
   strategy reads: statistics, parameters, mask counts) and gets a :class:`Lowered`: stages,
   per-rank compute and communication instructions (list-scheduled, communication inserted:
   :mod:`gnncompile.passes.schedule`), sizes, step inputs, gradient groups;
4. runs the plan-to-plan passes: the gradient all-reduce of every group and the optimizer step,
   then FREE (:func:`~gnncompile.passes.free.insert_frees`) where the strategy keeps values across
   ranks or chunks;
5. builds the :class:`~gnncompile.ir.plan.Plan`, predicts every rank's bytes with the verifier's
   accounting, and (for a concrete graph) the runnable :class:`~gnncompile.ir.plan.RankProgram`
   of every rank, with where each parameter lives (:class:`~gnncompile.ir.plan.ParamPlacement`:
   the lowest rank whose stages use it) and, when a rank runs only some of the model's replicated
   dropouts, the masks every rank draws first (:func:`~gnncompile.passes.dropout.dropout_draws`).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Union

import torch

from ..errors import PassError, PlanningError
from ..frontend.ops import (BACKWARD_PRODUCTS, aggregate, call_arguments, edge_attention, edge_softmax, gather_dst,
                            is_primitive, propagate, propagation_calls)
from ..graph.core import Graph, GraphStats
from ..ir.plan import AllReduce, DevicePlan, Instruction, OptimizerStep, ParamPlacement, Plan, RankProgram, RankSizes, \
    Schedule, StageSpec, StepInputs
from ..ir.tpgraph import TPGraph
from ..ir.verify_plan import plan_bytes
from .decouple import decouple, decouple_exact, plan_decoupling
from .dropout import drawing_ops, dropout_draws, dropout_inputs, replicate_dropout_masks, unreplicated_draws
from .free import insert_frees
from .infra import GraphPass, PassInstrument, PassManager
from .lower import StagedModel, row_mixing_ops
from .recompute import insert_recomputation
from .strategy import Strategy, StrategyOptions

__all__ = ["Job", "RankLowering", "Lowered", "lower", "mask_counts", "with_backward"]


def mask_counts(graph: Graph) -> dict[str, int]:
    """The global number of vertices in each of ``graph``'s train/val/test masks (0 when absent):
    the loss divides each rank's sum by these; and ``labels``, its number of label rows (0 without
    labels: the runtime refuses to train then)."""
    counts = {m: int(getattr(graph, f"{m}_mask").sum()) if getattr(graph, f"{m}_mask") is not None else 0
              for m in ("train", "val", "test")}
    counts["labels"] = 0 if graph.y is None else int(graph.y.shape[0])
    return counts


@dataclass
class Job:
    """What a strategy's lowering reads: the prepared graphs and the facts every strategy needs.

    ``tp``/``tp_eval``: the training and evaluation graphs after the driver's graph passes;
    ``tp_unrecomputed``: ``tp`` before recomputation (segment bodies carry no per-op annotations);
    ``relaxations``: what the plan records (a strategy appends its own); ``dropout_inputs``: the
    replicated dropout masks' index inputs and their row spaces; ``device``: the device the cost
    models plan for (``None``: the strategy's default).
    """

    strategy: str
    tp: TPGraph
    tp_eval: TPGraph
    model: torch.nn.Module
    graph: Union[Graph, GraphStats]
    num_ranks: int
    device: Any = None
    tp_unrecomputed: Optional[TPGraph] = None
    relaxations: list[str] = field(default_factory=list)
    dropout_inputs: dict[str, str] = field(default_factory=dict)
    #: :func:`traced_hash` of the traces as the driver received them (the plan's ``info``)
    model_hash: str = ""

    @property
    def concrete(self) -> bool:
        """Whether the graph itself is known (the plan can run), not only its statistics."""
        return isinstance(self.graph, Graph)

    @functools.cached_property
    def stats(self) -> GraphStats:
        return self.graph.stats() if isinstance(self.graph, Graph) else self.graph

    @functools.cached_property
    def param_names(self) -> list[str]:
        return [n for n, _ in self.model.named_parameters()]

    @functools.cached_property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.model.named_parameters()]

    @property
    def numel(self) -> int:
        """Trainable parameter elements."""
        return sum(p.numel() for p in self.params if p.requires_grad)

    @property
    def param_dtype(self) -> str:
        return str(self.params[0].dtype).replace("torch.", "") if self.params else "float32"

    @property
    def inputs(self) -> list[str]:
        """The plan's model inputs: the graph, the features, the dropout indices."""
        return ["g", "x", *self.dropout_inputs]

    def stage_parameters(self, staged: StagedModel) -> dict[int, set[str]]:
        """The names of the parameters each stage of ``staged`` uses (stage modules share the model's)."""
        ident = {id(p): n for n, p in zip(self.param_names, self.params)}
        return {s: {ident[id(p)] for p in mod.parameters() if id(p) in ident} for s, mod in staged.modules.items()}

    def scored_rows(self, rows: Union[torch.Tensor, list[torch.Tensor]]) -> dict[str, Any]:
        """The :class:`~gnncompile.ir.plan.StepInputs` fields of a rank scoring the vertices ``rows``
        (global ids; a list: chunk by chunk): ``owned`` (in that order), their labels and masks, and
        for chunks where each chunk's rows start (``chunk_offsets``)."""
        graph = self.graph
        out: dict[str, Any] = {}
        if isinstance(rows, list):
            offsets = [0]
            for ids in rows:
                offsets.append(offsets[-1] + int(ids.numel()))
            out["chunk_offsets"] = tuple(offsets)
            rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        owned = rows
        return dict(out, owned=owned,
                    labels=graph.y[owned] if graph.y is not None else None,
                    masks={m: getattr(graph, f"{m}_mask")[owned] if getattr(graph, f"{m}_mask") is not None else None
                           for m in ("train", "val", "test")})

    def refuse_sparse_features(self, staged: StagedModel, kinds: Optional[Iterable[str]] = None,
                               what: str = "a propagation") -> None:
        """Raise :class:`PlanningError` when a conversion (of ``kinds``; ``None``: any) moves sparse
        input features (the strategies' collectives move dense rows)."""
        x = self.graph.x if isinstance(self.graph, Graph) else None
        if x is None or x.layout == torch.strided:
            return
        if any(c.value == "x" and (kinds is None or c.kind in tuple(kinds)) for c in staged.conversions):
            raise PlanningError(f"strategy {self.strategy!r}: {what} reads the sparse input features directly; "
                                "densify them (graph.dense_features()) or use strategy='data'")


@dataclass
class RankLowering:
    """One rank's part of a lowered step, before the driver's plan passes.

    ``instructions``: compute and communication of the training step (the driver appends the
    gradient reduction and the optimizer step); ``eval_instructions``: the forward-only program;
    ``step``: the rank's step inputs (:class:`~gnncompile.ir.plan.StepInputs` fields: graph,
    features, labels, masks, chunk inputs...), for a concrete graph.
    """

    rank: int
    stages: tuple[StageSpec, ...]
    instructions: list[Instruction]
    sizes: RankSizes
    eval_stages: tuple[StageSpec, ...] = ()
    eval_instructions: tuple[Instruction, ...] = ()
    step: dict[str, Any] = field(default_factory=dict)
    #: other :class:`~gnncompile.ir.plan.RankProgram` fields of this rank
    program: dict[str, Any] = field(default_factory=dict)


@dataclass
class Lowered:
    """A strategy's lowering of one step (what :func:`lower` completes into a plan).

    ``grad_groups``: ``(ranks, trainable elements)`` of every group that sums its parameter
    gradients with one all-reduce (ranks in no group only step their optimizer); ``frees``: insert
    FREE instructions; ``info``/``options``: plan data the strategy adds or overrides;
    ``program``: :class:`~gnncompile.ir.plan.RankProgram` fields shared by every rank;
    ``draw_rounds``: how many times the single-device reference runs the step's replicated
    dropouts, rank ``r`` taking round ``r`` (mini-batch data: one round per rank's micro-batch).
    """

    staged: StagedModel
    staged_eval: StagedModel
    ranks: list[RankLowering]
    grad_groups: list[tuple[tuple[int, ...], int]]
    schedule: Schedule
    info: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    frees: bool = False
    program: dict[str, Any] = field(default_factory=dict)
    draw_rounds: int = 1


def _decoupling_pass(job: Job, strategy: Strategy, semantics: str) -> GraphPass:
    """The decoupling pass for ``semantics`` (``decouple_exact`` refuses a model it would change),
    recording the relaxation where it changes the model."""
    plan = plan_decoupling(job.tp)
    if plan.exact:
        return decouple_exact
    if semantics == "exact":
        raise PlanningError("decoupling changes this model (" + "; ".join(plan.reasons) + "); pass "
                            "semantics='relaxed' to train the decoupled model")
    job.relaxations.append(f"decoupled propagation ({strategy.decouple_source}): the model becomes MLP then "
                           f"{len(plan.propagations)} propagations")
    return decouple.bind(semantics="relaxed")


def _run(passes: list[GraphPass], tp: TPGraph, semantics: str, instruments: Iterable[PassInstrument]) -> TPGraph:
    """``passes`` over ``tp`` through the pass manager; a failing pass is a :class:`PlanningError`
    with the pass's own message."""
    if not passes:
        return tp
    try:
        return PassManager(passes, semantics=semantics, instruments=instruments)(tp)
    except PassError as e:
        cause = e.__cause__
        err = PlanningError(str(cause) if isinstance(cause, PlanningError) else str(e))
        err.inexact = getattr(cause, "inexact", None)
        raise err from None


def row_mixing_relaxations(tp: TPGraph, strategy: str, semantics: str, each: str = "rank",
                           unit: str = "rank", tp_eval: Optional[TPGraph] = None) -> list[str]:
    """The relaxation a strategy records for row-mixing T ops of the training trace ``tp`` and the
    evaluation trace ``tp_eval`` (``[]`` when there are none).

    Under ``semantics="exact"`` raises :class:`PlanningError` naming the ops: each ``each`` (a
    rank, a chunk...) would normalize with its own rows' statistics (``per-{unit} statistics``).
    """
    mixing = row_mixing_ops(tp)
    if tp_eval is not None:
        mixing += [(f"{op} (evaluation)", why) for op, why in row_mixing_ops(tp_eval, training=False)
                   if (op, why) not in mixing]
    if not mixing:
        return []
    what = "; ".join(f"{op}: {why}" for op, why in mixing)
    return _refuse_or_record(strategy, semantics, f"{what}. Each {each} would use its own rows only; pass "
                             f"semantics='relaxed' to accept per-{unit} statistics",
                             f"per-{unit} statistics ({', '.join(op for op, _ in mixing)})",
                             inexact=f"{what}. Each rank or chunk would use its own rows only; pass "
                                     "semantics='relaxed' to accept its own statistics")


def _refuse_or_record(strategy: str, semantics: str, why: str, relaxation: str,
                      inexact: Optional[str] = None) -> list[str]:
    """``[relaxation]``, what a relaxed plan records; under ``semantics="exact"`` a
    :class:`PlanningError` saying why ``strategy`` is not exact for the model, whose ``inexact``
    attribute says it without naming the strategy (``inexact``, by default ``why``), so that a
    search can say once what every strategy refused."""
    if semantics == "exact":
        err = PlanningError(f"strategy {strategy!r} is not exact for this model: {why}")
        err.inexact = inexact or why
        raise err
    return [relaxation]


def _unreplicated_draws(tp: TPGraph, strategy: str, semantics: str) -> list[str]:
    """The relaxation recorded for random ops whose draws ``dropout="replicated"`` does not
    replicate (``[]`` when there are none); under ``semantics="exact"`` a :class:`PlanningError`
    naming them."""
    ops = unreplicated_draws(tp)
    if not ops:
        return []
    return _refuse_or_record(strategy, semantics,
                             f"{', '.join(ops)} draw(s) random numbers that dropout='replicated' does not replicate "
                             "(it replicates F.dropout and nn.Dropout masks), so ranks seeded alike would draw the "
                             "same numbers for different rows; use F.dropout, or pass dropout='local' (each rank its "
                             "own stream) or semantics='relaxed'",
                             f"unreplicated random draws ({', '.join(ops)}): ranks seeded alike draw the same numbers")


def _evaluation_draws(tp_eval: TPGraph, strategy: str, semantics: str) -> list[str]:
    """The relaxation recorded for random draws in the evaluation trace (``[]`` when there are
    none): ranks evaluate with their own streams, unlike single-device evaluation, whose draws also
    move the next training steps' masks. Under ``semantics="exact"`` a :class:`PlanningError`."""
    ops = drawing_ops(tp_eval)
    if not ops:
        return []
    dropout = any("dropout" in op for op in ops)
    return _refuse_or_record(strategy, semantics,
                             f"{', '.join(ops)} draw(s) random numbers in eval mode too"
                             + (" (F.dropout(x, p) drops out unless given training=self.training)" if dropout else "")
                             + ", and the ranks would evaluate with their own random streams; "
                             + ("use training=self.training (nn.Dropout does), or " if dropout else "")
                             + "pass dropout='local' (each rank its own stream) or semantics='relaxed'",
                             f"random draws in evaluation ({', '.join(ops)}): each rank draws its own")


def traced_hash(tp: TPGraph, tp_eval: TPGraph) -> str:
    """A short SHA-256 of what the model computes as traced, before any pass: both modes' code
    (constants such as ``F.dropout``'s ``p`` included) and every submodule's class and
    ``extra_repr`` (``nn.Dropout(p=0.5)``); for checkpoints, whose resume it must match."""
    h = hashlib.sha256()
    for g in (tp, tp_eval):
        h.update(g.code.encode())
        for name, m in g.named_modules():
            h.update(f"\n{name}:{type(m).__name__}({m.extra_repr()})".encode())
    return h.hexdigest()[:16]


def lower(strategy: Strategy, tp: TPGraph, tp_eval: TPGraph, model: torch.nn.Module,
          graph: Union[Graph, GraphStats], num_ranks: int, options: StrategyOptions, *, device: Any = None,
          instruments: Iterable[PassInstrument] = ()) -> Plan:
    """Lower ``tp`` (training-mode trace) and ``tp_eval`` with ``strategy`` over ``num_ranks`` ranks.

    With a :class:`Graph` the plan can run (``plan.program``); with :class:`GraphStats` alone it is
    built from estimates and can be printed, verified and simulated. Raises
    :class:`PlanningError` when the strategy cannot lower the model with these options.
    """
    if not isinstance(options, strategy.options):
        raise PlanningError(f"strategy {strategy.name!r} takes {strategy.options.__name__}, got "
                            f"{type(options).__name__}")
    job = Job(strategy.name, tp, tp_eval, model, graph, num_ranks, device)
    job.model_hash = traced_hash(tp, tp_eval)
    semantics = options.semantics
    if num_ranks > 1 or strategy.row_mixing_single:
        each, unit = strategy.row_mixing
        job.relaxations += row_mixing_relaxations(tp, strategy.name, semantics, each, unit, tp_eval)
    if getattr(options, "decouple", False):
        step = _decoupling_pass(job, strategy, semantics)
        try:
            job.tp = _run([step.bind(share_parameters=True)], job.tp, "relaxed", instruments)
            job.tp_eval = _run([step.bind(share_parameters=True)], job.tp_eval, "relaxed", instruments)
        except PlanningError as e:
            raise PlanningError(f"strategy {strategy.name!r} cannot decouple this model: {e}") from None
    if strategy.check is not None:
        strategy.check(job, options)
    # sampled mini-batch plans: the masks of the mini-batch's tensors
    sampled = getattr(options, "batch_size", None) is not None
    if options.dropout == "replicated":  # statistics too: a plan predicts what runs
        allowed = strategy.dropout_spaces(options)
        job.tp = _run([replicate_dropout_masks.bind(graph=graph, strategy=strategy.name, allowed=allowed,
                                                    sampled=sampled, share_parameters=True)],
                      job.tp, semantics, instruments)
        job.dropout_inputs = dropout_inputs(job.tp)
        if num_ranks > 1 or strategy.row_mixing_single:
            job.relaxations += _unreplicated_draws(job.tp, strategy.name, semantics)
            job.relaxations += _evaluation_draws(job.tp_eval, strategy.name, semantics)
    job.tp_unrecomputed = job.tp
    if getattr(options, "recompute", False):
        job.tp = _run([insert_recomputation.bind(share_parameters=True)], job.tp, semantics, instruments)

    out: Lowered = strategy.lower(job, options)
    return _complete(job, strategy, options, out)


def _topology_info(job: Job, ranks: list[RankLowering], backward: str) -> dict[str, Any]:
    """What the cost model needs to size a rank's topology in the runtime's compact layout
    (:func:`~gnncompile.graph.core.topology_bytes`): whether the graph is symmetric (its whole
    structure then serves backward products too) and weighted, whether the model computes edge
    values (attention: an edge permutation and each edge's destination are held), which degree
    normalizations it uses (per-vertex scales), and for a concrete graph the graphs each rank
    holds (``graphs[rank]``: ``[destinations, sources, edges, symmetric]`` per graph), and how
    backward products are computed (``backward``: a ``"push"`` rank holds no transposes)."""
    stats = job.stats
    if job.concrete:
        symmetric, weighted = job.graph.is_symmetric(), job.graph.edge_weight is not None
    else:
        symmetric, weighted = bool(stats.symmetric), bool(stats.weighted)
    calls = list(propagation_calls(*(tp.graph for tp in (job.tp, job.tp_eval))))
    norms = {(a["norm"], bool(a["add_self_loops"])) for _, a in calls
             if a["edge_weight"] is None and a["norm"] in ("gcn", "mean")}
    # propagations over A + L with fixed terms (the graph's own normalization and loops): off the CPU
    # their loops join the matrix (kernels._looped_csr); every other product reads the plain structure
    joined = [n.target is propagate and a["edge_weight"] is None and bool(a["add_self_loops"]) for n, a in calls]
    folded = {a["norm"] for (_, a), j in zip(calls, joined) if j}
    plain = not all(joined)
    edge_nodes = [n for n in job.tp.ops(("E",)) if n.op == "call_function" and is_primitive(n.target)]
    edge_values = bool(edge_nodes) or any(a["edge_weight"] is not None for _, a in calls)
    # head counts of multi-head products (edge values [E, H]): off the CPU each runs as one product
    # over a head-interleaved copy of its structure (kernels._interleaved), one per head count
    edge_heads = sorted({w.meta["tp"].dims[0] for _, a in calls
                         for w in [a["edge_weight"]] if isinstance(w, torch.fx.Node) and "tp" in w.meta
                         and len(w.meta["tp"].dims) == 1 and w.meta["tp"].dims[0] > 1})
    # the loop-augmented structure: what an aggregation over A + I reads (edge_softmax needs none)
    edge_loops = any(n.target is aggregate and call_arguments(n).get("add_self_loops") for n in edge_nodes)
    # each edge's destination: what gather_dst and the edge reductions index by (prepare_graph); for
    # edge_attention only off the CPU (its native kernels walk the CSR rows); else as edge values say
    targets = {n.target for n in edge_nodes}
    edge_dst: Optional[str] = ("always" if targets & {gather_dst, edge_softmax, aggregate}
                               else "off_cpu" if edge_attention in targets else None)
    info = {"nodes": stats.num_nodes, "symmetric": symmetric, "weighted": weighted, "edge_values": edge_values,
            "edge_dst": edge_dst, "edge_loops": edge_loops, "norms": [[nm, loops] for nm, loops in sorted(norms)],
            "looped_norms": sorted(folded), "plain_products": plain, "backward": backward,
            "edge_heads": edge_heads}
    if job.concrete:
        held = []
        for rl in sorted(ranks, key=lambda rl: rl.rank):
            stores = [rl.step.get("inputs", {}), *rl.step.get("chunk_inputs", {}).values()]
            graphs = {id(v): v for store in stores for v in store.values() if isinstance(v, Graph)}
            held.append([[g.num_nodes, g.num_src, g.num_edges, g.num_src == g.num_nodes and g.is_symmetric()]
                         for g in graphs.values()])
        info["graphs"] = held
    return info


def _complete(job: Job, strategy: Strategy, options: StrategyOptions, out: Lowered) -> Plan:
    """The plan passes after a strategy's lowering: gradient reduction, optimizer step, FREE;
    then the plan, its predicted bytes and the rank programs."""
    staged, staged_eval = out.staged, out.staged_eval
    group_of = {r: g for g in out.grad_groups for r in g[0]}
    ranks = []
    for rl in sorted(out.ranks, key=lambda rl: rl.rank):
        instrs = list(rl.instructions)
        members, numel = group_of.get(rl.rank, ((), 0))
        if len(members) > 1 and numel:
            instrs.append(AllReduce("grads", members, numel=numel, dtype=job.param_dtype))
        instrs.append(OptimizerStep())
        ranks.append(DevicePlan(rank=rl.rank, stages=rl.stages, instructions=tuple(instrs), sizes=rl.sizes,
                                modules=staged.modules))
    if out.frees:
        # release each stored value after its last use (and its sends' completion): without it every
        # value that crosses ranks or chunks stays for the whole step
        ranks = insert_frees(ranks, keep={*job.inputs, staged.output})
    stats = job.stats
    info = {
        "graph": str(stats), "model": type(job.model).__name__, "model_hash": job.model_hash,
        "output": staged.output, "inputs": job.inputs,
        "params": job.numel, "param_tensors": sum(1 for p in job.params if p.requires_grad),
        "param_dtype": job.param_dtype, "features": stats.num_features, "classes": stats.num_classes,
        "halo_rows": [0] * job.num_ranks, "topology": _topology_info(job, out.ranks, options.backward), **out.info,
    }
    x = job.graph.x if job.concrete else None
    if x is not None and x.layout == torch.sparse_csr and x.shape[0]:
        # sparse features stay sparse on every path: a row costs its stored entries and pointer
        stored = x.values().numel() * (x.values().element_size() + x.col_indices().element_size()) \
            + x.crow_indices().numel() * x.crow_indices().element_size()
        info["feature_bytes_per_row"] = stored / x.shape[0]
    plan = Plan(strategy=strategy.name, semantics="relaxed" if job.relaxations else "exact",
                options={**options.to_dict(), **out.options}, cluster=f"{job.num_ranks} local ranks", ranks=ranks,
                schedule=out.schedule, relaxations=tuple(job.relaxations), info=info)
    # the plan's bytes; gc.plan checks the chosen plan fully, and the planner's simulation replays each
    sent, received = plan_bytes(plan)
    plan.predictions = {"bytes_sent": [int(round(b)) for b in sent], "bytes_received": [int(round(b)) for b in received]}
    dropout_mode = plan.options.get("dropout", options.dropout)
    if job.concrete:
        counts = mask_counts(job.graph)
        by_rank = {rl.rank: rl for rl in out.ranks}
        used = _params_used(job, staged, ranks)
        owner: dict[str, int] = {}
        for dp in ranks:
            for name in used[dp.rank]:
                owner.setdefault(name, dp.rank)
        main = owner.get(job.param_names[0], 0) if job.param_names else 0
        every = set().union(*used.values())
        draws = ()
        if dropout_mode == "replicated":
            infos = {n.name: n.meta["tp"] for n in job.tp_unrecomputed.graph.nodes if "tp" in n.meta}
            draws = dropout_draws(staged, job.dropout_inputs, infos)
        plan.program = [RankProgram(
            rank=dp.rank, world_size=job.num_ranks, modules=staged.modules, stages=dp.stages,
            instructions=dp.instructions, eval_modules=staged_eval.modules, eval_stages=by_rank[dp.rank].eval_stages,
            eval_instructions=tuple(by_rank[dp.rank].eval_instructions), output=staged.output,
            eval_output=staged_eval.output, same_seed=dropout_mode == "replicated", backward=options.backward,
            counts=counts,
            params=job.params, param_names=job.param_names, step=StepInputs(**by_rank[dp.rank].step),
            placement=ParamPlacement(owner, main, None if used[dp.rank] == every else
                                     tuple(n for n in job.param_names if n in used[dp.rank])),
            dropout_draws=_rank_draws(draws, out.draw_rounds, dp.rank, ranks),
            **out.program, **by_rank[dp.rank].program)
            for dp in ranks]
    return plan


def with_backward(plan: Plan, mode: str) -> Plan:
    """``plan`` with its propagations' backward products computed by ``mode`` (``"transposed"`` or
    ``"push"``, :data:`~gnncompile.frontend.ops.BACKWARD_PRODUCTS`): the same instructions (the
    choice changes how a kernel reads the graph, not what any instruction computes), the options,
    the topology the cost model sizes and the rank programs updated. A new plan; ``plan`` is unchanged."""
    if mode not in BACKWARD_PRODUCTS:
        raise PlanningError(f"unknown backward product {mode!r}; valid: {', '.join(map(repr, BACKWARD_PRODUCTS))}")
    out = copy.copy(plan)
    out.options = {**plan.options, "backward": mode}
    out.info = {**plan.info, "topology": {**plan.info.get("topology", {}), "backward": mode}}
    out.prediction = None
    if plan.program is not None:
        out.program = [dataclasses.replace(p, backward=mode) for p in plan.program]
    return out


def _params_used(job: Job, staged: StagedModel, ranks: list[DevicePlan]) -> dict[int, set[str]]:
    """The names of the parameters each rank's stages use."""
    by_stage = job.stage_parameters(staged)
    return {dp.rank: set().union(*(by_stage.get(st.index, set()) for st in dp.stages)) for dp in ranks}


def _rank_draws(draws: tuple, rounds: int, rank: int, ranks: list[DevicePlan]) -> tuple:
    """``RankProgram.dropout_draws`` of ``rank``: none where every rank runs all of the step's
    dropouts in single-device order (each draws its masks as it goes), else every mask of the step
    in that order (:func:`_runs_some_dropouts`; or the stages run them in another order: a later
    dropout in an earlier stage); with ``rounds`` > 1 (``Lowered.draw_rounds``) the
    step's masks ``rounds`` times, the rank keeping round ``rank`` only (stage ``-1``: drawn, not kept)."""
    if rounds > 1 and draws:
        return tuple((d[0] if q == rank else -1,) + tuple(d[1:]) for q in range(rounds) for d in draws)
    reordered = any(a[0] > b[0] for a, b in zip(draws, draws[1:]))  # (single-device order: by stage)
    return draws if reordered or any(_runs_some_dropouts(draws, dp.stages) for dp in ranks) else ()


def _runs_some_dropouts(draws: tuple, stages: tuple[StageSpec, ...]) -> bool:
    """Whether a rank running ``stages`` runs some of the step's dropouts ``draws`` but not all.

    Then every rank draws every mask first (``RankProgram.dropout_draws``), so that each mask lands
    on its single-device random position and every rank's stream stays the single-device one (a
    checkpoint continues any rank's); a rank running all of them draws them in order as it goes.
    """
    mine = {st.index for st in stages}
    return 0 < sum(1 for d in draws if d[0] in mine) < len(draws)
