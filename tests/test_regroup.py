"""Graph chunks in any vertex order and NeutronTask's per-epoch regrouping (gnncompile.graph.regroup)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile.errors import GraphError
from gnncompile.graph.regroup import ChunkRegrouping, RegroupedInputs
from gnncompile.graph.reorder import permute
from gnncompile.graph.shard import chunk_subgraph, dropout_positions, propagation_scales
from gnncompile.passes.chunked import chunk_bounds
from graph_strategies import small_graphs


@settings(max_examples=40, deadline=None)
@given(g=small_graphs(), data=st.data())
def test_chunk_of_an_order_is_the_chunk_of_the_permuted_graph(g: gc.Graph, data: st.DataObject) -> None:
    """Cutting a vertex order without renumbering the graph gives the chunk graph of the renumbered
    graph: same local structure and coefficients, and edge ids that name the same edges."""
    n = g.num_nodes
    order = torch.tensor(data.draw(st.permutations(range(n))), dtype=torch.int64)
    k = data.draw(st.integers(1, min(n, 4)))
    bounds = chunk_bounds(n, k)
    j = data.draw(st.integers(0, k - 1))
    reads = sorted(set(data.draw(st.lists(st.integers(0, k - 1), max_size=k))) | {j})
    norms = [("gcn", False), ("gcn", True)]
    mine, eids = chunk_subgraph(g, bounds, j, reads, propagation_scales(g, norms), order=order)
    pg = permute(g, order)
    ref, ref_eids = chunk_subgraph(pg, bounds, j, reads, propagation_scales(pg, norms))
    assert torch.equal(mine.indptr, ref.indptr) and torch.equal(mine.indices, ref.indices)
    assert (mine.num_nodes, mine.num_src, mine.own_offset) == (ref.num_nodes, ref.num_src, ref.own_offset)
    torch.testing.assert_close(mine.norm_coefficients("gcn"), ref.norm_coefficients("gcn"))
    for a, b in zip(mine.loop_norm_coefficients("gcn"), ref.loop_norm_coefficients("gcn")):
        torch.testing.assert_close(a, b)
    # the edges named by the ids: same (source, destination) in the original numbering
    src, dst = g.indices[eids], g.dst[eids]
    psrc, pdst = order[pg.indices[ref_eids]], order[pg.dst[ref_eids]]
    assert torch.equal(src, psrc) and torch.equal(dst, pdst)


def _regrouping(n: int = 40, base: int = 8, subgraphs: int = 4, seed: int = 3) -> ChunkRegrouping:
    g = gc.datasets.synthetic("sbm", num_nodes=n, avg_degree=6, num_features=3, num_classes=2, seed=0)
    return ChunkRegrouping(g, chunk_bounds(n, base), chunk_bounds(n, subgraphs), seed)


def test_orders_are_shuffled_base_chunks_and_change_every_epoch() -> None:
    rg = _regrouping()
    orders = [rg.order(e) for e in range(6)]
    for e, order in enumerate(orders):
        assert sorted(order.tolist()) == list(range(40))
        # the concatenation of whole base chunks, in the order chunk_order says
        chunks = rg.chunk_order(e).tolist()
        assert order.tolist() == [v for c in chunks for v in range(c * 5, c * 5 + 5)]
        assert torch.equal(order, rg.order(e))  # the same on every call (every rank)
    assert len({tuple(o.tolist()) for o in orders}) > 1
    assert not torch.equal(ChunkRegrouping(rg.graph, rg.base_bounds, rg.bounds, seed=4).order(0), orders[0])


def test_kept_edges_follow_the_subgraph_order() -> None:
    """An edge is kept iff its source's subgraph is not after its destination's; edges inside a
    base chunk always are; over many epochs the cross-chunk keep rate approaches the formula."""
    rg = _regrouping(n=400, base=8, subgraphs=4)
    g = rg.graph
    src, dst = g.indices, g.dst
    base_of = torch.searchsorted(torch.as_tensor(rg.base_bounds), torch.arange(g.num_nodes), right=True) - 1
    inner = base_of[src] == base_of[dst]
    rates = []
    for e in range(200):
        kept = rg.kept_edges(e)
        order = rg.order(e)
        pos = torch.empty_like(order)
        pos[order] = torch.arange(order.numel())
        unit = torch.searchsorted(torch.as_tensor(rg.bounds), pos, right=True) - 1
        assert torch.equal(kept, unit[src] <= unit[dst])
        assert bool(kept[inner].all())
        rates.append(float(kept[~inner].double().mean()))
    assert rg.keep_probability() == pytest.approx(1 / 7 + (6 / 7) / 2)
    assert sum(rates) / len(rates) == pytest.approx(rg.keep_probability(), abs=0.03)


def test_subgraph_reads_itself_and_earlier_subgraphs() -> None:
    rg = _regrouping()
    order = rg.order(1)
    kept = rg.kept_edges(1)
    total = 0
    for j in range(rg.num_subgraphs):
        sub, eids = rg.subgraph(order, j)
        lo, hi = rg.bounds[j], rg.bounds[j + 1]
        assert sub.num_nodes == hi - lo and sub.num_src == hi and sub.own_offset == lo
        assert bool(kept[eids].all())  # only kept edges, and (summed over subgraphs) all of them
        total += eids.numel()
        # local sources are positions of the epoch's order
        assert torch.equal(order[sub.indices], rg.graph.indices[eids])
        assert torch.equal(order[lo:hi][sub.dst], rg.graph.dst[eids])
    assert total == int(kept.sum())


def test_rank_inputs_hold_what_the_rank_reads() -> None:
    rg = _regrouping()
    rg.graph.train_mask = torch.arange(40) % 2 == 0
    t_rank = RegroupedInputs.for_rank(rg, {0: {"x": "features"}, 2: {"x": "features"}})
    p_rank = RegroupedInputs.for_rank(rg, {1: {"g": "graph", "drop": "E+V"}, 3: {"g": "graph"}}, scored=(1, 3))
    assert t_rank.regrouping.graph.x is not None and t_rank.regrouping.graph.y is None
    assert p_rank.regrouping.graph.x is None and p_rank.regrouping.graph.y is not None
    e = t_rank.epoch(2)
    order = rg.order(2)
    assert sorted(e.chunk_inputs) == [0, 2] and e.owned is None and e.offsets is None
    torch.testing.assert_close(e.chunk_inputs[2]["x"], rg.graph.x[order[rg.bounds[2]:rg.bounds[3]]])
    e = p_rank.epoch(2)
    sub, eids = rg.subgraph(order, 1)
    assert torch.equal(e.chunk_inputs[1]["g"].indices, sub.indices)
    ids = order[rg.bounds[1]:rg.bounds[2]]
    assert torch.equal(e.chunk_inputs[1]["drop"], dropout_positions("E+V", rg.graph, ids, eids))
    assert torch.equal(e.owned, torch.cat([ids, order[rg.bounds[3]:rg.bounds[4]]]))
    assert e.offsets == (0, 0, 10, 10, 20)
    assert torch.equal(e.labels, rg.graph.y[e.owned]) and torch.equal(e.train_mask, rg.graph.train_mask[e.owned])


def test_bad_regroupings_are_refused() -> None:
    g = _regrouping().graph
    with pytest.raises(GraphError, match="base chunks cannot form"):
        ChunkRegrouping(g, chunk_bounds(40, 2), chunk_bounds(40, 4))
    with pytest.raises(GraphError, match="rise from 0"):
        ChunkRegrouping(g, (0, 10, 39), chunk_bounds(40, 2))
    with pytest.raises(GraphError, match="unknown input kind"):
        RegroupedInputs(_regrouping(), {0: {"x": "rows"}})
    with pytest.raises(GraphError, match="unknown dropout space"):
        dropout_positions("Q", g, torch.arange(3), torch.arange(3))


@settings(max_examples=30, deadline=None)
@given(g=small_graphs(), data=st.data())
def test_reading_all_subgraphs_keeps_every_edge(g: gc.Graph, data: st.DataObject) -> None:
    """``reads="all"`` (GNNPipe's chunk shuffling): base chunks listed by ``base_order`` are shuffled
    whole; every subgraph holds all in-edges of its vertices with the whole graph's coefficients,
    sources numbered in the epoch's order; the epoch's slots are its vertices."""
    n = g.num_nodes
    k = data.draw(st.integers(1, min(n, 4)))
    base_order = torch.tensor(data.draw(st.permutations(range(n))), dtype=torch.int64)
    bounds = chunk_bounds(n, k)
    rg = ChunkRegrouping(g, bounds, bounds, seed=data.draw(st.integers(0, 9)), norms=(("gcn", False),),
                         base_order=base_order, reads="all")
    assert rg.keep_probability() == 1.0 and bool(rg.kept_edges(0).all())
    order = rg.order(1)
    pieces = [base_order[bounds[c]:bounds[c + 1]] for c in rg.chunk_order(1).tolist()]
    assert torch.equal(order, torch.cat(pieces))
    epoch = RegroupedInputs(rg, {j: {"g": "graph"} for j in range(k)}).epoch(1)
    whole = g.norm_coefficients("gcn")
    for j in range(k):
        sub = epoch.chunk_inputs[j]["g"]
        ids = order[bounds[j]:bounds[j + 1]]
        assert torch.equal(epoch.slots[j], ids)
        assert sub.num_src == n and int(sub.indptr[-1]) == int((g.indptr[ids + 1] - g.indptr[ids]).sum())
        _, eids = rg.subgraph(order, j)
        torch.testing.assert_close(sub.norm_coefficients("gcn"), whole[eids])
    with pytest.raises(GraphError, match="reads must be"):
        ChunkRegrouping(g, bounds, bounds, reads="later")
