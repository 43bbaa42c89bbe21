"""Sampled mini-batch training: the batches of an epoch, their blocks and sampled evaluation.

An epoch visits the training vertices once, in a random order, in batches of ``batch_size``
seeds (the last one smaller); each batch's computation graph is sampled with one fanout per GNN
layer (:func:`~gnncompile.graph.sampling.sample_blocks`, input layer first) and the model runs on
its blocks (:class:`~gnncompile.frontend.blocks.BlockModel`). The order and the samples are
functions of the run's seed, the epoch and the step (:mod:`gnncompile.graph.minibatch`), drawn on
the CPU: a run is reproducible on any device, and a plan's ranks draw the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..errors import ArgumentError, GraphError
from ..frontend.blocks import BlockModel
from ..graph.core import Graph
from ..graph.minibatch import batch_generator
from ..graph.sampling import parse_fanouts, sample_blocks
from ..graph.shard import slice_rows

__all__ = ["MiniBatch", "sampled_logits"]


@dataclass(frozen=True)
class MiniBatch:
    """How a run samples: ``batch_size`` seeds per step, ``fanouts`` in-edges per destination and
    layer (input layer first, ``-1``: all), and ``eval_fanouts`` for evaluation (``None``: evaluate
    on the whole graph, every neighbour)."""

    batch_size: int
    fanouts: tuple[int, ...]
    eval_fanouts: Optional[tuple[int, ...]] = None

    @classmethod
    def of(cls, batch_size: Any, fanouts: Any, eval_fanouts: Any = None) -> "MiniBatch":
        """Validated options; raises ``ValueError`` naming the bad argument."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
            raise ArgumentError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if fanouts is None:
            raise ArgumentError("batch_size needs fanouts: one number of sampled in-edges per GNN layer, input layer "
                             "first (-1: all), e.g. fanouts=[15, 10, 5]")
        return cls(int(batch_size), parse_fanouts(fanouts, "fanouts"),
                   None if eval_fanouts is None else parse_fanouts(eval_fanouts, "eval_fanouts"))

    def check_layers(self, num_layers: int, model_name: str) -> None:
        """Refuse fanouts whose count is not the model's number of GNN layers."""
        for what, f in (("fanouts", self.fanouts), ("eval_fanouts", self.eval_fanouts)):
            if f is not None and len(f) != num_layers:
                raise ArgumentError(f"{what} has {len(f)} entries but {model_name} has {num_layers} GNN layers "
                                 "(propagations on the longest path); give one fanout per layer, input layer first")


@torch.no_grad()
def sampled_logits(model: BlockModel, host: Graph, x: torch.Tensor, ids: torch.Tensor, fanouts: Sequence[int],
                   batch_size: int, seed: int, epoch: int, norms: Sequence[tuple[str, bool]]) -> torch.Tensor:
    """The model's outputs at ``ids`` (CPU ids), computed on blocks sampled from ``host`` (the
    graph on the CPU) in batches of ``batch_size`` (in eval mode if the model is); ``x``: the
    features on the model's device."""
    if ids.numel() == 0:
        raise GraphError("sampled evaluation: no vertices to evaluate")
    outs = []
    for k, seeds in enumerate(ids.split(batch_size)):
        b = sample_blocks(host, seeds, fanouts, generator=batch_generator(seed, epoch, k, stream=-1), norms=norms)
        b = b.to(x.device)
        outs.append(model(b.blocks, slice_rows(x, b.input_ids)))
    return torch.cat(outs)
