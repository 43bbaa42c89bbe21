"""``check_plan``: the one helper that checks a plan preserves the model (used by every strategy's tests).
With ``batch_size`` and ``fanouts`` (sampled mini-batch plans) the reference step is the first
mini-batch's, on the same sample: the whole batch for ``split``, the ranks' micro-batches for
mini-batch ``data`` (:func:`sampled_reference_step`).
``check_trace``: the same for tracing: the traced graph equals the eager model in both modes.

``check_plan`` runs one training step of the single-device reference (:func:`gnncompile.train`'s step: Adam,
cross-entropy over the training mask) and one step of the plan on its ranks, and compares the loss,
the logits of the forward, every parameter gradient, and every parameter after the optimizer step,
with explicit tolerances. Plans are verified first (when the plan verifier is available).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .frontend.blocks import BlockModel
from .frontend.ops import plan_dropout_draws
from .graph.core import Graph
from .graph.minibatch import SampledSteps
from .runtime.trainer import adam

__all__ = ["ReferenceStep", "reference_step", "sampled_reference_step", "check_plan", "check_trace"]


@dataclass
class ReferenceStep:
    loss: float
    logits: torch.Tensor
    grads: dict[str, Optional[torch.Tensor]]
    params_after: dict[str, torch.Tensor]


def reference_step(model: torch.nn.Module, graph: Graph, lr: float = 0.01, weight_decay: float = 5e-4,
                   seed: int = 0) -> ReferenceStep:
    """One step of the single-device reference on ``model`` (which it updates), on the device of
    ``graph`` and ``model``; dropout draws its masks as plans do (as :func:`gnncompile.train`)."""
    torch.manual_seed(seed)
    model.train()
    params = dict(model.named_parameters())
    x = graph.x
    first = next(iter(params.values()), None)
    if first is not None and x.layout == torch.strided and x.dtype != first.dtype:
        x = x.to(first.dtype)
    opt = adam(model.parameters(), lr, weight_decay)
    opt.zero_grad(set_to_none=True)
    with plan_dropout_draws():
        logits = model(graph, x)
    loss = F.cross_entropy(logits[graph.train_mask], graph.y[graph.train_mask])
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in params.items()}
    opt.step()
    return ReferenceStep(float(loss.detach()), logits.detach(), grads,
                         {n: p.detach().clone() for n, p in params.items()})


def sampled_reference_step(model: torch.nn.Module, graph: Graph, batch_size: int, fanouts: Any, *, ranks: int = 1,
                           micro: bool = False, lr: float = 0.01, weight_decay: float = 5e-4,
                           seed: int = 0) -> tuple[ReferenceStep, torch.Tensor]:
    """One single-device step on the first mini-batch of a sampled plan with sampling seed ``seed``
    (on the CPU): the whole batch's blocks, or with ``micro`` the ``ranks`` micro-batches of
    mini-batch data parallelism (the loss: their cross-entropy sums over the batch's seeds).
    Returns the step (logits at the seeds) and the seeds' global ids."""
    torch.manual_seed(0)
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
            x = graph.x.index_select(0, b.input_ids)
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
            raise ValueError("check_plan of a sampled plan compares on the CPU (device='cpu')")
        ref, seeds = sampled_reference_step(ref_model, graph, plan_options["batch_size"], plan_options["fanouts"],
                                            ranks=gpus, micro=plan_options.get("strategy") == "data", lr=lr,
                                            weight_decay=weight_decay, seed=plan_options.get("seed", 0))
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
            assert g is None or not bool(g.any()), f"gradient of {name}: the reference has none"
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
    x = graph.x
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
