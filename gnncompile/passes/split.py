"""The ``split`` strategy (GSPLIT, split parallelism): one sampled mini-batch per step, split across
ranks without redundancy; exact with respect to the sample.

Decisions:

- **offline, the global partitioning function** (GSPLIT §4): presampling runs the sampler for
  ``presample_epochs`` epochs and weights every vertex by how often it is sampled at a layer above
  the input and every edge by how often it is sampled; METIS then minimizes the weighted cut with
  the vertex weights balanced (Eq. 2: the expected cross-split edges and the expected load of a
  mini-batch). ``partitioner="metis"`` (unweighted, the paper's *Edge*) and ``"random"`` (*Rand*)
  are the baselines.
- **online, the splits**: every rank samples the step's whole mini-batch from the shared seed (the
  sample is the single-device one) and keeps its split: the sampled vertices its partition owns,
  at every layer; it loads only its own input vertices' features and computes only its own
  destinations.
- **per-layer shuffle**: a layer's remote sources arrive through a halo exchange along the
  shuffle index built from the sample (forward: features, backward: their gradients).

Sampling is replicated on every rank (GSPLIT splits it too); loading, compute and the exchanges
are split. See :mod:`gnncompile.passes.sampled` for the lowering, the loss and evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..errors import PlanningError
from ..graph.partition import expected_replication, partition
from ..graph.presample import presample, presampled_partition
from .driver import Job, Lowered
from .sampled import lower_sampled
from .strategy import Strategy, StrategyOptions, option, product

__all__ = ["SplitOptions", "lower_split", "STRATEGY", "SPLIT_PARTITIONERS"]

SPLIT_PARTITIONERS = ("presampled", "metis", "random")


@dataclass(frozen=True)
class SplitOptions(StrategyOptions):
    """Options of the ``split`` strategy (``seed``, ``semantics``, ``dropout``: :class:`StrategyOptions`;
    replicated masks are the mini-batch's, :func:`~gnncompile.passes.dropout.replicate_dropout_masks`)."""

    strategy = "split"

    batch_size: Optional[int] = option(None, "Seeds (target vertices) per training step: sampled mini-batch training "
                                             "(required by split).", kind="optional_positive_int", neutral=None,
                                       pinned=True, cli="seeds per step: sampled mini-batch training")
    fanouts: Optional[tuple[int, ...]] = option(None, "Sampled in-edges per destination and GNN layer, input layer "
                                                      "first (-1: all); one per layer.", kind="fanouts", neutral=None,
                                                pinned=True, cli="sampled in-edges per GNN layer, input layer first")
    split_partitioner: str = option("presampled", "How sampled vertices are assigned to ranks: 'presampled' (GSPLIT's "
                                                  "presampling-weighted METIS), 'metis' (unweighted) or 'random'.",
                                    kind="choice", choices=SPLIT_PARTITIONERS, pinned=True)
    presample_epochs: int = option(1, "Epochs of mini-batches the presampling counts (split's 'presampled' "
                                      "partitioner).", kind="positive_int", pinned=True)

    def check(self) -> None:
        if self.batch_size is None or self.fanouts is None:
            raise PlanningError("split: needs batch_size and fanouts (sampled mini-batch training), e.g. "
                                "batch_size=1024, fanouts=[10, 5]")

    @classmethod
    def space(cls, semantics: str, fixed: dict[str, Any],
              num_ranks: Optional[int] = None) -> list[dict[str, Any]]:
        if fixed.get("batch_size") is None or fixed.get("fanouts") is None:
            if "batch_size" in fixed or "fanouts" in fixed:  # named (pinned to None), not searched: say why
                cls(**{**fixed, "semantics": semantics})
            return []  # full-graph training: split does not apply
        return product({"split_partitioner": ["presampled"]}, fixed, semantics=semantics)


def split_parts(job: Job, options: SplitOptions) -> tuple[torch.Tensor, dict[str, Any]]:
    """The vertex -> rank map of ``options.split_partitioner`` and what the plan records of it."""
    graph, n = job.graph, job.num_ranks
    if options.split_partitioner == "presampled":
        weights = presample(graph, options.fanouts, options.batch_size, epochs=options.presample_epochs,
                            seed=options.seed)
        part = presampled_partition(graph, n, weights, seed=options.seed)
    else:
        part = partition(graph, n, options.split_partitioner, seed=options.seed)
    return part.parts.to(torch.int64).cpu(), part.to_dict(include_parts=False)


def expected_cut(stats: Any, num_ranks: int, partitioner: str) -> tuple[float, str]:
    """The fraction of sampled edges that cross splits, for planning from statistics: ``1 - 1/n``
    for a random assignment; for METIS (weighted or not) that fraction scaled by how much less it
    replicates than random (``(alpha - 1) / (alpha_random - 1)``, from
    :func:`~gnncompile.graph.partition.expected_replication`): a heuristic, said so in the plan."""
    random_cut = 1.0 - 1.0 / num_ranks
    if partitioner == "random" or num_ranks == 1:
        return random_cut, "random assignment: 1 - 1/n of the sampled edges cross splits"
    est, rand = expected_replication(stats, num_ranks, "metis"), expected_replication(stats, num_ranks, "random")
    ratio = (est.alpha - 1.0) / (rand.alpha - 1.0) if rand.alpha > 1.0 else 1.0
    return random_cut * min(1.0, ratio), (f"random cut x (alpha - 1) / (alpha_random - 1) = {ratio:.2f}; alpha "
                                          f"{est.alpha:.3f}: {est.source}")


def lower_split(job: Job, options: SplitOptions) -> Lowered:
    """The ``split`` lowering of ``job`` (module docstring). From statistics alone the plan's sizes
    and shuffles are estimates (:func:`~gnncompile.passes.sampled.estimated_step_sizes`)."""
    if not job.concrete:
        cut, how = expected_cut(job.stats, job.num_ranks, options.split_partitioner)
        info = {"method": options.split_partitioner, "num_parts": job.num_ranks, "estimated": True,
                "cut_fraction": cut, "source": how}
        return lower_sampled(job, batch_size=options.batch_size, fanouts=options.fanouts, seed=options.seed,
                             parts=None, eval_targets=[], info={"partition": info}, cut=cut)
    parts, info = split_parts(job, options)
    eval_targets = [torch.nonzero(parts == r).flatten() for r in range(job.num_ranks)]
    return lower_sampled(job, batch_size=options.batch_size, fanouts=options.fanouts, seed=options.seed,
                         parts=parts, eval_targets=eval_targets, info={"partition": info})


STRATEGY = Strategy("split", SplitOptions, lower_split,
                    summary="sampled mini-batches split across ranks, per-layer shuffle (GSPLIT)")
