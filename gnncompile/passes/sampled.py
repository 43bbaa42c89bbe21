"""The lowering of sampled mini-batch plans: mini-batch ``data`` and ``split`` (GSPLIT).

Both run the model bound to per-layer blocks (:func:`~gnncompile.frontend.blocks.bind_blocks`):
the graph input becomes one input per layer, ``g_0 .. g_{L-1}``, and every step a rank's
:class:`~gnncompile.graph.minibatch.SampledSteps` gives it that step's blocks, feature rows and
scored seeds. The loss is the sum of the cross-entropy over the rank's seeds divided by the step's
global number of seeds, so the ranks' gradients add up (one all-reduce) to the mean loss's.

- **mini-batch data** (``parts is None``): each rank samples its own micro-batch (a contiguous
  ``1/n`` of the step's seeds) with its own stream; one stage, no exchange. What DGL and PyG
  users run; the micro-batches' samples overlap (redundant loading and compute, GSPLIT Table 1).
- **split** (``parts``: a vertex -> rank map): one mini-batch, sampled alike on every rank, cut
  into splits by ``parts``; every source-side read of a layer-``k`` op is a halo exchange through
  the shuffle index of block ``k - 1`` (:func:`~gnncompile.graph.minibatch.split_step`): exact with
  respect to the sample.

Evaluation (both): each rank evaluates the vertices it is given (``eval_targets``) on their whole
neighbourhood with the whole graph's coefficients (:func:`~gnncompile.graph.minibatch.full_blocks`),
so accuracies are those of the model on the whole graph; split's exchanges then carry no rows.

The plan's row counts (:class:`~gnncompile.ir.plan.RankSizes`, exchange rows) are means over a few
presampled steps: a step's own sizes vary around them.

Replicated dropout (both): a mask is the one single-device training draws for the mini-batch's
(or micro-batch's) tensor; each step a rank gets the positions of its rows there
(:func:`~gnncompile.graph.minibatch.batch_dropout_positions`). Mini-batch data ranks draw the masks
of every rank's micro-batch in turn and keep their own (``Lowered.draw_rounds``).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch

from ..errors import PlanningError, TraceError
from ..cost_models import formulas
from ..frontend.blocks import bind_blocks, block_input_names, block_norms
from ..graph.core import GraphStats
from ..graph.minibatch import SampledSteps, full_blocks
from ..graph.presample import split_stats
from ..graph.shard import propagation_scales, slice_rows
from ..ir.plan import HaloExchange, Instruction, RankSizes, Schedule
from ..ir.tpgraph import TPGraph
from .driver import Job, Lowered, RankLowering
from .dropout import sampled_index_inputs
from .lower import Conversion, Decisions, StagedModel, propagation_norms, source_input, split_stages
from .schedule import compute_deps, insert_collectives, list_schedule

__all__ = ["lower_sampled", "sampled_decisions", "expected_step_sizes", "estimated_step_sizes"]

#: steps presampled for the plan's expected sizes
PRESAMPLED_STEPS = 4


def sampled_decisions(tp: TPGraph, exchange: bool) -> Decisions:
    """Rows everywhere; with ``exchange``, source-side reads of P/E ops need the halo (split)."""
    needs = {}
    if exchange:
        for n in tp.graph.nodes:
            src = source_input(n)
            if src is not None:
                needs[(n.name, src.name)] = "halo"
    return Decisions(needs=needs)


def _layer_input(nodes: dict[str, torch.fx.Node], c: Conversion) -> str:
    """The graph input whose shuffle completes ``c``'s value (``nodes``: the staged graph's by
    name): the block of its consumers' layer."""
    layers = {nodes[u].meta["tp"].layer for u in c.consumers if u in nodes}
    if len(layers) != 1:
        raise PlanningError(f"split: {c.value!r} is read on the source side by ops of layers {sorted(layers)}; one "
                            "exchange serves one layer's block")
    return f"g_{layers.pop() - 1}"


def _sizes(layers: tuple[tuple[int, int, int, int], ...], seeds: int) -> RankSizes:
    """A sampled rank's sizes from its per-layer ``(rows, dst, src, edges)``: every block's edges
    held, the input layer's rows computed and loaded, ``seeds`` scored."""
    return RankSizes(nodes=layers[0][0], edges=sum(t[3] for t in layers), src=layers[0][2],
                     feature_rows=layers[0][0], trains=max(1, seeds), layers=layers)


def expected_step_sizes(sources: Sequence[SampledSteps], steps: int = PRESAMPLED_STEPS
                        ) -> tuple[list[RankSizes], list[Optional[torch.Tensor]]]:
    """Mean per-rank sizes over the first ``steps`` steps of epoch 0 (per layer: the rows its T ops
    compute, its destinations, source rows and edges, :attr:`RankSizes.layers`), and (split) the
    mean shuffle matrices of every layer (``[q, r]``: rows ``q`` sends ``r``)."""
    n = len(sources)
    steps = max(1, min(steps, sources[0].steps_per_epoch))
    L = len(sources[0].fanouts)
    per_layer = torch.zeros(n, L + 1, 4, dtype=torch.float64)
    seeds = torch.zeros(n, dtype=torch.float64)
    shuffles: Optional[list[torch.Tensor]] = None
    for s in range(steps):
        batch = None
        if sources[0].parts is not None:  # one sample, split by every rank
            batch = sources[0].sample(0, s)
            mats = list(split_stats(batch, sources[0].parts, n).send)
            shuffles = mats if shuffles is None else [a + b for a, b in zip(shuffles, mats)]
        for r, src in enumerate(sources):
            st = src.step(0, s, batch)
            for k, b in enumerate(st.blocks):
                per_layer[r, k] += torch.tensor([st.rows[k], b.num_nodes, b.num_src, b.num_edges], dtype=torch.float64)
            per_layer[r, L] += torch.tensor([st.rows[L]] * 3 + [0], dtype=torch.float64)
            seeds[r] += st.seeds.numel()
    per_layer = (per_layer / steps).round().long()
    sizes = [_sizes(tuple(tuple(int(v) for v in row) for row in per_layer[r]), round(float(seeds[r]) / steps))
             for r in range(n)]
    mean = None if shuffles is None else [(m.double() / steps).round().long() for m in shuffles]
    return sizes, mean if mean is not None else [None]


def estimated_step_sizes(stats: GraphStats, batch_size: int, fanouts: Sequence[int], num_ranks: int,
                         cut: Optional[float]) -> tuple[list[RankSizes], list[Optional[torch.Tensor]], int]:
    """:func:`expected_step_sizes` from statistics alone (:func:`~gnncompile.cost_models.formulas.sampled_sizes`):
    with ``cut`` (split: the fraction of sampled edges that cross splits) one mini-batch of
    ``batch_size`` seeds split evenly, with its shuffles
    (:func:`~gnncompile.cost_models.formulas.split_remote_rows`, spread evenly over the peers);
    without, every rank's own micro-batch. Also returns the steps of an epoch over the graph's
    vertices (statistics hold no training mask)."""
    n, L = num_ranks, len(fanouts)
    d = stats.degree_mean if stats.num_nodes else 0.0
    split = cut is not None
    layers = formulas.sampled_sizes(stats.num_nodes, d, batch_size if split else batch_size / n, fanouts)
    share = 1.0 / n if split else 1.0
    rows = [v * share for v, _ in layers]
    edges = [e * share for _, e in layers]
    remote = [formulas.split_remote_rows(layers[i][0], layers[i][1], n, cut) if split else 0.0 for i in range(L)]
    per_layer = tuple((round(rows[k - 1]), round(rows[k]), round(rows[k - 1] + remote[k - 1]), round(edges[k - 1]))
                      for k in range(1, L + 1)) + ((round(rows[L]),) * 3 + (0,),)
    sizes = [_sizes(per_layer, round(rows[L]))] * n
    shuffles: list[Optional[torch.Tensor]] = [None]
    if split and n > 1:
        shuffles = []
        for i in range(L):
            m = torch.full((n, n), int(round(remote[i] / (n - 1))), dtype=torch.int64)
            m.fill_diagonal_(0)
            shuffles.append(m)
    return sizes, shuffles, -(-stats.num_nodes // batch_size)


def lower_sampled(job: Job, *, batch_size: int, fanouts: Sequence[int], seed: int, parts: Optional[torch.Tensor],
                  eval_targets: Sequence[torch.Tensor], info: Optional[dict[str, Any]] = None,
                  cut: Optional[float] = None) -> Lowered:
    """The sampled lowering of ``job`` (module docstring); ``parts``: split's vertex -> rank map
    (``None``: mini-batch data); ``eval_targets[r]``: the vertices rank ``r`` evaluates. With
    :class:`GraphStats` alone (nothing to sample) the sizes are :func:`estimated_step_sizes`'s and
    ``cut`` (split: the fraction of sampled edges crossing splits) says the plan splits; the plan
    can be printed, verified and simulated, not run."""
    n = job.num_ranks
    if job.concrete and (job.graph.train_mask is None or int(job.graph.train_mask.sum()) == 0):
        raise PlanningError(f"train_mask: graph {job.graph.name!r} has no training vertices to sample mini-batches "
                            "from")
    try:
        tp, tp_eval = bind_blocks(job.tp), bind_blocks(job.tp_eval)
    except TraceError as e:  # the model cannot run on blocks
        raise PlanningError(f"strategy {job.strategy!r}: {e}") from None
    names = block_input_names(tp)
    if len(fanouts) != len(names):
        raise PlanningError(f"fanouts has {len(fanouts)} entries but {type(job.model).__name__} has {len(names)} GNN "
                            "layers; give one fanout per layer, input layer first")
    exchange = parts is not None or cut is not None
    if exchange:  # a rank's block holds its destinations' in-edges only: no whole-block out-degrees
        propagation_norms(tp, tp_eval)
    staged = split_stages(tp, sampled_decisions(tp, exchange))
    staged_eval = split_stages(tp_eval, sampled_decisions(tp_eval, exchange))
    norms = tuple(block_norms(tp, tp_eval))
    sources: list[SampledSteps] = []
    if job.concrete:
        graph = job.graph
        host = graph.replace(val_mask=None, test_mask=None) if graph.device.type == "cpu" else graph.to("cpu")
        targets = torch.nonzero(host.train_mask).flatten()
        dropout = sampled_index_inputs(job.tp)
        sources = [SampledSteps(host, targets, batch_size, tuple(fanouts), seed, norms, r, n, parts, dropout)
                   for r in range(n)]
        sizes, shuffles = expected_step_sizes(sources)
        steps = sources[0].steps_per_epoch
    else:
        sizes, shuffles, steps = estimated_step_sizes(job.stats, batch_size, fanouts, n, cut)
    group = tuple(range(n))
    layer_of = {name: k for k, name in enumerate(names)}
    nodes_of = {id(st): {v.name: v for v in st.tp.graph.nodes} for st in (staged, staged_eval)}

    def convert_for(r: int, st: StagedModel, training: bool):
        nodes = nodes_of[id(st)]

        def convert(c: Conversion, chunk: int, grad: bool) -> list[Instruction]:
            node = nodes[c.value]
            name = _layer_input(nodes, c)
            if training and shuffles[0] is not None:
                m = shuffles[layer_of[name]]
                send, recv = tuple(int(m[r, q]) for q in group), tuple(int(m[q, r]) for q in group)
            else:  # evaluation: every rank's blocks hold their whole neighbourhood
                send = recv = (0,) * n
            return [HaloExchange(value=c.value, chunk=chunk, group=group, send_rows=send, recv_rows=recv,
                                 width=math.prod(node.meta["tp"].dims), dtype=node.meta["tp"].dtype or "float32",
                                 grad=grad, halo=name)]
        return convert

    order = list_schedule(compute_deps(staged))
    order_eval = list_schedule(compute_deps(staged_eval, training=False))
    # evaluation reads the whole graph's scales: computed once for every rank's blocks
    scales = propagation_scales(sources[0].graph, norms) if job.concrete else None
    ranks = []
    for r in range(n):
        step: dict[str, Any] = {}
        if job.concrete:
            graph, ev = job.graph, eval_targets[r]
            fb = full_blocks(sources[r].graph, ev, len(names), norms, scales)
            empty = (tuple(torch.zeros(0, dtype=torch.int64) for _ in group), (0,) * n)
            masks = {m: None if getattr(graph, f"{m}_mask") is None
                     else getattr(graph, f"{m}_mask").cpu().index_select(0, ev) for m in ("train", "val", "test")}
            step = dict(inputs={**dict(zip(names, fb.blocks)), "x": slice_rows(sources[r].graph.x, fb.input_ids)},
                        labels=None if graph.y is None else graph.y.cpu().index_select(0, ev), masks=masks, owned=ev,
                        sampled=sources[r], halos={name: empty for name in names} if exchange else {})
        ranks.append(RankLowering(
            rank=r, stages=tuple(staged.stages), sizes=sizes[r],
            instructions=insert_collectives(staged, order, convert_for(r, staged, True)),
            eval_stages=tuple(staged_eval.stages),
            eval_instructions=tuple(insert_collectives(staged_eval, order_eval, convert_for(r, staged_eval, False))),
            step=step))
    out_info = {"inputs": [*names, "x", *job.dropout_inputs], "batch_size": batch_size, "fanouts": list(fanouts),
                "steps_per_epoch": steps, "estimated": not job.concrete,
                "sampled_rows": [sum(t[1] for t in s.layers[:-1]) for s in sizes],
                "sampled_edges": [s.edges for s in sizes], "input_rows": [s.feature_rows for s in sizes],
                **(info or {})}
    if shuffles[0] is not None:
        out_info["shuffle_rows"] = [int(m.sum()) for m in shuffles]
    return Lowered(staged=staged, staged_eval=staged_eval, ranks=ranks, grad_groups=[(group, job.numel)],
                   schedule=Schedule(), info=out_info, draw_rounds=1 if exchange else n)

