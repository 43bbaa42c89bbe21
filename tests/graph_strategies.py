"""Hypothesis strategies and helpers shared by the strategies' property tests (data, tensor)."""

from __future__ import annotations

from typing import Any, Callable

import torch
from hypothesis import strategies as st

import gnncompile as gc

DT = torch.float64


def labelled(g: gc.Graph, num_classes: int = 3, seed: int = 0, num_features: int = 5) -> gc.Graph:
    """``g`` with float64 random features, labels and a 60/40 train/test split (vertex 0 trains)."""
    gen = torch.Generator().manual_seed(seed)
    n = g.num_nodes
    y = torch.randint(0, num_classes, (n,), generator=gen)
    train = torch.rand(n, generator=gen) < 0.6
    train[0] = True
    return g.replace(x=torch.randn(n, num_features, generator=gen, dtype=DT), y=y, train_mask=train, val_mask=~train,
                     test_mask=~train, num_classes=num_classes)


def sbm_graph(num_nodes: int) -> gc.Graph:
    """The strategies' fixed test graph: a 3-class SBM with 6 float64 features (seed 1)."""
    g = gc.datasets.synthetic("sbm", num_nodes=num_nodes, avg_degree=5, num_features=6, num_classes=3, seed=1)
    return g.replace(x=g.x.to(DT))


def seeded_model(make: Callable[[int, int], torch.nn.Module], g: gc.Graph) -> torch.nn.Module:
    """``make(features, classes)`` with weights drawn from seed 0, in float64."""
    torch.manual_seed(0)
    return make(g.num_features, g.num_classes).to(DT)


@st.composite
def small_graphs(draw: Callable[..., Any]) -> gc.Graph:
    """4-14 vertices plus 0-2 isolated ones; self loops, parallel and one-directional edges."""
    n = draw(st.integers(4, 14))
    extra = draw(st.integers(0, 2))
    pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), min_size=1, max_size=40))
    ei = torch.tensor(pairs, dtype=torch.long).t().contiguous()
    g = gc.Graph.from_edge_index(ei, n + extra)
    return labelled(g, seed=draw(st.integers(0, 99)))


def assert_same_step(result: Any, reference: Any) -> None:
    """Two captured one-step runs (``plan.run(epochs=1, capture=True)``) computed the same loss,
    logits and parameter gradients (float64 tolerances)."""
    torch.testing.assert_close(torch.tensor(result.history.loss[0]), torch.tensor(reference.history.loss[0]),
                               rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(result.captured["logits"], reference.captured["logits"], rtol=1e-9, atol=1e-11)
    for name, grad in reference.captured["grads"].items():
        torch.testing.assert_close(result.captured["grads"][name], grad, rtol=1e-9, atol=1e-11)
