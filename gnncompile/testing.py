"""``check_plan``: the one helper that checks a plan preserves the model (used by every strategy's tests).
With ``batch_size`` and ``fanouts`` (sampled mini-batch plans) the reference step is the first
mini-batch's, on the same sample: the whole batch for ``split``, the ranks' micro-batches for
mini-batch ``data`` (:func:`sampled_reference_step`).
``check_trace``: the same for tracing: the traced graph equals the eager model in both modes.
``count_host_syncs`` / ``forbid_host_syncs``: the operations of a block that would make the host wait
for a GPU, seen on any device; ``train_host_syncs`` / ``plan_host_syncs`` count them in the
steady-state epochs of :func:`gnncompile.train` and of a plan's ranks (tests/test_host_sync.py).

``check_plan`` runs one training step of the single-device reference (:func:`gnncompile.train`'s step: Adam,
cross-entropy over the training mask) and one step of the plan on its ranks, and compares the loss,
the logits of the forward, every parameter gradient, and every parameter after the optimizer step,
with explicit tolerances. Plans are verified first (when the plan verifier is available).
"""

from __future__ import annotations

import contextlib
import copy
import fnmatch
import os
import sys
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .errors import ArgumentError
from .frontend.blocks import BlockModel
from .frontend.ops import plan_dropout_draws
from .graph.core import Graph
from .graph.minibatch import SampledSteps
from .graph.shard import slice_rows
from .runtime.probe import PHASES, probing
from .runtime.trainer import _first_forward, adam

__all__ = ["ReferenceStep", "reference_step", "sampled_reference_step", "check_plan", "check_trace", "HostSync",
           "HostSyncs", "HostSyncError", "count_host_syncs", "forbid_host_syncs", "train_host_syncs",
           "plan_host_syncs"]


@dataclass
class ReferenceStep:
    loss: float
    logits: torch.Tensor
    grads: dict[str, Optional[torch.Tensor]]
    params_after: dict[str, torch.Tensor]


def _features_for(model: torch.nn.Module, graph: Graph) -> torch.Tensor:
    """``graph.x`` in the dtype of ``model``'s first parameter, as :func:`gnncompile.train` feeds it."""
    x = graph.x
    first = next(iter(model.parameters()), None)
    if first is not None and first.dtype.is_floating_point and x.dtype != first.dtype:
        x = x.to(first.dtype)
    return x


def reference_step(model: torch.nn.Module, graph: Graph, lr: float = 0.01, weight_decay: float = 5e-4,
                   seed: int = 0) -> ReferenceStep:
    """One step of the single-device reference on ``model`` (which it updates), on the device of
    ``graph`` and ``model``; dropout draws its masks as plans do (as :func:`gnncompile.train`)."""
    torch.manual_seed(seed)
    model.train()
    params = dict(model.named_parameters())
    x = _features_for(model, graph)
    opt = adam(model.parameters(), lr, weight_decay)
    opt.zero_grad(set_to_none=True)
    with plan_dropout_draws():
        logits = _first_forward(model, graph, x)  # (a failing forward is an ArgumentError naming the model)
    loss = F.cross_entropy(logits[graph.train_mask], graph.y[graph.train_mask])
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in params.items()}
    opt.step()
    return ReferenceStep(float(loss.detach()), logits.detach(), grads,
                         {n: p.detach().clone() for n, p in params.items()})


def sampled_reference_step(model: torch.nn.Module, graph: Graph, batch_size: int, fanouts: Any, *, ranks: int = 1,
                           micro: bool = False, lr: float = 0.01, weight_decay: float = 5e-4,
                           seed: int = 0) -> tuple[ReferenceStep, torch.Tensor]:
    """One single-device step on the first mini-batch of a sampled plan run with ``seed`` (which
    seeds torch and draws the mini-batches, as in a run), on the CPU: the whole batch's blocks, or with ``micro`` the ``ranks`` micro-batches of
    mini-batch data parallelism (the loss: their cross-entropy sums over the batch's seeds).
    Returns the step (logits at the seeds) and the seeds' global ids; dropout draws its masks as
    plans do (as :func:`gnncompile.train`)."""
    torch.manual_seed(seed)
    model.train()
    bound = BlockModel.trace(model, graph)
    targets = torch.nonzero(graph.train_mask).flatten()
    sources = [SampledSteps(graph, targets, batch_size, tuple(fanouts), seed, tuple(bound.norms), r, ranks)
               for r in range(ranks if micro else 1)]
    params = dict(model.named_parameters())
    opt = adam(model.parameters(), lr, weight_decay)
    opt.zero_grad(set_to_none=True)
    loss, outs, ids = 0.0, [], []
    for src in sources:
        if micro:
            st = src.step(0, 0)
            blocks, x, seeds, total = st.blocks, st.x, st.seeds, st.batch_size
        else:
            b = src.sample(0, 0)
            blocks, seeds, total = b.blocks, b.seed_ids, b.seed_ids.numel()
            x = slice_rows(graph.x, b.input_ids)
        with plan_dropout_draws():
            out = bound(blocks, x.to(next(iter(params.values())).dtype) if x.layout == torch.strided else x)
        loss = loss + F.cross_entropy(out, graph.y.index_select(0, seeds), reduction="sum") / total
        outs.append(out.detach())
        ids.append(seeds)
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in params.items()}
    opt.step()
    return (ReferenceStep(float(loss.detach()), torch.cat(outs), grads,
                          {n: p.detach().clone() for n, p in params.items()}), torch.cat(ids))


def check_plan(model: torch.nn.Module, graph: Graph, gpus: int, *, rtol: float = 1e-9, atol: float = 1e-11,
               lr: float = 0.01, weight_decay: float = 5e-4, seed: int = 0, timeout: float = 120.0,
               device: Optional[str] = None, **plan_options: Any) -> Any:
    """Plan ``model`` (a copy) on ``gpus`` ranks, run one step, and compare with the reference step.

    ``device``: where the ranks compute (``plan.run``'s ``device``); ``None``: ``$GNNCOMPILE_DEVICE``
    if set, else CUDA when available (ranks share the GPUs), else the CPU. The reference step runs on the same kind of device.
    Dropout masks are replicated only under ``dropout="replicated"`` plans; other plans need a model
    without dropout (or ``p=0``). Raises ``AssertionError`` naming the first quantity that differs;
    returns the run's result.
    """
    from .api import plan as make_plan

    if device is None:
        device = os.environ.get("GNNCOMPILE_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    ref_model = copy.deepcopy(model)
    plan_model = copy.deepcopy(model)
    seeds = None
    if plan_options.get("batch_size") is not None:  # sampled: the first mini-batch, on the CPU
        if device != "cpu":
            raise ArgumentError("check_plan of a sampled plan compares on the CPU (device='cpu')")
        train = int(graph.train_mask.sum()) if graph.train_mask is not None else 0
        if plan_options["batch_size"] < train:
            raise ArgumentError(f"check_plan compares one step: a sampled plan's epoch must be one mini-batch "
                                f"(batch_size >= the {train} training vertices), got batch_size="
                                f"{plan_options['batch_size']} (its history is the mean over the epoch's steps)")
        ref, seeds = sampled_reference_step(ref_model, graph, plan_options["batch_size"], plan_options["fanouts"],
                                            ranks=gpus, micro=plan_options.get("strategy") == "data", lr=lr,
                                            weight_decay=weight_decay, seed=seed)
    else:
        ref = reference_step(ref_model.to(device), graph.to(device), lr, weight_decay, seed)
    ref = ReferenceStep(ref.loss, ref.logits.cpu(), {n: None if g is None else g.cpu() for n, g in ref.grads.items()},
                        {n: p.cpu() for n, p in ref.params_after.items()})
    p = make_plan(plan_model, graph, gpus=gpus, **plan_options)
    try:
        from .ir.verify_plan import verify_plan
    except ImportError:  # pragma: no cover - the verifier ships with the plan IR
        verify_plan = None
    if verify_plan is not None:
        verify_plan(p)
    res = p.run(epochs=1, lr=lr, weight_decay=weight_decay, seed=seed, capture=True, timeout=timeout, device=device)
    tol = dict(rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.tensor(res.history.loss[0], dtype=torch.float64),
                               torch.tensor(ref.loss, dtype=torch.float64), **tol, msg=lambda m: f"loss: {m}")
    logits = res.captured["logits"] if seeds is None else res.captured["logits"][seeds]
    torch.testing.assert_close(logits, ref.logits, **tol, msg=lambda m: f"logits: {m}")
    for name, g_ref in ref.grads.items():
        g = res.captured["grads"].get(name)
        if g_ref is None:
            assert g is None, f"gradient of {name}: the reference has none, the plan {'zeros' if not bool(g.any()) else 'values'}"
            continue
        assert g is not None, f"gradient of {name}: the plan produced none"
        torch.testing.assert_close(g, g_ref, **tol, msg=lambda m, name=name: f"gradient of {name}: {m}")
    # The parameters after the step must be Adam's step from the initial parameters with the plan's
    # gradients (checked equal to the reference's above). Comparing them with the reference's
    # parameters instead is ill-conditioned: Adam's first step is lr * g / (|g| + eps), so where a
    # gradient is near eps (1e-8) a float64 reassociation difference of 1e-17 in g moves the
    # parameter by ~1e-11.
    expected = _adam_step(model, {n: res.captured["grads"].get(n) for n in ref.params_after}, lr, weight_decay)
    after = dict(plan_model.named_parameters())
    for name, p_exp in expected.items():
        torch.testing.assert_close(after[name].detach(), p_exp, **tol,
                                   msg=lambda m, name=name: f"parameter {name} after the step: {m}")
    return res


def _adam_step(model: torch.nn.Module, grads: dict[str, Optional[torch.Tensor]], lr: float,
               weight_decay: float) -> dict[str, torch.Tensor]:
    """The parameters of ``model`` (not modified) after one step of the reference's Adam with ``grads``."""
    params = {n: p.detach().cpu().clone().requires_grad_(p.requires_grad) for n, p in model.named_parameters()}
    for n, p in params.items():
        g = grads.get(n)
        p.grad = None if g is None else g.detach().to(p.dtype).clone()
    adam(params.values(), lr, weight_decay).step()
    return {n: p.detach() for n, p in params.items()}


def _forward_and_grads(module: torch.nn.Module, graph: Graph, x: torch.Tensor, seed: int
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and parameter gradients for a fixed upstream gradient, torch's RNG seeded with ``seed``."""
    torch.manual_seed(seed)
    # masks drawn as plans and gnncompile.train draw them, in a recomputing replay too
    with plan_dropout_draws():
        out = module(graph, x)
        up = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=out.dtype)
        params = dict(module.named_parameters())
        got = torch.autograd.grad(out, list(params.values()), up, allow_unused=True)
    return out.detach(), {k: torch.zeros_like(p) if g is None else g for (k, p), g in zip(params.items(), got)}


def check_trace(model: torch.nn.Module, graph: Graph, *, seed: int = 0, rtol: float = 0.0, atol: float = 0.0,
                grad_rtol: float = 1e-12, grad_atol: float = 1e-12) -> Any:
    """Trace ``model`` (in its current mode) and check the TPGraph against it in both modes.

    Checks that tracing leaves every module's mode unchanged and that the TPGraph starts in the
    model's modes; then, in eval mode, then training mode, then eval mode again, that the traced
    module's output (``rtol``/``atol``, exact by default: the same ops run in the same order) and
    parameter gradients equal the eager model's, with torch's RNG seeded alike (training mode draws
    the same dropout masks). Eval comes first because training-mode runs move BatchNorm running
    statistics, which the trace shares with the model. The model's modes are restored at the end
    (its parameters keep their values: nothing steps an optimizer); the traced graph is verified.
    Raises ``AssertionError`` naming what differs; returns the TPGraph (in the model's modes).
    """
    from .frontend.tracer import trace
    from .ir.verify import verify

    modes = {name: m.training for name, m in model.named_modules()}
    tp = verify(trace(model, graph))
    now = {name: m.training for name, m in model.named_modules()}
    assert now == modes, f"tracing changed the model's modes: {sorted(k for k in modes if modes[k] != now[k])}"
    mine = {name: m.training for name, m in tp.named_modules()}
    assert all(mine[k] == v for k, v in modes.items() if k in mine), "the trace does not start in the model's modes"
    x = _features_for(model, graph)
    for step, training in enumerate((False, True, False)):
        tp.train(training)
        model.train(training)
        what = "training mode (same seed)" if training else "eval mode"
        out_t, grads_t = _forward_and_grads(tp, graph, x, seed + step)
        out_e, grads_e = _forward_and_grads(model, graph, x, seed + step)
        torch.testing.assert_close(out_t, out_e, rtol=rtol, atol=atol, msg=lambda m, w=what: f"{w}: output: {m}")
        for name, g_e in grads_e.items():
            torch.testing.assert_close(grads_t[name], g_e, rtol=grad_rtol, atol=grad_atol,
                                       msg=lambda m, w=what, n=name: f"{w}: gradient of {n}: {m}")
    for module in (model, tp):
        for name, m in module.named_modules():
            m.training = modes.get(name, model.training)
    return tp


# --------------------------------------------------------------------------- host synchronizations
#: ATen ops that make the host wait for a CUDA device whatever their arguments: a scalar read
#: (``item``, ``bool``, ``int``, ``float``, ``if t:`` and ``allclose`` all end in
#: ``_local_scalar_dense``), an output whose size depends on the values (``nonzero``, ``unique``,
#: ``masked_select``, ``bincount``, coalescing, dense -> sparse), a comparison returning a Python
#: bool (``equal``), and sparse invariant checks
_SYNC_OPS: dict[str, str] = {
    "_local_scalar_dense": "scalar read (item / bool / int / float / if on a tensor)",
    "is_nonzero": "scalar read (bool of a tensor)",
    "item": "scalar read (item)",
    "equal": "torch.equal",
    "allclose": "torch.allclose",
    "nonzero": "nonzero (output size from the values)",
    "argwhere": "argwhere (output size from the values)",
    "masked_select": "masked_select (output size from the mask)",
    "_unique": "unique", "_unique2": "unique", "unique_dim": "unique", "unique_consecutive": "unique_consecutive",
    "unique_dim_consecutive": "unique_consecutive",
    "bincount": "bincount (size from the maximum)",
    "histc": "histc",
    "_coalesce": "sparse coalesce", "_to_sparse": "dense -> sparse", "_to_sparse_csr": "dense -> sparse CSR",
    "_to_sparse_csc": "dense -> sparse", "_to_sparse_bsr": "dense -> sparse", "_to_sparse_bsc": "dense -> sparse",
    "_validate_sparse_csr_tensor_args": "sparse invariant check",
    "_validate_sparse_coo_tensor_args": "sparse invariant check",
    "_validate_compressed_sparse_indices": "sparse invariant check",
}


@dataclass(frozen=True)
class HostSync:
    """One operation that would make the host wait for a CUDA device: ``op`` (the ATen op or tensor
    method and what it is), ``where`` (the innermost calling frame in gnncompile, ``path:line in
    function``; the innermost frame outside the detector when no gnncompile frame calls it) and
    ``stack`` (up to eight calling frames outside torch's dispatch machinery, innermost first)."""

    op: str
    where: str
    stack: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.op} at {self.where}"


class HostSyncs(list):
    """The :class:`HostSync` records of one :func:`count_host_syncs` block, in the order they ran."""

    def report(self) -> str:
        """One line per distinct ``op at where`` with its count, then the first record's stack."""
        if not self:
            return "no host synchronizations"
        counts: dict[str, int] = {}
        first: dict[str, HostSync] = {}
        for s in self:
            counts[str(s)] = counts.get(str(s), 0) + 1
            first.setdefault(str(s), s)
        return "\n".join(f"{n}x {k}\n    " + "\n    ".join(first[k].stack) for k, n in counts.items())


class HostSyncError(AssertionError):
    """:func:`forbid_host_syncs` found host synchronizations its allowlist does not name (``syncs``)."""

    def __init__(self, message: str, syncs: HostSyncs) -> None:
        super().__init__(message)
        self.syncs = syncs


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_STACK_DEPTH = 8


def _frame_text(frame: Any) -> str:
    """``path:line in function`` of ``frame``; the path from torch's parent directory, else from
    gnncompile's (``gnncompile/...``, and in a source checkout ``tests/...``), else absolute."""
    path = os.path.abspath(frame.f_code.co_filename)
    for root in (_TORCH_DIR, _PACKAGE_DIR):
        if path.startswith(os.path.dirname(root) + os.sep):
            path = os.path.relpath(path, os.path.dirname(root))
            break
    return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"


_MACHINERY = ("torch/utils/_python_dispatch.py", "torch/overrides.py", "torch/_ops.py", "torch/_dynamo/eval_frame.py",
              "torch/_compile.py", "torch/_jit_internal.py")
_DETECTOR_FUNCTIONS = frozenset({"_caller", "record", "__torch_dispatch__", "__torch_function__"})


def _caller() -> tuple[str, tuple[str, ...]]:
    """``where`` and ``stack`` of a :class:`HostSync` recorded now (the detector's own frames and
    torch's dispatch machinery left out)."""
    here = os.path.abspath(__file__)
    frame = sys._getframe(1)
    stack: list[str] = []
    where = outside = None
    while frame is not None and (where is None or len(stack) < _STACK_DEPTH):
        code = frame.f_code
        path = os.path.abspath(code.co_filename)
        mine = path == here and code.co_name in _DETECTOR_FUNCTIONS
        if not mine and not path.endswith(_MACHINERY):
            text = _frame_text(frame)
            if len(stack) < _STACK_DEPTH:
                stack.append(text)
            if where is None and path.startswith(_PACKAGE_DIR + os.sep):
                where = text
            if outside is None and not path.startswith(_TORCH_DIR + os.sep):
                outside = text
        frame = frame.f_back
    return (where or outside or (stack[0] if stack else "?")), tuple(stack)


def _op_name(func: Any) -> str:
    """An ATen op's name without its namespace and overload (``""`` for what has no schema)."""
    schema = getattr(func, "_schema", None)
    return "" if schema is None else schema.name.split("::", 1)[-1]


def _is_bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _sync_of(func: Any, args: tuple, kwargs: dict) -> Optional[str]:
    """What makes ATen op ``func`` with these arguments synchronize a CUDA device (``None``: nothing)."""
    name = _op_name(func)
    if name in _SYNC_OPS:
        return f"aten.{name}: {_SYNC_OPS[name]}"
    if func is torch.ops.aten.repeat_interleave.Tensor:  # its other overloads become this one or expand
        return None if kwargs.get("output_size") is not None else \
            "aten.repeat_interleave without output_size (output size from the repeats)"
    if name == "index":  # t[mask]: the mask becomes indices (nonzero)
        return "aten.index with a boolean mask (t[mask]; output size from the mask)" \
            if _is_bool_index(args[1] if len(args) > 1 else kwargs.get("indices")) else None
    if name in ("index_put", "index_put_", "_index_put_impl_"):  # t[mask] = v, unless torch fills it in place
        value = args[2] if len(args) > 2 else kwargs.get("values")
        if _is_bool_index(args[1] if len(args) > 1 else kwargs.get("indices")) \
                and not (isinstance(value, torch.Tensor) and value.numel() == 1):
            return "aten.index_put with a boolean mask (t[mask] = v; nonzero of the mask)"
    return None


def _copy_sync(func: Any, args: tuple, kwargs: dict) -> Optional[str]:
    """What makes a copy between devices synchronize (seen only where there is a device: on the CPU
    every copy stays on the host): device -> host always, host -> device unless ``non_blocking``."""
    name = _op_name(func)
    if name == "_to_copy":
        src, dst = args[0].device, kwargs.get("device")
    elif name == "copy_":
        dst, src = args[0].device, args[1].device if isinstance(args[1], torch.Tensor) else None
    else:
        return None
    if src is None or dst is None or torch.device(dst).type == src.type:
        return None
    if torch.device(dst).type == "cpu":
        return f"aten.{name}: device -> host copy"
    blocking = not (kwargs.get("non_blocking") or (name == "copy_" and len(args) > 2 and args[2]))
    return f"aten.{name}: blocking host -> device copy" if blocking else None


#: torch functions that make a tensor; given no ``device`` they make it on the host on every device
_FACTORIES = frozenset(getattr(torch, n) for n in (
    "tensor", "as_tensor", "arange", "range", "linspace", "logspace", "zeros", "ones", "empty", "full", "eye", "rand",
    "randn", "randint", "randperm", "bernoulli", "normal", "scalar_tensor", "from_numpy") if hasattr(torch, n))


class _Recorder:
    """The state of one :func:`count_host_syncs` block: its records and the host tensors it made
    (by ``id``, with a weak reference that drops the entry when the tensor dies; a tensor is not
    hashed by value, which would compare tensors)."""

    def __init__(self, out: HostSyncs) -> None:
        self.out = out
        self.host: dict[int, weakref.ref] = {}
        self.quiet = 0  # > 0: inside a copy recorded by the function mode

    def record(self, what: str) -> None:
        self.out.append(HostSync(what, *_caller()))

    @contextlib.contextmanager
    def copies_recorded(self) -> Iterator[None]:
        """A block whose copies between devices are recorded already (by the tensor method that makes them)."""
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self.host.get(id(t))
        return ref is not None and ref() is t

    def mark_host(self, value: Any) -> None:
        for t in _tensors(value):
            key = id(t)
            self.host[key] = weakref.ref(t, lambda _, key=key, host=self.host: host.pop(key, None))


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


class _SyncDispatchMode(TorchDispatchMode):
    """Records the ATen ops :func:`_sync_of` and :func:`_copy_sync` name (see :func:`count_host_syncs`),
    except on host tensors alone; what is computed from host tensors alone is a host tensor."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        host = bool(inputs) and all(self.rec.is_host(t) for t in inputs)
        what = None if host else (_sync_of(func, args, kwargs)
                                  or (None if self.rec.quiet else _copy_sync(func, args, kwargs)))
        if what is not None:
            self.rec.record(what)
        out = func(*args, **kwargs)
        if host:
            self.rec.mark_host(out)
        return out


def _target_device(args: tuple, kwargs: dict) -> Any:
    """The device ``Tensor.to(*args, **kwargs)`` names (``args`` after the tensor): a string, a
    ``torch.device`` or a tensor's device; ``None`` when it names none."""
    for a in (*args, kwargs.get("device")):
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (str, torch.device)):
            return a
    return None


def _names_host(device: Any) -> bool:
    """Whether ``device`` is the host spelled as a string (``"cpu"``): code that means the host
    writes it so, while a ``torch.device`` (``x.device``, ``ctx.device``) is the run's device, the
    CPU only on a CPU run."""
    return isinstance(device, str) and device.split(":")[0] == "cpu"


class _SyncFunctionMode(TorchFunctionMode):
    """Records the copies between host and device that ATen does not show on the CPU (there
    ``.cpu()`` of a CPU tensor dispatches nothing), and marks the tensors made on the host: by a
    factory given no device, and by ``.cpu()`` of another tensor.

    Device -> host: ``.cpu()``, ``.tolist()``, ``.to("cpu")`` of a tensor not made on the host;
    host -> device (blocking): ``.to(device)`` of a host tensor to a device given as a
    ``torch.device`` or a tensor (not ``"cpu"``: see :func:`_names_host`) without
    ``non_blocking=True``, and ``torch.tensor(data, device=...)`` of such a device."""

    def __init__(self, rec: _Recorder) -> None:
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        what = None
        on_host = bool(args) and isinstance(args[0], torch.Tensor) and self.rec.is_host(args[0])
        if func is torch.Tensor.cpu and not on_host:
            what = "Tensor.cpu: device -> host copy"
        elif func is torch.Tensor.tolist and not on_host:
            what = "Tensor.tolist: device -> host copy"
        elif func is torch.Tensor.to:
            device = _target_device(args[1:], kwargs)
            if device is not None and not on_host and _names_host(device):
                what = "Tensor.to('cpu'): device -> host copy"
            elif device is not None and on_host and not _names_host(device) and not kwargs.get("non_blocking"):
                what = "Tensor.to(device) of a host tensor: blocking host -> device copy"
        elif func is torch.tensor and kwargs.get("device") is not None and not _names_host(kwargs["device"]) \
                and not _tensors(args):
            what = "torch.tensor(data, device=): blocking host -> device copy"
        if what is None:
            out = func(*args, **kwargs)
        else:
            self.rec.record(what)
            with self.rec.copies_recorded():  # ATen's copy of it (where there is a device) is this one
                out = func(*args, **kwargs)
        if (func is torch.Tensor.cpu and out is not args[0]) or (func in _FACTORIES and kwargs.get("device") is None
                                                                 and not any(isinstance(a, (str, torch.device))
                                                                             for a in args)
                                                                 and not _tensors(args)):
            self.rec.mark_host(out)
        return out


@contextlib.contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Record every operation in the block that would make the host wait for a CUDA device (a host
    synchronization), on any device, the CPU included: yields a :class:`HostSyncs` list that fills
    as the block runs, one :class:`HostSync` (op, gnncompile caller, short stack) per operation.
    On the CPU every tensor stands for a device tensor, except those the block makes on the host
    (a factory given no device, e.g. ``torch.randint(...)``, ``torch.tensor([...])``; ``.cpu()`` of
    a device tensor) and what it computes from them alone: they are host tensors on a GPU too.

    Seen through ``TorchDispatchMode`` (every ATen op, also those torch functions and autograd's
    backward call internally): scalar reads (``item``, ``bool``/``int``/``float``/``if`` on a tensor,
    ``allclose``: ``aten._local_scalar_dense``), ``nonzero``/``argwhere``/``torch.where(c)``,
    boolean-mask indexing ``t[mask]`` and ``t[mask] = v`` (``v`` of more than one element),
    ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``, ``bincount``,
    ``equal``, sparse coalescing, dense -> sparse and sparse invariant checks, and, where there is a
    device, copies between it and the host (``_to_copy``/``copy_``: device -> host, blocking host
    -> device); through ``TorchFunctionMode``: device -> host copies (``.cpu()``, ``.tolist()``,
    ``.to("cpu")``) and blocking host -> device copies of host tensors (``.to(device)``,
    ``torch.tensor(data, device=device)``), where a device written ``"cpu"`` is the host and one
    given as a ``torch.device`` or a tensor (``x.device``) is the run's device (so on a CPU run
    ``x.to(torch.device("cpu"))`` of a device tensor counts as a no-op move to its own device). On
    the CPU ``.cpu()`` returns its own tensor, so what reads the result counts as well.

    Cannot see on the CPU: copies between host and device that the code makes otherwise (blocking
    unless ``non_blocking=True``), whether ``t[mask] = v`` with a one-element ``v`` gets a device
    ``v`` (torch fills in place without a sync only from a CPU scalar), the ``torch.cuda`` API
    (``synchronize``, events, ``get_rng_state``), communication that waits (``work.wait()``, gloo's
    host staging), code that runs only on a GPU or only on the CPU (CuPy kernels, a device branch; a
    C++ extension's own scalar reads), and what a library's CUDA kernels do inside.
    """
    out = HostSyncs()
    with _recording(out):
        yield out


@contextlib.contextmanager
def _recording(out: HostSyncs) -> Iterator[None]:
    """:func:`count_host_syncs` appending to ``out``."""
    rec = _Recorder(out)
    with _SyncFunctionMode(rec), _SyncDispatchMode(rec):
        yield


@contextlib.contextmanager
def forbid_host_syncs(allow: Iterable[str] = ()) -> Iterator[HostSyncs]:
    """:func:`count_host_syncs` that raises :class:`HostSyncError` when the block ends having run a
    host synchronization no pattern of ``allow`` matches (``fnmatch`` against ``str(sync)``,
    ``"<op> at <path>:<line> in <function>"``, e.g. ``"aten._local_scalar_dense* in train"``);
    yields the list of all records, the allowed ones included."""
    patterns = tuple(allow)
    with count_host_syncs() as out:
        yield out
    bad = HostSyncs(s for s in out if not any(fnmatch.fnmatchcase(str(s), p) for p in patterns))
    if bad:
        raise HostSyncError(f"{len(bad)} host synchronization(s) not allowed:\n{bad.report()}", bad)


def _phase_recorder(first: int) -> tuple[dict[str, HostSyncs], Any]:
    """Per-phase records and the probe (:mod:`gnncompile.runtime.probe`) that fills them from epoch ``first`` on."""
    records = {phase: HostSyncs() for phase in PHASES}

    def recorder(phase: str, epoch: int) -> Any:
        return _recording(records[phase]) if epoch >= first else contextlib.nullcontext()

    return records, recorder


def train_host_syncs(model: torch.nn.Module, graph: Graph, *, epochs: int = 2, first: int = 1,
                     **train_options: Any) -> dict[str, HostSyncs]:
    """Train ``model`` on ``graph`` with :func:`gnncompile.train` for ``epochs`` epochs, counting
    host synchronizations (:func:`count_host_syncs`) in the epochs from ``first`` on (the steady
    state: the first epoch builds caches); returns the records of each phase of those epochs,
    ``"step"`` (forward, backward, optimizer step) and ``"metrics"`` (loss read, evaluation,
    history), see :mod:`gnncompile.runtime.probe`. ``train_options`` go to :func:`gnncompile.train`."""
    from .runtime.trainer import train

    if not 0 <= first < epochs:
        raise ArgumentError(f"first must be in [0, epochs), got first={first}, epochs={epochs}")
    records, recorder = _phase_recorder(first)
    with probing(recorder):
        train(model, graph, epochs=epochs, verbose=False, **train_options)
    return records


def plan_host_syncs(plan: Any, *, epochs: int = 2, first: int = 1, lr: float = 0.01, weight_decay: float = 5e-4,
                    seed: int = 0, timeout: float = 120.0, device: Optional[str] = None) -> list[dict[str, HostSyncs]]:
    """Run ``plan`` (a :class:`gnncompile.Plan`) for ``epochs`` epochs on its ranks, launched as
    ``plan.run`` launches them (``device`` as there), counting host synchronizations
    (:func:`count_host_syncs`) inside every rank in the epochs from ``first`` on; returns, per rank,
    the records of each phase of those epochs: ``"step"`` (the rank's instruction list: forward,
    backward, communication, optimizer step) and ``"metrics"`` (evaluation, the reduction of the
    loss and accuracies, the history), see :mod:`gnncompile.runtime.probe`. The model is not updated."""
    import tempfile

    import cloudpickle

    from .runtime.executor import plan_placement
    from .runtime.launcher import launch

    if not 0 <= first < epochs:
        raise ArgumentError(f"first must be in [0, epochs), got first={first}, epochs={epochs}")
    placement = plan_placement(plan, device)
    with tempfile.TemporaryDirectory(prefix="gnncompile-syncs-", ignore_cleanup_errors=True) as tmp:
        for prog in plan.program:
            torch.save(prog, os.path.join(tmp, f"rank{prog.rank}.pt"), pickle_module=cloudpickle)
        results = launch(_counting_rank, plan.num_ranks, (tmp, epochs, first, lr, weight_decay, seed),
                         placement=placement, timeout=timeout, temp_paths=(tmp,))
    return [r["syncs"] for r in sorted(results, key=lambda r: r["rank"])]


def _counting_rank(ctx: Any, program_dir: str, epochs: int, first: int, lr: float, weight_decay: float,
                   seed: int) -> dict:
    """A rank of :func:`plan_host_syncs`: its program's training with the phase recorder installed."""
    from .runtime.executor import execute_rank

    prog = torch.load(os.path.join(program_dir, f"rank{ctx.rank}.pt"), weights_only=False)
    records, recorder = _phase_recorder(first)
    with probing(recorder):
        execute_rank(ctx, prog, epochs, lr, weight_decay, seed, 1, False, None)
    return {"rank": ctx.rank, "syncs": records}
