"""Single-device reference training: the definition of "correct" for every parallel plan.

Full-graph semi-supervised node classification: one forward over the whole graph per epoch,
cross-entropy on the training mask, Adam, accuracy on the train/val/test masks; or sampled
mini-batch training (:mod:`gnncompile.runtime.minibatch`), one step per batch of seeds on its
sampled blocks. Every exact plan must reproduce this loop's losses and gradients (a mini-batch
plan: for the same samples); relaxed plans report their distance from it.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F

from ..errors import ArgumentError, GnnCompileError, GraphError, RuntimeFailure
from ..frontend.blocks import BlockModel
from ..frontend.ops import plan_dropout_draws
from ..graph.core import Graph
from . import checkpoint as ckpt
from ..graph.minibatch import batch_generator, batch_seeds, epoch_order, num_batches
from ..graph.sampling import sample_blocks
from ..graph.shard import slice_rows
from .minibatch import MiniBatch, sampled_logits
from .probe import probe

__all__ = ["History", "ProgressLines", "train", "evaluate", "masked_accuracy"]


@dataclass
class History:
    """Per-epoch record of a training run (one list entry per epoch).

    ``epoch_time`` is the wall time of the training step (forward, backward, optimizer step);
    evaluation time is kept apart in ``eval_time``. Accuracies are measured every ``eval_every``
    epochs (NaN in between) and at the last epoch. ``best_epoch`` is the scheduled evaluation (every
    ``eval_every``-th epoch; the last one's extra evaluation is reported but not chosen, so a run
    continued with ``resume`` chooses as one run straight through) with the highest validation
    accuracy (first on ties) and ``test_acc_at_best_val`` the test accuracy there: the number papers
    report. ``stopped_at``: the epoch after which ``patience`` stopped training
    (``None``: it ran every epoch). :meth:`best_state_dict` gives the parameters at ``best_epoch``
    when the run kept them (``gc.train`` and ``plan.run`` do).
    """

    loss: list[float] = field(default_factory=list)
    train_acc: list[float] = field(default_factory=list)
    val_acc: list[float] = field(default_factory=list)
    test_acc: list[float] = field(default_factory=list)
    epoch_time: list[float] = field(default_factory=list)
    eval_time: list[float] = field(default_factory=list)
    stopped_at: Optional[int] = None
    eval_every: int = 1

    def best_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state (by parameter name) at ``best_epoch``, the epoch of the highest
        validation accuracy: ``model.load_state_dict(history.best_state_dict())`` (``plan.run``
        keeps parameters only: pass ``strict=False`` for a model with buffers). Raises
        :class:`~gnncompile.RuntimeFailure` when no validation accuracy was measured."""
        state = getattr(self, "_best_state", None)
        if state is None:
            raise RuntimeFailure("this history keeps no best parameters: no validation accuracy was measured (the "
                                 "graph has no val_mask) or it was not made by gc.train / plan.run")
        return dict(state)

    @property
    def epochs(self) -> int:
        return len(self.loss)

    @property
    def best_epoch(self) -> int:
        scheduled = [(i, v) for i, v in enumerate(self.val_acc) if (i + 1) % self.eval_every == 0 and not math.isnan(v)]
        if not scheduled:
            return len(self.loss) - 1
        best = max(v for _, v in scheduled)
        return next(i for i, v in scheduled if v == best)

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
        return asdict(self)  # dataclass fields only: the best parameters stay out


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


def _check_logits(logits: Any, model: torch.nn.Module, graph: Graph) -> None:
    """Raise :class:`ArgumentError` unless ``logits`` has a row per vertex of ``graph`` and a column
    per class at least (shapes only: no host synchronization)."""
    shape = list(logits.shape) if isinstance(logits, torch.Tensor) else None
    if shape is None or len(shape) != 2 or shape[0] != graph.num_nodes or shape[1] < graph.num_classes:
        raise ArgumentError(f"model: {type(model).__name__} returned {shape if shape is not None else type(logits).__name__}"
                            f" on {graph.name!r}; training needs logits [{graph.num_nodes}, >= {graph.num_classes}] "
                            f"(a row per vertex, a column per class: labels 0..{graph.num_classes - 1})")


def _first_forward(model: torch.nn.Module, graph: Graph, x: torch.Tensor) -> torch.Tensor:
    """``model(graph, x)``, the first step's forward: a failure raises :class:`ArgumentError`
    naming the model and what it was given (chained to the model's own exception), and the logits
    are checked by :func:`_check_logits`."""
    try:
        logits = model(graph, x)
    except GnnCompileError:
        raise
    except Exception as exc:
        raise ArgumentError(f"model: {type(model).__name__}(g, x) failed on {graph.name!r} ({graph.num_nodes} vertices, "
                            f"{graph.num_edges} edges, x {list(x.shape)} {x.dtype}): {type(exc).__name__}: {exc}"
                            f"{_width_hint(model, x)}") from exc
    _check_logits(logits, model, graph)
    return logits


def _width_hint(model: torch.nn.Module, x: torch.Tensor) -> str:
    """A hint when no linear layer of ``model`` takes ``x``'s width (the usual cause of a first
    forward's shape error: a model built for another graph's features), else ``""``."""
    widths = sorted({m.in_features for m in model.modules() if isinstance(m, torch.nn.Linear)})
    if x.dim() != 2 or not widths or x.shape[1] in widths:
        return ""
    return (f"; the graph has {x.shape[1]} features but the model's linear layers take {widths}: "
            f"build the model with the graph's width (graph.num_features)")


_SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class _Scored:
    """What evaluating on a graph reads of its masks, found once (each a host synchronization on a
    GPU) so that an evaluation needs none: the training rows as indices, their labels, and the
    size of each split (``None``: the graph has no such mask)."""

    train_rows: torch.Tensor
    train_labels: torch.Tensor
    sizes: tuple[Optional[int], ...]

    @staticmethod
    def of(graph: Graph) -> "_Scored":
        mask = graph.train_mask
        rows = (torch.nonzero(mask).flatten() if mask is not None
                else torch.zeros(0, dtype=torch.long, device=graph.y.device))
        sizes = tuple(None if m is None else int(m.sum()) for m in (getattr(graph, f"{k}_mask") for k in _SPLITS))
        return _Scored(rows, graph.y.index_select(0, rows), sizes)


@torch.no_grad()
def _evaluation(model: torch.nn.Module, graph: Graph, x: Optional[torch.Tensor], scored: _Scored) -> torch.Tensor:
    """``model``'s evaluation on ``graph`` in eval mode, on the device, without a host
    synchronization: float64 ``[loss over the training rows, correct predictions on the train, val
    and test rows]`` (0 for a missing mask); :func:`_accuracies` reads it."""
    was_training = model.training
    model.eval()
    try:
        logits = model(graph, graph.x if x is None else x)
    finally:
        model.train(was_training)
    y = graph.y
    out = torch.zeros(4, dtype=torch.float64, device=logits.device)
    if scored.train_rows.numel():
        out[0] = F.cross_entropy(logits.index_select(0, scored.train_rows), scored.train_labels)
    else:
        out[0] = math.nan
    right = logits.argmax(dim=-1) == y
    for i, k in enumerate(_SPLITS):
        mask = getattr(graph, f"{k}_mask")
        if mask is not None:
            out[1 + i] = (right & mask).sum()
    return out


def _accuracies(stats: Sequence[float], scored: _Scored) -> dict[str, float]:
    """:func:`evaluate`'s result from the values of :func:`_evaluation` (read on the host)."""
    out = {f"{k}_acc": stats[1 + i] / n if n else math.nan for i, (k, n) in enumerate(zip(_SPLITS, scored.sizes))}
    out["loss"] = stats[0]
    return out


def evaluate(model: torch.nn.Module, graph: Graph, x: Optional[torch.Tensor] = None) -> dict[str, float]:
    """Loss (cross-entropy over the training rows) and accuracies (train, val, test; NaN for a
    missing or empty mask) of ``model`` on ``graph`` in eval mode."""
    scored = _Scored.of(graph)
    return _accuracies(_evaluation(model, graph, x, scored).tolist(), scored)


_FUSED_DEVICES = ("cpu", "cuda")


def adam(params: Any, lr: float, weight_decay: float) -> torch.optim.Adam:
    """The Adam optimizer every training path here runs (the single-device trainer, the ranks of a
    plan, the test references): torch's fused implementation where every parameter is a floating
    tensor on the CPU or a CUDA device (one pass over each parameter and its moments, no
    parameter-sized temporaries; the cost model assumes it), else torch's default implementation.
    Same update rule as ``torch.optim.Adam(params, lr, weight_decay=...)``, rounding apart."""
    params = list(params)
    fused = bool(params) and all(p.dtype.is_floating_point and p.device.type in _FUSED_DEVICES for p in params)
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay, fused=True if fused else None)


def check_training_args(epochs: Any, lr: Any, weight_decay: Any, patience: Any = None, resume: bool = False,
                        checkpoint_dir: Any = None, *, model: Optional[torch.nn.Module] = None,
                        dtype: Any = None, eval_every: Any = 1, seed: Any = None, device: Any = "cpu") -> None:
    """Refuse training arguments no run can use (before any work or rank starts): ``epochs`` an
    int >= 0, ``lr`` finite and > 0, ``weight_decay`` finite and >= 0, ``patience`` ``None`` or an
    int >= 1, ``eval_every`` an int >= 1, ``checkpoint_dir`` not empty, ``resume`` only with a
    ``checkpoint_dir``, a ``model`` (when given) with a trainable parameter, ``dtype`` ``None`` or
    a floating ``torch.dtype`` (``torch.float32`` or ``torch.float64`` on the CPU, whose kernels
    compute in those only), ``device`` a device name, ``seed`` ``None`` or an int in ``[0, 2^63)`` (what
    gc.plan takes); raises :class:`~gnncompile.ArgumentError` (a ``ValueError``)."""
    if model is not None and not any(p.requires_grad for p in model.parameters()):
        raise ArgumentError(f"model: {type(model).__name__} has no trainable parameters (nothing for Adam to "
                            "update); give it a layer with weights, e.g. gnncompile.nn.GCN")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ArgumentError(f"dtype must be a floating torch.dtype (torch.float32, torch.float64, ...), got {dtype!r}")
    try:
        on_cpu = torch.device(device).type == "cpu"
    except (RuntimeError, TypeError):
        raise ArgumentError(f"device must be a torch.device or its name ('cpu', 'cuda', 'cuda:N'), got {device!r}"
                            ) from None
    if dtype is not None and on_cpu and dtype not in (torch.float32, torch.float64):
        raise ArgumentError(f"dtype must be a floating torch.dtype the CPU kernels compute in (torch.float32 or "
                            f"torch.float64), got {dtype!r}")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ArgumentError(f"epochs must be an int >= 0, got {epochs!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ArgumentError(f"lr must be a finite number > 0, got {lr!r}")
    if (isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float))
            or not math.isfinite(weight_decay) or weight_decay < 0):
        raise ArgumentError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
    if patience is not None and (isinstance(patience, bool) or not isinstance(patience, int) or patience < 1):
        raise ArgumentError(f"patience must be an int >= 1 or None, got {patience!r}")
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1:
        raise ArgumentError(f"eval_every must be an int >= 1, got {eval_every!r}")
    if checkpoint_dir is not None and not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise ArgumentError(f"checkpoint_dir must be a directory path, got {type(checkpoint_dir).__name__}")
    if checkpoint_dir is not None and not os.fspath(checkpoint_dir):  # ("" is the current directory)
        raise ArgumentError("checkpoint_dir is an empty path; give a directory (it is created if missing)")
    if resume and checkpoint_dir is None:
        raise ArgumentError("resume=True needs checkpoint_dir (the directory of the run's checkpoints)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ArgumentError(f"seed must be None or an int in [0, 2^63), got {seed!r}")


def _holding_checkpoint_dir(fn: Callable[..., History]) -> Callable[..., History]:
    """``fn`` (:func:`train`) run with its ``checkpoint_dir`` claimed (:func:`ckpt.claimed`: a second
    run into it meanwhile is refused), once its arguments are checked."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> History:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        check_training_args(a["epochs"], a["lr"], a["weight_decay"], a["patience"], a["resume"], a["checkpoint_dir"],
                            model=a["model"], dtype=a["dtype"], eval_every=a["eval_every"], seed=a["seed"],
                            device=a["device"])
        with ckpt.claimed(a["checkpoint_dir"], a["resume"]):
            return fn(*args, **kwargs)
    return run


@_holding_checkpoint_dir
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
    checkpoint_dir: Optional[str | os.PathLike] = None,
    checkpoint_every: int = 10,
    resume: bool = False,
    patience: Optional[int] = None,
    batch_size: Optional[int] = None,
    fanouts: Optional[Sequence[int]] = None,
    eval_fanouts: Optional[Sequence[int]] = None,
) -> History:
    """Train ``model`` on ``graph`` on one device; the single-device reference.

    Full-graph training by default (one step per epoch); sampled mini-batch training with
    ``batch_size`` and ``fanouts`` (the reference of mini-batch plans).

    Parameters
    ----------
    model:
        A module with ``forward(g, x) -> logits [N, num_classes]``.
    graph:
        A graph with features, labels and a non-empty ``train_mask``.
    epochs, lr, weight_decay:
        Adam hyper-parameters (:func:`adam`: torch's fused Adam with ``lr`` and ``weight_decay``).
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
    checkpoint_dir, checkpoint_every, resume:
        Write a checkpoint (:mod:`gnncompile.runtime.checkpoint`: the model's state, Adam's state,
        torch's random streams, the history) into ``checkpoint_dir`` every ``checkpoint_every``
        epochs and after the last one, and the best-validation state to ``checkpoint_dir/best.pt``;
        ``resume=True`` continues from the newest checkpoint there up to ``epochs`` in total
        (bit-identical to an uninterrupted run on the CPU). A checkpoint of another model (its
        hyperparameters included, e.g. a dropout rate), graph, ``seed``, ``lr`` or ``weight_decay``,
        a damaged one, none at all with ``resume``, or existing ones without it are refused with a
        :class:`~gnncompile.errors.RuntimeFailure` naming what differs. A failed checkpoint write
        raises one too (the previous checkpoint stays valid).
    patience:
        Stop after this many epochs without a higher validation accuracy (``History.stopped_at``).
    batch_size, fanouts, eval_fanouts:
        Sampled mini-batch training (:mod:`gnncompile.runtime.minibatch`): an epoch visits the
        training vertices in a random order in batches of ``batch_size`` seeds, one Adam step per
        batch on the mean cross-entropy of its seeds; each batch runs on blocks sampled with
        ``fanouts`` (in-edges per destination, one per GNN layer, input layer first; ``-1``: all;
        a sequence or a string such as ``"15,10,5"``; normalization from each block's sampled degrees, as PyG on a sampled subgraph). The model
        runs unchanged: it is traced and bound to the blocks
        (:func:`~gnncompile.frontend.blocks.bind_blocks`). Evaluation runs the model on the whole
        graph, or, with ``eval_fanouts``, on blocks sampled with them. ``seed`` also seeds the
        batches' order and samples. ``loss`` is the epoch's mean over its batches (weighted by
        batch size) and ``epoch_time`` the whole epoch's (sampling included).

    Returns
    -------
    History
        Loss and accuracies per epoch, and per-epoch step times; ``best_state_dict()`` gives the
        model's state at the best validation accuracy.
    """
    minibatch = None  # (the arguments were checked by _holding_checkpoint_dir)
    if batch_size is not None or fanouts is not None or eval_fanouts is not None:
        if batch_size is None:
            raise ArgumentError("fanouts / eval_fanouts need batch_size (sampled mini-batch training)")
        minibatch = MiniBatch.of(batch_size, fanouts, eval_fanouts)
    _check_trainable(graph)
    if patience is not None and (graph.val_mask is None or int(graph.val_mask.sum()) == 0):
        raise ArgumentError("patience needs validation vertices (the graph's val_mask is empty)")
    options = None if checkpoint_dir is None else ckpt.CheckpointOptions(str(checkpoint_dir), checkpoint_every,
                                                                           resume)
    if seed is not None:
        torch.manual_seed(seed)
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeFailure(f"train(device={str(device)!r}): no CUDA GPU is visible (torch.cuda.is_available() "
                                 "is False); train with device='cpu'")
        if device.index is None:  # the current GPU, named, so the graph's and the model's devices compare equal
            device = torch.device("cuda", torch.cuda.current_device())
    host = graph if graph.device.type == "cpu" else graph.to("cpu")  # where mini-batches are sampled
    given = graph
    graph = graph.compact()  # what training holds: int32 indices (the caller's graph is not changed)
    if graph.device != device:
        graph = graph.to(device)
    model = model.to(device)
    x = graph.x
    if dtype is not None:
        model = model.to(dtype)
        x = x.to(dtype)
    elif x.dtype != next(iter(model.parameters()), x).dtype:  # dense or sparse CSR features alike
        x = x.to(next(iter(model.parameters())).dtype)
    param = next(iter(model.parameters()), None)
    if graph is not given and param is not None and param.dtype.is_floating_point:
        graph.cast_scales(param.dtype)  # a copy of the caller's graph: scales in the model's dtype only
    y = graph.y
    optimizer = adam(model.parameters(), lr, weight_decay)
    blocks = None
    if minibatch is not None:
        blocks = BlockModel.trace(model, graph, dtype=dtype)
        minibatch.check_layers(blocks.num_layers, type(model).__name__)

    label = f"train {type(model).__name__} on {graph.name}"
    progress = None
    lines = None
    if verbose or (verbose is None and sys.stderr.isatty()):
        from tqdm.auto import tqdm

        progress = tqdm(total=epochs, desc=label, unit="epoch")
    elif verbose is None:
        lines = ProgressLines(epochs, label)

    # dropout draws its masks as plans do (see plan_dropout_draws)
    draws = plan_dropout_draws()
    hist = History(eval_every=eval_every)
    best: dict[str, Any] = {"val": -math.inf, "epoch": None, "state": None}
    start = 0
    fingerprint: dict[str, Any] = {}
    if options is not None:
        fingerprint = _train_fingerprint(model, graph, minibatch, seed=seed, lr=lr, weight_decay=weight_decay,
                                         eval_every=eval_every)
        found = ckpt.prepare(options, fingerprint)
        if found is not None:
            if found.epoch > epochs:
                raise RuntimeFailure(f"checkpoint {found.path} holds {found.epoch} epochs, more than epochs={epochs}; "
                                     f"pass epochs >= {found.epoch} to continue it")
            start = _restore_train(found, model, optimizer, hist, best, device)
    sample_seed = 0 if seed is None else int(seed)
    # what the steps and evaluations read of the masks, found once: a boolean mask finds its rows
    # (nonzero: a host synchronization on a GPU) at every use, in the forward and in the backward
    scored = _Scored.of(graph)
    if minibatch is not None:
        targets = torch.nonzero(host.train_mask).flatten()
    model.train()
    for epoch in range(start, epochs if hist.stopped_at is None else start):
        if not model.training:  # (evaluations restore the mode; a recursive train() per step costs host time)
            model.train()
        t0 = time.perf_counter()
        with probe("step", epoch):  # no host synchronization (tests/test_host_sync.py)
            if minibatch is None:
                optimizer.zero_grad(set_to_none=True)
                with draws:
                    logits = model(graph, x) if epoch != start else _first_forward(model, graph, x)
                loss = F.cross_entropy(logits.index_select(0, scored.train_rows), scored.train_labels)
                loss.backward()
                optimizer.step()
                epoch_loss = loss.detach()  # read with the epoch's metrics
            else:
                epoch_loss = _minibatch_epoch(blocks, host, x, y, targets, minibatch, optimizer, sample_seed, epoch,
                                              draws)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        hist.epoch_time.append(time.perf_counter() - t0)

        with probe("metrics", epoch):
            t1 = time.perf_counter()
            # the last epoch is evaluated off the schedule too: reported, but neither the best
            # parameters nor patience follow it, and checkpoints leave it out, so that a run continued
            # with resume equals one run straight through
            scheduled = (epoch + 1) % eval_every == 0
            evaluated = scheduled or epoch == epochs - 1
            if evaluated and (minibatch is None or minibatch.eval_fanouts is None):
                # the epoch's one host synchronization: its loss and its evaluation, read together
                stats = torch.cat([epoch_loss.to(torch.float64).reshape(1),
                                   _evaluation(model, graph, x, scored)]).tolist()
                hist.loss.append(stats[0])
                acc = _accuracies(stats[1:], scored)
            else:
                hist.loss.append(epoch_loss.item())
                acc = _sampled_evaluation(blocks, host, x, minibatch, sample_seed, epoch) if evaluated else None
            for k in ("train_acc", "val_acc", "test_acc"):
                getattr(hist, k).append(math.nan if acc is None else acc[k])
            hist.eval_time.append(time.perf_counter() - t1)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{hist.loss[-1]:.4f}", val=f"{hist.val_acc[-1]:.3f}")
            if lines is not None:
                lines.update(epoch, hist.loss[-1], hist.val_acc[-1])
            val = hist.val_acc[-1] if scheduled else math.nan
            if not math.isnan(val) and val > best["val"]:
                best.update(val=val, epoch=epoch,
                            state={k: v.detach().clone() for k, v in model.state_dict().items()})
            if patience is not None and not math.isnan(val) and \
                    epoch - (-1 if best["epoch"] is None else best["epoch"]) >= patience:
                hist.stopped_at = epoch
            if options is not None and ((epoch + 1) % options.every == 0 or epoch == epochs - 1
                                        or hist.stopped_at is not None):
                _save_train(options, epoch + 1, model, optimizer,
                            hist if scheduled else History(**off_schedule_dropped(hist.to_dict())),
                            best, fingerprint, device)
        if hist.stopped_at is not None:
            break
    if progress is not None:
        progress.close()
    if lines is not None:
        lines.close()
    if best["epoch"] is None and hist.val_acc and not math.isnan(hist.val_acc[-1]):
        # no scheduled evaluation (eval_every > epochs): the last one's parameters are the best
        best.update(val=hist.val_acc[-1], epoch=len(hist.val_acc) - 1,
                    state={k: v.detach().clone() for k, v in model.state_dict().items()})
    if best["state"] is not None:
        hist._best_state = best["state"]
        if options is not None:
            ckpt.write_best(options.directory, best["state"], best["epoch"], best["val"])
    return hist


def _minibatch_epoch(model: BlockModel, host: Graph, x: torch.Tensor, y: torch.Tensor, targets: torch.Tensor,
                     mb: MiniBatch, optimizer: torch.optim.Optimizer, seed: int, epoch: int, draws: Any
                     ) -> torch.Tensor:
    """One epoch of sampled mini-batch steps (sampled from ``host``, the graph on the CPU, with the
    batches and streams of :mod:`gnncompile.graph.minibatch`); returns the mean loss over its seeds,
    a float64 scalar on the device (summed there, not read after each step: no host synchronization)."""
    total, seen = torch.zeros((), dtype=torch.float64, device=x.device), 0
    norms = model.norms
    order = epoch_order(targets, seed, epoch)
    for step in range(num_batches(targets.numel(), mb.batch_size)):
        seeds = batch_seeds(order, mb.batch_size, step)
        batch = sample_blocks(host, seeds, mb.fanouts, generator=batch_generator(seed, epoch, step), norms=norms)
        batch = batch.to(x.device)
        optimizer.zero_grad(set_to_none=True)
        with draws:
            logits = model(batch.blocks, slice_rows(x, batch.input_ids))
        loss = F.cross_entropy(logits, y.index_select(0, seeds.to(y.device)))
        loss.backward()
        optimizer.step()
        total += loss.detach().double() * seeds.numel()  # float(loss) * n, in the same float64 arithmetic
        seen += seeds.numel()
    return total / seen


def _sampled_evaluation(model: BlockModel, host: Graph, x: torch.Tensor, mb: MiniBatch, seed: int,
                        epoch: int) -> dict[str, float]:
    """Accuracies on the train/val/test vertices from blocks sampled with ``eval_fanouts``."""
    assert mb.eval_fanouts is not None
    was_training = model.module.training
    model.module.eval()
    out: dict[str, float] = {}
    try:
        for split in ("train", "val", "test"):
            mask = getattr(host, f"{split}_mask")
            ids = None if mask is None else torch.nonzero(mask).flatten()
            if ids is None or ids.numel() == 0:
                out[f"{split}_acc"] = math.nan
                continue
            logits = sampled_logits(model, host, x, ids, mb.eval_fanouts, mb.batch_size, seed, epoch, model.norms)
            labels = host.y.index_select(0, ids).to(logits.device)
            out[f"{split}_acc"] = float((logits.argmax(-1) == labels).sum()) / ids.numel()
            if split == "train":
                out["loss"] = float(F.cross_entropy(logits, labels))
    finally:
        model.module.train(was_training)
    return out


def off_schedule_dropped(history: dict[str, Any]) -> dict[str, Any]:
    """``history`` (:meth:`History.to_dict`'s columns, or a rank's) with its last epoch's accuracies
    NaN: an evaluation off the ``eval_every`` schedule, which checkpoints leave out (:func:`train`,
    ``plan.run``)."""
    return {k: v[:-1] + [math.nan] if k.endswith("_acc") else v for k, v in history.items()}


def _train_fingerprint(model: torch.nn.Module, graph: Graph, minibatch: Optional[MiniBatch] = None, *,
                       seed: Optional[int] = None, lr: float = 0.01, weight_decay: float = 5e-4,
                       eval_every: int = 1) -> dict[str, Any]:
    """What a checkpoint of :func:`train` must match: the model (class, state names, shapes,
    dtypes, and its other hyperparameters, e.g. dropout rates: :func:`ckpt.module_signature`), the
    graph (name, sizes, a hash of its structure and one of its features, labels and masks), the run (single device; the mini-batches' size
    and fanouts: a step's batch and sample follow from them, the seed, the epoch and the step, so
    nothing else of the sampler is saved) and the training settings (``seed``, ``lr``,
    ``weight_decay``, ``eval_every``: the epochs whose evaluations choose the best)."""
    plan: dict[str, Any] = {"strategy": "single-device", "ranks": 1}
    if minibatch is not None:
        plan["minibatch"] = {"batch_size": minibatch.batch_size, "fanouts": list(minibatch.fanouts),
                             "eval_fanouts": None if minibatch.eval_fanouts is None else list(minibatch.eval_fanouts)}
    return {"model": {"class": type(model).__name__,
                      "params": [[k, list(v.shape), str(v.dtype)] for k, v in model.state_dict().items()],
                      "modules": ckpt.module_signature(model)},
            "graph": {"name": graph.name, "num_nodes": int(graph.num_nodes), "num_edges": int(graph.num_edges),
                      "features": int(graph.x.shape[-1]), "structure": ckpt.tensor_hash(graph.indptr, graph.indices),
                      "data": graph.data_hash()},
            "plan": plan,
            "training": {"seed": None if seed is None else int(seed), "lr": float(lr),
                         "weight_decay": float(weight_decay), "eval_every": int(eval_every)}}


def _save_train(options: ckpt.CheckpointOptions, done: int, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, hist: History, best: dict, fingerprint: dict,
                device: torch.device) -> None:
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"params/{k}": v for k, v in model.state_dict().items()}
    for p, st in optimizer.state.items():
        for f, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"optim/{names[id(p)]}/{f}"] = v
    if best["state"] is not None:
        tensors.update({f"best/{k}": v for k, v in best["state"].items()})
    tensors["rank0/rng/cpu"] = torch.get_rng_state()
    if device.type == "cuda":
        tensors["rank0/rng/cuda"] = torch.cuda.get_rng_state(device)
    meta = {"history": hist.to_dict(), "best_epoch": best["epoch"],
            "best_val": best["val"] if best["epoch"] is not None else None, "fingerprint": fingerprint}
    ckpt.save(options, done, tensors, rank=0, meta=lambda: meta, distributed=False)


def _restore_train(found: ckpt.Checkpoint, model: torch.nn.Module, optimizer: torch.optim.Optimizer, hist: History,
                   best: dict, device: torch.device) -> int:
    """Load a :func:`train` checkpoint into the model, the optimizer, torch's generators, ``hist``
    and ``best``; returns the epoch to continue from."""
    t = ckpt.load_tensors(found.path, lambda k: True, distributed=False)
    model.load_state_dict({k[len("params/"):]: v for k, v in t.items() if k.startswith("params/")})
    for n, p in model.named_parameters():
        state = {k.rsplit("/", 1)[1]: v for k, v in t.items() if k.startswith(f"optim/{n}/")}
        if state:
            ckpt.set_optimizer_state(optimizer, p, state, device)
    saved = found.meta["history"]
    for f in ("loss", "train_acc", "val_acc", "test_acc", "epoch_time", "eval_time"):
        setattr(hist, f, list(saved[f]))
    hist.stopped_at = saved.get("stopped_at")   # a run early stopping ended stays ended
    if found.meta.get("best_epoch") is not None:
        best.update(val=found.meta["best_val"], epoch=found.meta["best_epoch"],
                    state={k[len("best/"):]: v.to(device) for k, v in t.items() if k.startswith("best/")})
    torch.set_rng_state(t["rank0/rng/cpu"])
    if device.type == "cuda" and "rank0/rng/cuda" in t:
        torch.cuda.set_rng_state(t["rank0/rng/cuda"], device)
    return found.epoch
