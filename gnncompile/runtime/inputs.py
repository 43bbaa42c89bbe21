"""The step-input provider: what a rank feeds each training step and each evaluation.

A lowering records a rank's :class:`~gnncompile.ir.plan.StepInputs` (the full graph's part,
regrouped chunks, ...); the provider puts them on the rank's device (features in the parameters'
dtype) and hands out a :class:`StepView` per step: the program's own inputs, or, for a regrouped
chunk pipeline (NeutronTask Algorithm 1), the epoch's subgraphs, scored rows, labels and training
mask. Evaluation always reads the program's inputs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from ..errors import RuntimeFailure
from ..frontend.ops import mask_generator
from ..graph.core import Graph
from ..graph.shard import LocalGraph
from ..ir.plan import StepInputs

__all__ = ["StepView", "StepInputProvider"]


@dataclass
class StepView:
    """The inputs of one step: per-chunk inputs, where each chunk's scored rows start, their labels
    and training mask, (for a regrouped epoch) the vertices scored, in that order, the values
    of the plan's per-step sizes (:class:`~gnncompile.ir.plan.StepSize`) in this step, and (for a
    regrouped epoch) the vertex ids of every chunk, where its rows' historical embeddings are kept
    (``None``: chunk ``k`` is rows ``[sum(chunk_rows[:k]), sum(chunk_rows[:k + 1]))`` of them)."""

    chunk_inputs: dict[int, dict[str, Any]]
    offsets: tuple[int, ...]
    labels: Any
    train_mask: Any
    owned: Optional[torch.Tensor] = None
    sizes: Mapping[str, int] = field(default_factory=dict)
    slots: Optional[tuple[torch.Tensor, ...]] = None
    #: per-layer exchange lists of the step by graph input name: ``(send_index per rank, recv_count per rank)``
    halos: Mapping[str, tuple[tuple[torch.Tensor, ...], tuple[int, ...]]] = field(default_factory=dict)
    #: the step's global number of scored rows, the loss's denominator (``None``: the plan's training count)
    loss_rows: Optional[int] = None
    #: the indices of the training rows among the scored rows, for a view without chunks (``None``:
    #: the executor finds them from ``train_mask``, once per mask)
    train_rows: Optional[torch.Tensor] = None


class StepInputProvider:
    """One rank's step inputs on ``device`` (in place of the lowering's, which stay on the host).
    ``sample_seed``: the seed a sampled plan's mini-batches are drawn with (the run's, as
    :func:`gnncompile.train`'s; ``None``: 0, as there)."""

    def __init__(self, step: StepInputs, device: torch.device, dtype: Optional[torch.dtype] = None,
                 sample_seed: Optional[int] = None) -> None:
        self.device = device
        self.dtype = dtype
        self.step = step.to(device) if device.type != "cpu" else step
        self._sampled = None if step.sampled is None else \
            dataclasses.replace(step.sampled, seed=0 if sample_seed is None else int(sample_seed))
        self._cast([self.step.inputs, *self.step.chunk_inputs.values()])

    def _cast(self, stores: Any) -> None:
        """Features (dense or sparse CSR) and the graphs' normalization scales in the parameters'
        dtype (the model computes in it)."""
        for store in stores:
            x = store.get("x")
            if isinstance(x, torch.Tensor) and self.dtype is not None and x.dtype != self.dtype:
                store["x"] = x.to(self.dtype)
            for k, v in list(store.items()):
                if isinstance(v, Graph):
                    if not isinstance(v, LocalGraph):  # a whole graph: held compact (int32 indices)
                        v = store[k] = v.compact()
                    if self.dtype is not None and self.dtype.is_floating_point:
                        v.cast_scales(self.dtype)

    @property
    def inputs(self) -> dict[str, Any]:
        """The chunk-independent model inputs (graph, features, dropout indices)."""
        return self.step.inputs

    @property
    def regrouped(self) -> bool:
        return self.step.regroup is not None

    @property
    def sampled(self) -> bool:
        """Whether training steps are sampled mini-batches (several per epoch)."""
        return self.step.sampled is not None

    @property
    def steps_per_epoch(self) -> int:
        return self._sampled.steps_per_epoch if self._sampled is not None else 1

    def evaluation(self) -> StepView:
        """The program's own inputs (what evaluation, and training without regrouping, reads)."""
        s = self.step
        return StepView(s.chunk_inputs, tuple(s.chunk_offsets), s.labels, s.masks.get("train"),
                        sizes=s.step_sizes, halos=s.halos)

    def sampled_step(self, epoch: int, step: int) -> StepView:
        """Training step ``step`` of epoch ``epoch`` of a sampled plan: the rank's blocks (graph
        inputs ``g_0 ..``), feature rows, seeds and exchange lists (sampled now, on the CPU, then
        moved: part of the step's time)."""
        st = self._sampled.step(epoch, step)
        if st.dropout_index and mask_generator() == "torch":
            raise RuntimeFailure("this sampled plan replicates dropout masks with the counter-based generator (a "
                                 "mask's rows on their own); GNNCOMPILE_DROPOUT_MASKS=torch draws whole masks: unset "
                                 "it, or plan with dropout='local'")
        if self.device.type != "cpu":
            st = st.to(self.device)
        x = st.x
        if self.dtype is not None and x.dtype != self.dtype:
            x = x.to(self.dtype)
        inputs = {f"g_{k}": b for k, b in enumerate(st.blocks)}
        inputs["x"] = x
        inputs.update(st.dropout_index)
        n = st.seeds.numel()
        train = torch.ones(n, dtype=torch.bool, device=self.device)
        return StepView({0: inputs}, (), st.labels, train, st.seeds, {},
                        halos={f"g_{k}": h for k, h in enumerate(st.halos)}, loss_rows=st.batch_size,
                        train_rows=torch.arange(n, device=self.device))  # every seed is scored

    def training(self, epoch: int) -> StepView:
        """The inputs of training step ``epoch`` (a regrouped epoch's subgraphs, made now: part of
        the step's time and memory)."""
        if self.step.regroup is None:
            return self.evaluation()
        e = self.step.regroup.epoch(epoch, self.device if self.device.type != "cpu" else None)
        self._cast(e.chunk_inputs.values())
        mine = self.evaluation()
        scored = e.owned is not None
        return StepView(e.chunk_inputs, tuple(mine.offsets if e.offsets is None else e.offsets),
                        e.labels if scored else mine.labels, e.train_mask if scored else mine.train_mask,
                        e.owned, {**mine.sizes, **e.sizes}, e.slots)
