"""The ``data`` strategy: graph (vertex) parallelism with halo exchange; exact.

The baseline every paper compares against (NeutronTask §2, GNNPipe §2.2, NeutronTP §2.2).

Decisions (applied by :mod:`gnncompile.passes.lower`):

- every value is in ``rows`` layout: a vertex partition (contiguous, random or METIS) gives each
  rank its vertices; V-space values hold the rank's rows, E-space values its vertices' in-edges;
- parameters are replicated; their gradients are summed with one all-reduce per step;
- every P/E op that reads a vertex value on the *source* side of edges (``propagate``,
  ``masked_propagate``, ``gather_src``) needs the value in ``halo`` layout: the rank's rows plus
  the rows of its remote in-neighbours, fetched by a halo exchange whose backward returns those
  rows' gradients to their owners. Destination-side ops (``gather_dst``, ``edge_softmax``,
  ``aggregate``) and T ops are local.

Each rank's graph is a :class:`~gnncompile.graph.shard.LocalGraph` (own vertices, then halo
vertices; normalization coefficients of the global graph). The loss is the sum of the
cross-entropy over the rank's training vertices divided by the global number of training
vertices, so the ranks' losses and gradients add up to the single-device ones: the strategy is
exact for any model whose T ops are row-wise. Ops that mix rows (BatchNorm's batch statistics, a
reduction over vertices) are refused under ``semantics="exact"``; with ``"relaxed"`` they use
per-rank statistics and the plan records the relaxation.

Communication per training step (the closed form the runtime's byte counters must equal): rank
``r`` sends ``sum_q |send_rq| * width * s`` per halo exchange, receives ``|halo_r| * width * s``,
and the backward moves the same rows the other way when the exchanged value needs a gradient;
summed over ranks and layers this is NeutronTask's ``(alpha - 1) |V| L d`` per direction. The
gradient all-reduce adds ``2 (n - 1) / n * |params| * s`` per rank (ring).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.fx
import torch.nn.functional as F

from ..errors import PlanningError
from ..frontend.ops import dropout_rows, masked_propagate, propagate
from ..graph.core import Graph, GraphStats
from ..graph.partition import PARTITIONERS, expected_replication, partition
from ..graph.shard import Shard, build_shards, dropout_positions
from ..nn.functional import feature_dropout
from ..ir.plan import AllReduce, DevicePlan, HaloExchange, Instruction, OptimizerStep, Plan, RankProgram
from ..ir.tpgraph import TPGraph
from .recompute import insert_recomputation
from .lower import Conversion, Decisions, StagedModel, call_arguments, forward_schedule, sequential_schedule, \
    source_input, split_stages

__all__ = ["DataOptions", "DROPOUT_MODES", "check_options", "data_decisions", "row_mixing_ops", "row_mixing_relaxations",
           "replicate_dropout_masks", "lower_data", "halo_bytes"]

DROPOUT_MODES = ("replicated", "local")

_ROW_MIXING_MODULES = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.InstanceNorm1d)


@dataclass(frozen=True)
class DataOptions:
    """Options of the ``data`` strategy.

    partitioner:
        ``"metis"`` (edge-cut minimizing, default), ``"random"`` or ``"contiguous"``.
    seed:
        Seed of the partitioner (random, METIS).
    semantics:
        ``"exact"`` refuses ops whose result depends on rows of other ranks beyond the halo
        (BatchNorm statistics, reductions over vertices); ``"relaxed"`` runs them per rank.
    dropout:
        ``"replicated"`` (default): every rank draws each dropout mask of the whole graph from the
        same seed and keeps its rows (:func:`~gnncompile.ops.dropout_rows`), so training sees the
        masks single-device training sees, bit for bit; it costs each rank the random draws of
        the whole tensor. ``"local"``: each rank draws masks for its rows only from its own stream
        (same distribution, different draws; no redundant work).
    recompute:
        Apply :func:`~gnncompile.passes.recompute.insert_recomputation` (exact): the T segments
        between propagations keep only their inputs for backward and run again there, trading T
        compute for activation memory (NeutronTask §5.1).
    """

    partitioner: str = "metis"
    seed: int = 0
    semantics: str = "exact"
    dropout: str = "replicated"
    recompute: bool = False

    def __post_init__(self) -> None:
        if self.partitioner not in PARTITIONERS:
            raise PlanningError(f"unknown partitioner {self.partitioner!r}; valid: {', '.join(PARTITIONERS)}")
        check_options(self.semantics, self.dropout, recompute=self.recompute)

    def to_dict(self) -> dict[str, Any]:
        """The recorded options of a plan (``Plan.options``): lowering again with them gives the same plan."""
        return {"strategy": "data", "partitioner": self.partitioner, "seed": self.seed,
                "semantics": self.semantics, "dropout": self.dropout, "recompute": self.recompute}


def check_options(semantics: str, dropout: str, **flags: Any) -> None:
    """Validate the options strategies share: ``semantics``, ``dropout`` and boolean ``flags``."""
    if semantics not in ("exact", "relaxed"):
        raise PlanningError(f"unknown semantics {semantics!r}; valid: 'exact', 'relaxed'")
    if dropout not in DROPOUT_MODES:
        raise PlanningError(f"unknown dropout mode {dropout!r}; valid: {', '.join(DROPOUT_MODES)}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise PlanningError(f"{name}: expected True or False, got {value!r}")


_INDEX_INPUTS = {"V": "dropout_index_v", "E": "dropout_index_e", "E+V": "dropout_index_ev",
                 "nnz": "dropout_index_nnz"}


def _dropout_of(tp: TPGraph, n: torch.fx.Node) -> Optional[tuple[torch.fx.Node, float]]:
    """``(input, p)`` if ``n`` is a training-mode dropout that draws a mask, else ``None``."""
    if n.op == "call_function" and n.target in (F.dropout, feature_dropout):
        a = call_arguments(n)
        inp = a.get("input", a.get("x"))
        if a["training"] and float(a["p"]) > 0 and isinstance(inp, torch.fx.Node):
            return inp, float(a["p"])
    elif n.op == "call_module":
        mod = tp.get_submodule(n.target)
        if isinstance(mod, torch.nn.Dropout) and mod.training and mod.p > 0 and n.args:
            return n.args[0], float(mod.p)
    return None


def replicate_dropout_masks(tp: TPGraph, graph: Graph, strategy: str = "",
                            allowed: Optional[tuple[str, ...]] = None) -> tuple[TPGraph, dict[str, str]]:
    """Rewrite every training-mode dropout into :func:`~gnncompile.ops.dropout_rows` over the whole graph.

    ``allowed``: the row spaces (``V``, ``E``, ``E+V``, ``nnz``) whose masks ``strategy`` can hand
    its ranks (default: all); a dropout of another space raises :class:`PlanningError`.

    Requires: ``tp`` traced for ``graph``. Ensures: each dropout of a V-, E- or (E+V)-space value
    (or of sparse input features) reads a new model input ``dropout_index_<space>`` (the global rows
    a rank holds) and draws the mask of the global tensor; the returned dict maps those inputs to
    their spaces. Preserves: the function computed on one rank holding every row (identity index),
    including the RNG calls, so a rank's masks equal single-device training's for the same seed.
    Returns a copy; ``tp`` is untouched (modules are shared).
    """
    out = tp.bind(tp.stats)
    g = out.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    inputs: dict[str, torch.fx.Node] = {}
    spaces: dict[str, str] = {}
    sizes = {"V": graph.num_nodes, "E": graph.num_edges, "E+V": graph.num_edges + graph.num_nodes}
    if graph.x is not None and graph.x.layout == torch.sparse_csr:
        sizes["nnz"] = int(graph.x.values().numel())
    for n in list(g.nodes):
        found = _dropout_of(out, n)
        if found is None:
            continue
        inp, p = found
        info = inp.meta.get("tp")
        space = "nnz" if inp.op == "placeholder" and "nnz" in sizes else (info.space if info is not None else "?")
        if space not in sizes:
            raise PlanningError(f"op {n.name!r}: dropout of a value with rows {space!r} cannot draw the whole "
                                "graph's mask; use dropout='local'")
        name = _INDEX_INPUTS[space]
        if name not in inputs:
            with g.inserting_after(placeholders[-1]):
                ph = g.placeholder(name)
            ph.meta["tp"] = placeholders[-1].meta.get("tp")
            placeholders.append(ph)
            inputs[name] = ph
            spaces[name] = space
        with g.inserting_before(n):
            new = g.call_function(dropout_rows, (inp, p, inputs[name], sizes[space]))
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        g.erase_node(n)
    out.recompile()
    unsupported = sorted(sp for sp in spaces.values() if allowed is not None and sp not in allowed)
    if unsupported:
        raise PlanningError(f"strategy {strategy!r}: dropout of {unsupported[0]}-space values is not supported")
    return out, spaces


def mask_counts(graph: Graph) -> dict[str, int]:
    """The global number of vertices in each of ``graph``'s train/val/test masks (0 when absent):
    the loss divides each rank's sum by these."""
    return {m: int(getattr(graph, f"{m}_mask").sum()) if getattr(graph, f"{m}_mask") is not None else 0
            for m in ("train", "val", "test")}


def data_decisions(tp: TPGraph) -> Decisions:
    """Rows everywhere; source-side reads of P/E ops need the halo."""
    needs = {}
    for n in tp.graph.nodes:
        src = source_input(n)
        if src is not None:
            needs[(n.name, src.name)] = "halo"
    return Decisions(needs=needs)


def row_mixing_relaxations(tp: TPGraph, strategy: str, semantics: str, each: str = "rank",
                           unit: str = "rank") -> list[str]:
    """The relaxation a strategy records for row-mixing T ops (``[]`` when there are none).

    Under ``semantics="exact"`` raises :class:`PlanningError` naming the ops: each ``each`` (a
    rank, a chunk...) would normalize with its own rows' statistics (``per-{unit} statistics``).
    """
    mixing = row_mixing_ops(tp)
    if not mixing:
        return []
    if semantics == "exact":
        what = "; ".join(f"{op}: {why}" for op, why in mixing)
        raise PlanningError(f"strategy {strategy!r} is not exact for this model: {what}. Each {each} would use its "
                            f"own rows only; pass semantics='relaxed' to accept per-{unit} statistics")
    return [f"per-{unit} statistics ({', '.join(op for op, _ in mixing)})"]


def row_mixing_ops(tp: TPGraph) -> list[tuple[str, str]]:
    """T ops whose output rows depend on other rows of a V-space input: ``(op, why)`` pairs."""
    found = []
    for n in tp.graph.nodes:
        info = n.meta.get("tp")
        if info is None or info.kind != "T":
            continue
        if n.op == "call_module" and isinstance(tp.get_submodule(n.target), _ROW_MIXING_MODULES):
            mod = tp.get_submodule(n.target)
            if mod.training or not getattr(mod, "track_running_stats", False):
                found.append((n.name, f"{type(mod).__name__} normalizes with statistics over all vertices"))
            continue
        in_spaces = {a.meta["tp"].space for a in n.all_input_nodes if "tp" in a.meta}
        if ("V" in in_spaces or "E" in in_spaces) and info.space not in ("V", "E", "E+V"):
            found.append((n.name, f"reduces over {'vertices' if 'V' in in_spaces else 'edges'} "
                                  f"(output rows {info.space})"))
    return found


def _propagation_norms(tp: TPGraph) -> set[tuple[str, bool]]:
    norms = set()
    for n in tp.graph.nodes:
        if n.op == "call_function" and n.target in (propagate, masked_propagate):
            a = call_arguments(n)
            if a["edge_weight"] is None:
                norms.add((a["norm"], bool(a["add_self_loops"])))
            elif a["norm"] == "gcn":
                raise PlanningError(
                    f"op {n.name!r}: norm='gcn' of computed edge weights needs every source's global out-degree, "
                    "which the data strategy's per-rank graphs do not hold; use norm='mean' or normalize first")
    return norms


def _elsize(dtype: Optional[str]) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype or "float32")).element_size()


def _width(tp: TPGraph, value: str) -> int:
    node = next(n for n in tp.graph.nodes if n.name == value)
    return math.prod(node.meta["tp"].dims)


def halo_bytes(send_rows: int, recv_rows: int, width: int, elsize: int, needs_grad: bool) -> tuple[int, int]:
    """(sent, received) bytes of one halo exchange and, if ``needs_grad``, its backward."""
    sent = send_rows * width * elsize
    recv = recv_rows * width * elsize
    return (sent + recv, recv + sent) if needs_grad else (sent, recv)


def _split_evenly(total: float, parts: int) -> list[int]:
    """``total`` (rounded) split into ``parts`` integers that differ by at most one."""
    t = int(round(total))
    return [t // parts + (1 if k < t % parts else 0) for k in range(parts)]


@dataclass(frozen=True)
class _RankData:
    """What the lowering needs of one rank: halo lists and sizes (from a shard or from estimates)."""

    send_rows: tuple[int, ...]
    recv_rows: tuple[int, ...]
    sizes: dict[str, int]


def _estimated_ranks(stats: GraphStats, n: int, method: str) -> tuple[list[_RankData], dict[str, Any]]:
    """Per-rank sizes of a balanced ``n``-way partition of a graph known by ``stats`` alone."""
    est = expected_replication(stats, n, method)
    owned = _split_evenly(stats.num_nodes, n)
    edges = _split_evenly(stats.num_edges, n)
    # every pair of ranks exchanges the same number of rows (symmetric, as the verifier requires):
    # (alpha - 1) |V| halo rows in all, spread over the n (n - 1) ordered pairs
    pair = int(round((est.alpha - 1.0) * stats.num_nodes / (n * (n - 1)))) if n > 1 else 0
    halo = [pair * (n - 1)] * n
    ranks = []
    for r in range(n):
        rows = tuple(0 if q == r else pair for q in range(n))
        ranks.append(_RankData(send_rows=rows, recv_rows=rows,
                               sizes={"nodes": owned[r], "edges": edges[r], "halo": halo[r],
                                      "src": owned[r] + halo[r]}))
    part = {"method": method, "num_parts": n, "replication_factor": est.alpha, "estimated": True,
            "source": est.source, "num_local": owned, "num_halo": halo, "num_edges": edges}
    return ranks, part


def lower_data(tp: TPGraph, tp_eval: TPGraph, model: torch.nn.Module, graph: Union[Graph, GraphStats],
               num_ranks: int, options: DataOptions) -> Plan:
    """Lower ``tp`` (training-mode trace) and ``tp_eval`` to a ``data`` plan over ``num_ranks`` ranks.

    With a :class:`Graph` the vertices are partitioned and the plan can run. With
    :class:`GraphStats` alone the plan's halo lists and per-rank sizes are estimates from the
    replication factor (:func:`~gnncompile.graph.partition.expected_replication`) of a balanced
    partition: it can be printed, verified and simulated, not run.
    """
    relaxations: list[str] = []
    if num_ranks > 1:
        relaxations += row_mixing_relaxations(tp, "data", options.semantics)
    norms = _propagation_norms(tp) | _propagation_norms(tp_eval)
    concrete = isinstance(graph, Graph)

    shards: list[Shard] = []
    dropout_inputs: dict[str, str] = {}
    if concrete:
        part = partition(graph, num_ranks, options.partitioner, seed=options.seed)
        shards = build_shards(graph, part.parts, num_ranks, norms=norms)
        rank_data = [_RankData(tuple(s.send_count), tuple(s.recv_count),
                               {"nodes": s.num_owned, "edges": s.graph.num_edges, "halo": s.num_halo,
                                "src": s.num_owned + s.num_halo}) for s in shards]
        part_info = part.to_dict(include_parts=False)
        if options.dropout == "replicated":
            tp, dropout_inputs = replicate_dropout_masks(tp, graph)
    else:
        rank_data, part_info = _estimated_ranks(graph, num_ranks, options.partitioner)
    if options.recompute:
        tp = insert_recomputation(tp, share_parameters=True)
    staged = split_stages(tp, data_decisions(tp))
    staged_eval = split_stages(tp_eval, data_decisions(tp_eval))
    group = tuple(range(num_ranks))
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    numel = sum(p.numel() for p in params if p.requires_grad)
    param_dtype = str(params[0].dtype).replace("torch.", "") if params else "float32"

    def convert_for(rd: _RankData, st: StagedModel):
        def convert(c: Conversion, grad: bool) -> list[Instruction]:
            node = next(n for n in st.tp.graph.nodes if n.name == c.value)
            return [HaloExchange(value=c.value, chunk=0, group=group, send_rows=rd.send_rows,
                                 recv_rows=rd.recv_rows, width=math.prod(node.meta["tp"].dims),
                                 dtype=node.meta["tp"].dtype or "float32", grad=grad)]
        return convert

    def finish() -> list[Instruction]:
        ar = [AllReduce("grads", group, numel=numel, dtype=param_dtype)] if num_ranks > 1 and numel else []
        return ar + [OptimizerStep()]

    ranks = []
    sent_pred, recv_pred = [], []
    for r, rd in enumerate(rank_data):
        instrs = tuple(sequential_schedule(staged, convert_for(rd, staged), finish))
        ranks.append(DevicePlan(rank=r, stages=tuple(staged.stages), instructions=instrs, sizes=dict(rd.sizes),
                                modules=staged.modules))
        s = rv = 0
        for c in staged.conversions:
            node = next(n for n in tp.graph.nodes if n.name == c.value)
            a, b = halo_bytes(sum(rd.send_rows), sum(rd.recv_rows), math.prod(node.meta["tp"].dims),
                              _elsize(node.meta["tp"].dtype), c.needs_grad)
            s, rv = s + a, rv + b
        if num_ranks > 1 and numel:
            ring = 2 * (num_ranks - 1) * numel * _elsize(param_dtype) // num_ranks
            s, rv = s + ring, rv + ring
        sent_pred.append(s)
        recv_pred.append(rv)

    stats = graph.stats() if concrete else graph
    info = {
        "graph": str(stats),
        "model": type(model).__name__,
        "partition": part_info,
        "output": staged.output,
        "inputs": ["g", "x", *dropout_inputs],
        "halo_rows": [rd.sizes["halo"] for rd in rank_data],
        "owned_rows": [rd.sizes["nodes"] for rd in rank_data],
        "params": numel,
        "param_tensors": sum(1 for p in params if p.requires_grad),
        "param_dtype": param_dtype,
        "features": stats.num_features,
        "classes": stats.num_classes,
    }
    plan = Plan(strategy="data", semantics="relaxed" if relaxations else "exact", options=options.to_dict(),
                cluster=f"{num_ranks} local ranks", ranks=ranks, schedule="sequential",
                relaxations=tuple(relaxations),
                predictions={"bytes_sent": sent_pred, "bytes_received": recv_pred}, info=info)
    if concrete:
        plan.program = _rank_programs(graph, model, staged, staged_eval, shards, convert_for, rank_data,
                                      dropout_inputs, options, names, params, ranks)
    return plan


def _rank_programs(graph: Graph, model: torch.nn.Module, staged: StagedModel, staged_eval: StagedModel,
                   shards: list[Shard], convert_for: Any, rank_data: list[_RankData], dropout_inputs: dict[str, str],
                   options: DataOptions, names: list[str], params: list[torch.nn.Parameter],
                   ranks: list[DevicePlan]) -> list[RankProgram]:
    """The runnable per-rank programs of a data plan over a concrete graph."""
    counts = mask_counts(graph)
    programs = []
    for r, shard in enumerate(shards):
        eval_instrs = tuple(forward_schedule(staged_eval, convert_for(rank_data[r], staged_eval)))
        lg = shard.graph
        programs.append(RankProgram(
            rank=r, world_size=len(shards), modules=staged.modules, stages=tuple(staged.stages),
            instructions=ranks[r].instructions,
            eval_modules=staged_eval.modules, eval_stages=tuple(staged_eval.stages), eval_instructions=eval_instrs,
            output=staged.output, eval_output=staged_eval.output,
            inputs={"g": lg, "x": lg.x, **{k: dropout_positions(sp, graph, shard.owned, shard.edge_ids) for k, sp in dropout_inputs.items()}},
            same_seed=options.dropout == "replicated", halo=(tuple(shard.send_index), tuple(shard.recv_count)),
            labels=lg.y, masks={"train": lg.train_mask, "val": lg.val_mask, "test": lg.test_mask},
            counts=counts, params=params, param_names=names, owned=shard.owned))
    return programs
