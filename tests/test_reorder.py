"""Vertex reordering (reverse Cuthill–McKee) and MixGCN's pipeline granularity (Proposition 3.5)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile import GraphError
from gnncompile.graph.reorder import bandwidth, min_granularity, permute, pipeline_batches, rcm_order, reorder
from graph_strategies import DT, labelled, small_graphs


def _edges(g: gc.Graph) -> list[tuple[int, int, float]]:
    w = g.edge_weight if g.edge_weight is not None else torch.ones(g.num_edges)
    return sorted(zip(g.indices.tolist(), g.dst.tolist(), w.tolist()))


def shuffled_grid(rows: int, cols: int) -> gc.Graph:
    """A 2-D grid (bandwidth ``cols`` in row-major order) with randomly permuted vertex ids."""
    idx = torch.arange(rows * cols).reshape(rows, cols)
    right = torch.stack([idx[:, :-1].reshape(-1), idx[:, 1:].reshape(-1)])
    down = torch.stack([idx[:-1].reshape(-1), idx[1:].reshape(-1)])
    ei = torch.cat([right, down], dim=1)
    perm = torch.randperm(rows * cols, generator=torch.Generator().manual_seed(3))
    return gc.Graph.from_edge_index(perm[ei], rows * cols).to_undirected()


@settings(max_examples=40, deadline=None)
@given(g=small_graphs(), seed=st.integers(0, 1000))
def test_permute_moves_everything_with_its_vertex(g: gc.Graph, seed: int) -> None:
    g = g.replace(edge_weight=torch.rand(g.num_edges, generator=torch.Generator().manual_seed(seed)))
    order = torch.randperm(g.num_nodes, generator=torch.Generator().manual_seed(seed))
    p = permute(g, order)
    new_of_old = torch.empty_like(order)
    new_of_old[order] = torch.arange(g.num_nodes)
    # the edge multiset, relabelled
    w = g.edge_weight
    expect = sorted(zip(new_of_old[g.indices].tolist(), new_of_old[g.dst].tolist(), w.tolist()))
    assert _edges(p) == expect
    assert torch.equal(p.x, g.x[order]) and torch.equal(p.y, g.y[order])
    assert torch.equal(p.train_mask, g.train_mask[order]) and torch.equal(p.test_mask, g.test_mask[order])
    assert p.num_classes == g.num_classes
    p.validate()
    # each destination keeps its in-edges in their original order (same summation order)
    for i in range(g.num_nodes):
        old = int(order[i])
        a = g.indices[g.indptr[old]:g.indptr[old + 1]]
        b = p.indices[p.indptr[i]:p.indptr[i + 1]]
        assert torch.equal(order[b], a)
    # the inverse permutation restores the graph
    back = permute(p, new_of_old)
    assert torch.equal(back.indptr, g.indptr) and torch.equal(back.indices, g.indices)
    assert torch.equal(back.edge_weight, g.edge_weight) and torch.equal(back.x, g.x)


@settings(max_examples=20, deadline=None)
@given(g=small_graphs(), seed=st.integers(0, 1000))
def test_a_model_on_the_permuted_graph_computes_the_permuted_outputs(g: gc.Graph, seed: int) -> None:
    torch.manual_seed(seed)
    model = gc.nn.GCN(g.num_features, 4, g.num_classes, num_layers=2, dropout=0.0).to(DT)
    order = rcm_order(g)
    p = permute(g, order)
    out = model(g, g.x)
    out_p = model(p, p.x)
    torch.testing.assert_close(out_p, out[order], rtol=1e-12, atol=1e-12)


def test_sparse_features_are_permuted() -> None:
    g = labelled(gc.Graph.from_edge_index(torch.tensor([[0, 1, 2], [1, 2, 3]]), 4))
    dense = torch.tensor([[1.0, 0, 0], [0, 2.0, 0], [0, 0, 0], [3.0, 0, 4.0]])
    g = g.replace(x=dense.to_sparse_csr())
    order = torch.tensor([3, 1, 0, 2])
    p = permute(g, order)
    assert p.x.layout == torch.sparse_csr
    assert torch.equal(p.x.to_dense(), dense[order])


@pytest.mark.parametrize("make, before_at_least, after_at_most", [
    (lambda: shuffled_grid(12, 10), 60, 14),   # RCM gives ~ the short side of the grid
])
def test_rcm_shrinks_the_bandwidth(make, before_at_least: int, after_at_most: int) -> None:
    g = make()
    r, order = reorder(g, "rcm")
    assert sorted(order.tolist()) == list(range(g.num_nodes))
    assert bandwidth(g) >= before_at_least
    assert bandwidth(r) <= after_at_most
    assert r.num_edges == g.num_edges


def test_rcm_of_a_path_is_a_path() -> None:
    n = 50
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    ei = perm[torch.stack([torch.arange(n - 1), torch.arange(1, n)])]
    g = gc.Graph.from_edge_index(ei, n)  # directed: RCM orders the symmetrized pattern
    assert bandwidth(permute(g, rcm_order(g))) == 1


def test_none_is_the_identity() -> None:
    g = shuffled_grid(3, 3)
    r, order = reorder(g, "none")
    assert r is g and torch.equal(order, torch.arange(9))


@pytest.mark.parametrize("order, match", [
    (torch.tensor([0, 1, 2]), "3 entries for a graph of 4"),
    (torch.tensor([0, 1, 2, 4]), r"order\[3\] = 4 is not a vertex id"),
    (torch.tensor([0, 1, 1, 3]), "not a permutation"),
    (torch.tensor([0.0, 1, 2, 3]), "integer"),
])
def test_bad_orders_are_graph_errors(order: torch.Tensor, match: str) -> None:
    g = gc.Graph.from_edge_index(torch.tensor([[0, 1], [1, 2]]), 4)
    with pytest.raises(GraphError, match=match):
        permute(g, order)


def test_unknown_method() -> None:
    with pytest.raises(GraphError, match="unknown method 'metis'"):
        reorder(shuffled_grid(2, 2), "metis")


@given(n=st.integers(1, 10_000), frac=st.floats(0, 1))
def test_pipeline_batches_is_the_smallest_idle_free_count(n: int, frac: float) -> None:
    b = min(n - 1, int(frac * n))
    s = pipeline_batches(n, b)
    g = min_granularity(n, b)
    assert g == (n - b) / (2 * n)
    assert s is not None and g >= 1 / s - 1e-12
    assert s == 2 or g < 1 / (s - 1)  # s - 1 batches would leave the pipeline idle (s >= 2 always)


def test_granularity_values() -> None:
    assert min_granularity(100, 80) == pytest.approx(0.1)
    assert pipeline_batches(100, 80) == 10
    assert pipeline_batches(100, 0) == 2  # no cross-chunk reads: two batches already overlap
    assert pipeline_batches(100, 100) is None
    with pytest.raises(ValueError):
        min_granularity(10, 11)
    assert math.isclose(min_granularity(10, 5), 0.25)
