"""``check_plan``: the one helper that checks a plan preserves the model (used by every strategy's tests).

It runs one training step of the single-device reference (:func:`gnncompile.train`'s step: Adam,
cross-entropy over the training mask) and one step of the plan on its ranks, and compares the loss,
the logits of the forward, every parameter gradient, and every parameter after the optimizer step,
with explicit tolerances. Plans are verified first (when the plan verifier is available).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .graph.core import Graph

__all__ = ["ReferenceStep", "reference_step", "check_plan"]


@dataclass
class ReferenceStep:
    loss: float
    logits: torch.Tensor
    grads: dict[str, Optional[torch.Tensor]]
    params_after: dict[str, torch.Tensor]


def reference_step(model: torch.nn.Module, graph: Graph, lr: float = 0.01, weight_decay: float = 5e-4,
                   seed: int = 0) -> ReferenceStep:
    """One step of the single-device reference on ``model`` (which it updates)."""
    torch.manual_seed(seed)
    model.train()
    params = dict(model.named_parameters())
    x = graph.x
    first = next(iter(params.values()), None)
    if first is not None and x.layout == torch.strided and x.dtype != first.dtype:
        x = x.to(first.dtype)
    opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    opt.zero_grad(set_to_none=True)
    logits = model(graph, x)
    loss = F.cross_entropy(logits[graph.train_mask], graph.y[graph.train_mask])
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in params.items()}
    opt.step()
    return ReferenceStep(float(loss.detach()), logits.detach(), grads,
                         {n: p.detach().clone() for n, p in params.items()})


def check_plan(model: torch.nn.Module, graph: Graph, gpus: int, *, rtol: float = 1e-9, atol: float = 1e-11,
               lr: float = 0.01, weight_decay: float = 5e-4, seed: int = 0, timeout: float = 120.0,
               **plan_options: Any) -> Any:
    """Plan ``model`` (a copy) on ``gpus`` ranks, run one step, and compare with the reference step.

    Use a model without dropout (or with ``p=0``): ranks draw their own dropout masks. Raises
    ``AssertionError`` naming the first quantity that differs; returns the run's result.
    """
    from .api import plan as make_plan

    ref_model = copy.deepcopy(model)
    plan_model = copy.deepcopy(model)
    ref = reference_step(ref_model, graph, lr, weight_decay, seed)
    p = make_plan(plan_model, graph, gpus=gpus, **plan_options)
    try:
        from .ir.verify_plan import verify_plan
    except ImportError:  # pragma: no cover - the verifier ships with the plan IR
        verify_plan = None
    if verify_plan is not None:
        verify_plan(p)
    res = p.run(epochs=1, lr=lr, weight_decay=weight_decay, seed=seed, capture=True, timeout=timeout)
    tol = dict(rtol=rtol, atol=atol)
    torch.testing.assert_close(torch.tensor(res.history.loss[0], dtype=torch.float64),
                               torch.tensor(ref.loss, dtype=torch.float64), **tol, msg=lambda m: f"loss: {m}")
    torch.testing.assert_close(res.captured["logits"], ref.logits, **tol, msg=lambda m: f"logits: {m}")
    for name, g_ref in ref.grads.items():
        g = res.captured["grads"].get(name)
        if g_ref is None:
            assert g is None or not bool(g.any()), f"gradient of {name}: the reference has none"
            continue
        assert g is not None, f"gradient of {name}: the plan produced none"
        torch.testing.assert_close(g, g_ref, **tol, msg=lambda m, name=name: f"gradient of {name}: {m}")
    after = dict(plan_model.named_parameters())
    for name, p_ref in ref.params_after.items():
        torch.testing.assert_close(after[name].detach(), p_ref, **tol,
                                   msg=lambda m, name=name: f"parameter {name} after the step: {m}")
    return res
