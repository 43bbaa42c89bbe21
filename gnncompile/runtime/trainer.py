"""Single-device reference training: the definition of "correct" for every parallel plan.

Full-graph semi-supervised node classification: one forward over the whole graph per epoch,
cross-entropy on the training mask, Adam, accuracy on the train/val/test masks. Every exact plan
must reproduce this loop's losses and gradients; relaxed plans report their distance from it.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..errors import GraphError, RuntimeFailure
from ..frontend.ops import plan_dropout_draws
from ..graph.core import Graph

__all__ = ["History", "ProgressLines", "train", "evaluate", "masked_accuracy"]


@dataclass
class History:
    """Per-epoch record of a training run (one list entry per epoch).

    ``epoch_time`` is the wall time of the training step (forward, backward, optimizer step);
    evaluation time is kept apart in ``eval_time``. ``best_epoch`` is the epoch with the highest
    validation accuracy (first on ties) and ``test_acc_at_best_val`` the test accuracy there: the
    number papers report.
    """

    loss: list[float] = field(default_factory=list)
    train_acc: list[float] = field(default_factory=list)
    val_acc: list[float] = field(default_factory=list)
    test_acc: list[float] = field(default_factory=list)
    epoch_time: list[float] = field(default_factory=list)
    eval_time: list[float] = field(default_factory=list)

    @property
    def epochs(self) -> int:
        return len(self.loss)

    @property
    def best_epoch(self) -> int:
        if not self.val_acc or all(math.isnan(v) for v in self.val_acc):
            return len(self.loss) - 1
        best = max(v for v in self.val_acc if not math.isnan(v))
        return next(i for i, v in enumerate(self.val_acc) if v == best)

    @property
    def best_val_acc(self) -> float:
        return self.val_acc[self.best_epoch] if self.val_acc else math.nan

    @property
    def test_acc_at_best_val(self) -> float:
        return self.test_acc[self.best_epoch] if self.test_acc else math.nan

    @property
    def final_test_acc(self) -> float:
        return self.test_acc[-1] if self.test_acc else math.nan

    def median_epoch_time(self, skip: int = 1) -> float:
        """Median training-step time, skipping the first ``skip`` (warm-up) epochs when possible."""
        ts = self.epoch_time[skip:] if len(self.epoch_time) > skip else self.epoch_time
        if not ts:
            return math.nan
        s = sorted(ts)
        return s[len(s) // 2]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ProgressLines:
    """Plain progress lines for long runs, for a stderr that is not a terminal (a log, CI, a pipe).

    :meth:`update` after each epoch prints one line when at least ``every_s`` seconds have passed
    since the start or the last line, e.g. ``train GCN on cora: epoch 40/200 loss 0.5120 val
    0.774 (10.3 s)``; :meth:`close` prints the last epoch's line if any line was printed before
    it. A run shorter than ``every_s`` prints nothing.
    """

    def __init__(self, total: int, label: str, every_s: float = 10.0, stream: Any = None) -> None:
        self.total, self.label, self.every_s = total, label, every_s
        self.stream = stream
        self.start = self.last = time.monotonic()
        self.printed = 0
        self._pending: Optional[tuple[int, float, float]] = None

    def update(self, epoch: int, loss: float, val_acc: float = math.nan) -> None:
        """Epoch ``epoch`` (0-based) finished with ``loss`` and validation accuracy ``val_acc`` (NaN: not evaluated)."""
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self._print(epoch, loss, val_acc, now)
            self._pending = None
        else:
            self._pending = (epoch, loss, val_acc)

    def close(self) -> None:
        if self.printed and self._pending is not None:
            self._print(*self._pending, time.monotonic())
        self._pending = None

    def _print(self, epoch: int, loss: float, val_acc: float, now: float) -> None:
        val = "-" if math.isnan(val_acc) else f"{val_acc:.3f}"
        stream = self.stream if self.stream is not None else sys.stderr
        print(f"{self.label}: epoch {epoch + 1}/{self.total} loss {loss:.4f} val {val} ({now - self.start:.1f} s)",
              file=stream, flush=True)
        self.last = now
        self.printed += 1


def masked_accuracy(logits: torch.Tensor, y: torch.Tensor, mask: Optional[torch.Tensor]) -> float:
    """Fraction of vertices in ``mask`` whose argmax logit equals the label (NaN for an empty mask)."""
    if mask is None:
        return math.nan
    n = int(mask.sum())
    if n == 0:
        return math.nan
    pred = logits[mask].argmax(dim=-1)
    return float((pred == y[mask]).sum()) / n


def _check_trainable(graph: Graph) -> None:
    if graph.x is None:
        raise GraphError(f"x: graph {graph.name!r} has no node features; training needs them")
    if graph.y is None:
        raise GraphError(f"y: graph {graph.name!r} has no labels; training needs them")
    if graph.train_mask is None or int(graph.train_mask.sum()) == 0:
        raise GraphError(f"train_mask: graph {graph.name!r} has no training vertices")


@torch.no_grad()
def evaluate(model: torch.nn.Module, graph: Graph, x: Optional[torch.Tensor] = None) -> dict[str, float]:
    """Loss and accuracies of ``model`` on ``graph`` in eval mode."""
    was_training = model.training
    model.eval()
    try:
        logits = model(graph, graph.x if x is None else x)
    finally:
        model.train(was_training)
    y = graph.y
    out = {
        "train_acc": masked_accuracy(logits, y, graph.train_mask),
        "val_acc": masked_accuracy(logits, y, graph.val_mask),
        "test_acc": masked_accuracy(logits, y, graph.test_mask),
    }
    out["loss"] = float(F.cross_entropy(logits[graph.train_mask], y[graph.train_mask]))
    return out


def check_training_args(epochs: Any, lr: Any, weight_decay: Any) -> None:
    """Refuse training arguments no run can use (before any work or rank starts): ``epochs`` an
    int >= 0, ``lr`` finite and > 0, ``weight_decay`` finite and >= 0; raises ``ValueError``."""
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"epochs must be an int >= 0, got {epochs!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    if (isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float))
            or not math.isfinite(weight_decay) or weight_decay < 0):
        raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")


def train(
    model: torch.nn.Module,
    graph: Graph,
    epochs: int = 200,
    lr: float = 0.01,
    weight_decay: float = 5e-4,
    *,
    seed: Optional[int] = 0,
    device: str | torch.device = "cpu",
    dtype: Optional[torch.dtype] = None,
    eval_every: int = 1,
    verbose: Optional[bool] = None,
) -> History:
    """Train ``model`` on the whole ``graph`` on one device; the single-device reference.

    Parameters
    ----------
    model:
        A module with ``forward(g, x) -> logits [N, num_classes]``.
    graph:
        A graph with features, labels and a non-empty ``train_mask``.
    epochs, lr, weight_decay:
        Adam hyper-parameters (``torch.optim.Adam(model.parameters(), lr, weight_decay=...)``).
    seed:
        Seeds torch's RNG before training, so dropout masks (and anything else random in the
        forward pass) are reproducible: the same model weights, graph and seed give identical
        histories. The model's initial weights come from its construction: seed before building
        it (``torch.manual_seed``) for fully reproducible runs. ``None`` leaves the RNG alone.
    device, dtype:
        Where and in which floating dtype to train: ``device`` is ``"cpu"``, ``"cuda"``,
        ``"cuda:N"`` or a ``torch.device``; the graph (features, labels, masks and every cached
        structure, :meth:`Graph.to`) and the model (in place, as ``Module.to`` does) move there,
        so the optimizer state lives there too; features are cast to ``dtype`` (default: the
        parameters' dtype). ``"cuda"`` without a GPU raises :class:`~gnncompile.errors.RuntimeFailure`.
    eval_every:
        Evaluate accuracies every this many epochs (NaN in between); the last epoch is always
        evaluated.
    verbose:
        ``None`` (default): a tqdm progress bar when stderr is a terminal, else plain progress
        lines about every 10 s (:class:`ProgressLines`; runs shorter than that print nothing);
        ``True``: the tqdm bar always; ``False``: nothing.

    Returns
    -------
    History
        Loss and accuracies per epoch, and per-epoch step times.
    """
    check_training_args(epochs, lr, weight_decay)
    if eval_every < 1:
        raise ValueError(f"eval_every must be >= 1, got {eval_every}")
    _check_trainable(graph)
    if seed is not None:
        torch.manual_seed(seed)
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeFailure(f"train(device={str(device)!r}): no CUDA GPU is visible (torch.cuda.is_available() "
                                 "is False); train with device='cpu'")
        if device.index is None:  # the current GPU, named, so the graph's and the model's devices compare equal
            device = torch.device("cuda", torch.cuda.current_device())
    if graph.device != device:
        graph = graph.to(device)
    model = model.to(device)
    x = graph.x
    if dtype is not None:
        model = model.to(dtype)
        x = x.to(dtype)
    elif x.layout == torch.strided and x.dtype != next(iter(model.parameters()), x).dtype:
        x = x.to(next(iter(model.parameters())).dtype)
    y, train_mask = graph.y, graph.train_mask
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)

    label = f"train {type(model).__name__} on {graph.name}"
    progress = None
    lines = None
    if verbose or (verbose is None and sys.stderr.isatty()):
        from tqdm.auto import tqdm

        progress = tqdm(total=epochs, desc=label, unit="epoch")
    elif verbose is None:
        lines = ProgressLines(epochs, label)

    # off the CPU, dropout draws its masks as plans do (see plan_dropout_draws)
    draws = contextlib.nullcontext() if device.type == "cpu" else plan_dropout_draws()
    hist = History()
    for epoch in range(epochs):
        model.train()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with draws:
            logits = model(graph, x)
        loss = F.cross_entropy(logits[train_mask], y[train_mask])
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        hist.epoch_time.append(time.perf_counter() - t0)
        hist.loss.append(float(loss.detach()))

        t1 = time.perf_counter()
        if (epoch + 1) % eval_every == 0 or epoch == epochs - 1:
            acc = evaluate(model, graph, x)
            hist.train_acc.append(acc["train_acc"])
            hist.val_acc.append(acc["val_acc"])
            hist.test_acc.append(acc["test_acc"])
        else:
            for lst in (hist.train_acc, hist.val_acc, hist.test_acc):
                lst.append(math.nan)
        hist.eval_time.append(time.perf_counter() - t1)
        if progress is not None:
            progress.update(1)
            progress.set_postfix(loss=f"{hist.loss[-1]:.4f}", val=f"{hist.val_acc[-1]:.3f}")
        if lines is not None:
            lines.update(epoch, hist.loss[-1], hist.val_acc[-1])
    if progress is not None:
        progress.close()
    if lines is not None:
        lines.close()
    return hist
