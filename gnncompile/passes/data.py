"""The ``data`` strategy: graph (vertex) parallelism with halo exchange; exact.

The baseline every paper compares against (NeutronTask §2, GNNPipe §2.2, NeutronTP §2.2).

Decisions (applied by :mod:`gnncompile.passes.lower`):

- every value is in ``rows`` layout: a vertex partition (contiguous, random or METIS) gives each
  rank its vertices; V-space values hold the rank's rows, E-space values its vertices' in-edges;
- parameters are replicated; their gradients are summed with one all-reduce per step;
- every P/E op that reads a vertex value on the *source* side of edges (``propagate``,
  ``masked_propagate``, ``gather_src``, ``edge_attention``'s ``src_scores``) needs the value in
  ``halo`` layout: the rank's rows plus the rows of its remote in-neighbours, fetched by a halo
  exchange whose backward returns those rows' gradients to their owners. Destination-side ops
  (``gather_dst``, ``edge_softmax``, ``aggregate``, ``edge_attention``'s ``dst_scores``) and T ops
  are local.

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
from typing import Any, Optional

import torch

from ..errors import PlanningError
from ..graph.core import GraphStats
from ..graph.partition import PARTITIONERS, expected_replication, partition
from ..graph.shard import Shard, build_shards, dropout_positions
from ..ir.plan import HaloExchange, Instruction, RankSizes, Schedule
from ..ir.tpgraph import TPGraph
from .driver import Job, Lowered, RankLowering
from .lower import Conversion, Decisions, StagedModel, propagation_norms, source_input, split_stages
from .sampled import lower_sampled
from .schedule import compute_deps, insert_collectives, list_schedule
from .strategy import ANY, Strategy, StrategyOptions, option, product

__all__ = ["DataOptions", "data_decisions", "lower_data", "STRATEGY"]


@dataclass(frozen=True)
class DataOptions(StrategyOptions):
    """Options of the ``data`` strategy (``seed``, ``semantics``, ``dropout``: :class:`StrategyOptions`)."""

    strategy = "data"

    partitioner: str = option("metis", "Vertex partitioner: 'metis' (edge-cut minimizing), 'random' or "
                                       "'contiguous'.", kind="choice", choices=PARTITIONERS, neutral=ANY, pinned=True)
    recompute: bool = option(False, "Recompute the T segments between propagations in backward instead of keeping "
                                    "their intermediates (exact; NeutronTask §5.1).", kind="bool", pinned=True,
                             cli="recompute T segments in backward instead of keeping their intermediates")
    batch_size: Optional[int] = option(None, "Seeds (target vertices) per training step: sampled mini-batch training "
                                             "(each rank samples its own micro-batch of batch_size / ranks seeds).",
                                       kind="optional_positive_int", neutral=None, pinned=True,
                                       cli="seeds per step: sampled mini-batch training")
    fanouts: Optional[tuple[int, ...]] = option(None, "Sampled in-edges per destination and GNN layer, input layer "
                                                      "first (-1: all); one per layer.", kind="fanouts", neutral=None,
                                                pinned=True, cli="sampled in-edges per GNN layer, input layer first")

    def check(self) -> None:
        if (self.batch_size is None) != (self.fanouts is None):
            raise PlanningError("data: sampled mini-batch training needs both batch_size and fanouts, e.g. "
                                "batch_size=1024, fanouts=[10, 5]")
        if self.batch_size is not None and self.recompute:
            raise PlanningError("data: recompute is not available with sampled mini-batches")

    @classmethod
    def space(cls, semantics: str, fixed: dict[str, Any],
              num_ranks: Optional[int] = None) -> list[dict[str, Any]]:
        if fixed.get("batch_size") is not None:  # mini-batch data: micro-batches, no partition
            return product({}, {**fixed, "recompute": fixed.get("recompute", False)}, semantics=semantics)
        return product({"partitioner": ["metis", "random"], "recompute": [False, True]}, fixed, semantics=semantics)


def data_decisions(tp: TPGraph) -> Decisions:
    """Rows everywhere; source-side reads of P/E ops need the halo."""
    needs = {}
    for n in tp.graph.nodes:
        src = source_input(n)
        if src is not None:
            needs[(n.name, src.name)] = "halo"
    return Decisions(needs=needs)


def _split_evenly(total: float, parts: int) -> list[int]:
    """``total`` (rounded) split into ``parts`` integers that differ by at most one."""
    t = int(round(total))
    return [t // parts + (1 if k < t % parts else 0) for k in range(parts)]


@dataclass(frozen=True)
class _RankData:
    """What the lowering needs of one rank: halo lists and sizes (from a shard or from estimates)."""

    send_rows: tuple[int, ...]
    recv_rows: tuple[int, ...]
    sizes: RankSizes


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
                               sizes=RankSizes(nodes=owned[r], edges=edges[r], halo=halo[r], src=owned[r] + halo[r])))
    part = {"method": method, "num_parts": n, "replication_factor": est.alpha, "estimated": True,
            "source": est.source, "num_local": owned, "num_halo": halo, "num_edges": edges}
    return ranks, part


def lower_data(job: Job, options: DataOptions) -> Lowered:
    """The ``data`` lowering of ``job`` (module docstring).

    With a :class:`~gnncompile.graph.core.Graph` the vertices are partitioned and the plan can run.
    With :class:`GraphStats` alone the plan's halo lists and per-rank sizes are estimates from the
    replication factor (:func:`~gnncompile.graph.partition.expected_replication`) of a balanced
    partition: it can be printed, verified and simulated, not run. With ``batch_size``: mini-batch
    data parallelism (:mod:`gnncompile.passes.sampled`); rank ``r`` evaluates the ``r``-th of ``n``
    contiguous vertex ranges.
    """
    graph, n = job.graph, job.num_ranks
    if options.batch_size is not None:
        ranges = list(torch.arange(graph.num_nodes).tensor_split(n)) if job.concrete else []
        return lower_sampled(job, batch_size=options.batch_size, fanouts=options.fanouts, seed=options.seed,
                             parts=None, eval_targets=ranges)
    norms = propagation_norms(job.tp, job.tp_eval)
    shards: list[Shard] = []
    if job.concrete:
        part = partition(graph, n, options.partitioner, seed=options.seed)
        shards = build_shards(graph, part.parts, n, norms=norms)
        rank_data = [_RankData(tuple(s.send_count), tuple(s.recv_count),
                               RankSizes(nodes=s.num_owned, edges=s.graph.num_edges, halo=s.num_halo,
                                         src=s.num_owned + s.num_halo)) for s in shards]
        part_info = part.to_dict(include_parts=False)
    else:
        rank_data, part_info = _estimated_ranks(graph, n, options.partitioner)
    staged = split_stages(job.tp, data_decisions(job.tp))
    staged_eval = split_stages(job.tp_eval, data_decisions(job.tp_eval))
    group = tuple(range(n))

    def convert_for(rd: _RankData, st: StagedModel):
        def convert(c: Conversion, chunk: int, grad: bool) -> list[Instruction]:
            node = next(v for v in st.tp.graph.nodes if v.name == c.value)
            return [HaloExchange(value=c.value, chunk=chunk, group=group, send_rows=rd.send_rows,
                                 recv_rows=rd.recv_rows, width=math.prod(node.meta["tp"].dims),
                                 dtype=node.meta["tp"].dtype or "float32", grad=grad)]
        return convert

    order = list_schedule(compute_deps(staged))
    order_eval = list_schedule(compute_deps(staged_eval, training=False))
    ranks = []
    for r, rd in enumerate(rank_data):
        step: dict[str, Any] = {}
        if job.concrete:
            shard = shards[r]
            lg = shard.graph
            step = dict(inputs={"g": lg, "x": lg.x, **{k: dropout_positions(sp, graph, shard.owned, shard.edge_ids)
                                                       for k, sp in job.dropout_inputs.items()}},
                        halo=(tuple(shard.send_index), tuple(shard.recv_count)), labels=lg.y,
                        masks={"train": lg.train_mask, "val": lg.val_mask, "test": lg.test_mask}, owned=shard.owned)
        ranks.append(RankLowering(
            rank=r, stages=tuple(staged.stages), sizes=rd.sizes,
            instructions=insert_collectives(staged, order, convert_for(rd, staged)),
            eval_stages=tuple(staged_eval.stages),
            eval_instructions=tuple(insert_collectives(staged_eval, order_eval, convert_for(rd, staged_eval))),
            step=step))
    info = {"partition": part_info, "halo_rows": [rd.sizes.halo for rd in rank_data],
            "owned_rows": [rd.sizes.nodes for rd in rank_data]}
    return Lowered(staged=staged, staged_eval=staged_eval, ranks=ranks, grad_groups=[(group, job.numel)],
                   schedule=Schedule(), info=info, frees=True)


STRATEGY = Strategy("data", DataOptions, lower_data, summary="graph (vertex) parallelism with halo exchange",
                    row_mixing_single=False)
