"""Neighbour sampling (`gnncompile.graph.sampling`): block structure, exactness of `-1`, uniformity
without replacement, reproducibility, per-block normalization and input errors."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile.errors import GraphError
from gnncompile.frontend.ops import propagate
from gnncompile.graph.sampling import SampledBatch, sample_blocks, sample_in_edges
from graph_strategies import sbm_graph, small_graphs

DT = torch.float64
ALL_NORMS = [("gcn", False), ("mean", False), ("gcn", True), ("mean", True), ("sum", True)]


def uniform_rows(rows: int, degree: int, parallel: bool = False) -> gc.Graph:
    """``rows`` destinations ``0..rows-1``, each with ``degree`` in-edges from the same sources
    (``rows..rows+degree-1``, or all from vertex ``rows`` with ``parallel``)."""
    dst = torch.arange(rows).repeat_interleave(degree)
    src = torch.full_like(dst, rows) if parallel else rows + torch.arange(degree).repeat(rows)
    return gc.Graph.from_edge_index(torch.stack([src, dst]), rows + degree)


def check_batch(g: gc.Graph, batch: SampledBatch, seeds: torch.Tensor, fanouts: list[int]) -> None:
    """Every structural promise of `sample_blocks`."""
    assert batch.num_layers == len(fanouts)
    assert torch.equal(batch.seed_ids, seeds)
    deg = g.in_degree()
    for i, (block, src, eids, fanout) in enumerate(zip(batch.blocks, batch.src_ids, batch.edge_ids, fanouts)):
        dst = batch.dst_ids(i)
        assert block.own_offset == 0 and block.num_src == src.numel() and block.num_edges == eids.numel()
        assert torch.unique(src).numel() == src.numel(), "sources are distinct vertices"
        if i + 1 < batch.num_layers:
            assert torch.equal(dst, batch.src_ids[i + 1]), "block i's destinations are block i+1's sources"
        assert int(block.indptr[0]) == 0 and int(block.indptr[-1]) == block.num_edges
        assert bool((block.indptr[1:] >= block.indptr[:-1]).all())
        # every kept edge is that graph edge: same source and destination
        assert torch.equal(g.indices[eids], src[block.indices])
        assert torch.equal(g.dst[eids], dst[block.dst])
        # without replacement: an edge (position) is kept at most once
        assert torch.unique(eids).numel() == eids.numel()
        expected = deg[dst] if fanout == -1 else deg[dst].clamp_max(fanout)
        assert torch.equal(block.in_degree(), expected)
        # the sources are exactly the destinations plus the kept edges' sources
        assert set(src.tolist()) == set(dst.tolist()) | set(g.indices[eids].tolist())


def khop_blocks(g: gc.Graph, seeds: list[int], layers: int) -> list[tuple[set[int], set[int]]]:
    """Plain-Python reference: per layer (input first) the destination set and its in-edge ids."""
    indptr = g.indptr.tolist()
    indices = g.indices.tolist()
    out = []
    frontier = set(seeds)
    for _ in range(layers):
        eids = {e for v in frontier for e in range(indptr[v], indptr[v + 1])}
        out.append((set(frontier), eids))
        frontier = frontier | {indices[e] for e in eids}
    return out[::-1]


def dense_propagation(block: gc.graph.LocalGraph, x: torch.Tensor, norm: str, loops: bool) -> torch.Tensor:
    """``norm``-normalized ``A x`` from the block's dense adjacency (self loops on the destinations)."""
    n, s = block.num_nodes, block.num_src
    w = torch.ones(block.num_edges, dtype=DT) if block.edge_weight is None else block.edge_weight.to(DT)
    a = torch.zeros(n, s, dtype=DT).index_put_((block.dst, block.indices), w, accumulate=True)
    if loops:
        a[:, :n] += torch.eye(n, dtype=DT)
    deg_in, deg_out = a.sum(1), a.sum(0)
    inv = lambda d, p: torch.where(d > 0, d.clamp_min(1e-300) ** -p, torch.zeros_like(d))  # noqa: E731
    if norm == "mean":
        a = inv(deg_in, 1.0)[:, None] * a
    elif norm == "gcn":
        a = inv(deg_in, 0.5)[:, None] * a * inv(deg_out, 0.5)[None, :]
    return a @ x


fanout_lists = st.lists(st.sampled_from([-1, 1, 2, 3]), min_size=1, max_size=3)


@settings(max_examples=60, deadline=None)
@given(g=small_graphs(), fanouts=fanout_lists, data=st.data())
def test_blocks_are_well_formed(g: gc.Graph, fanouts: list[int], data: st.DataObject) -> None:
    seeds = torch.tensor(data.draw(st.lists(st.integers(0, g.num_nodes - 1), min_size=1, max_size=g.num_nodes,
                                            unique=True)))
    batch = sample_blocks(g, seeds, fanouts, seed=data.draw(st.integers(0, 2**31)))
    check_batch(g, batch, seeds, fanouts)


@settings(max_examples=40, deadline=None)
@given(g=small_graphs(), layers=st.integers(1, 3), data=st.data())
def test_full_fanout_is_the_exact_khop_computation_graph(g: gc.Graph, layers: int, data: st.DataObject) -> None:
    seeds = data.draw(st.lists(st.integers(0, g.num_nodes - 1), min_size=1, max_size=4, unique=True))
    batch = sample_blocks(g, seeds, [-1] * layers, seed=0)
    check_batch(g, batch, torch.tensor(seeds), [-1] * layers)
    for i, (dst, eids) in enumerate(khop_blocks(g, seeds, layers)):
        assert set(batch.dst_ids(i).tolist()) == dst
        assert set(batch.edge_ids[i].tolist()) == eids


@settings(max_examples=40, deadline=None)
@given(g=small_graphs(), layers=st.integers(1, 3), norm=st.sampled_from(["mean", "sum"]), loops=st.booleans(),
       data=st.data())
def test_full_fanout_propagation_equals_whole_graph_propagation(g: gc.Graph, layers: int, norm: str, loops: bool,
                                                                data: st.DataObject) -> None:
    """With every in-edge kept, a destination's sampled in-degree is its in-degree, so mean and sum
    propagation through the blocks give the whole-graph propagation's seed rows, layer after layer."""
    seeds = torch.tensor(data.draw(st.lists(st.integers(0, g.num_nodes - 1), min_size=1, max_size=5, unique=True)))
    batch = sample_blocks(g, seeds, [-1] * layers, seed=0, norms=[(norm, loops)])
    h_full, h = g.x, g.x[batch.input_ids]
    for block in batch.blocks:
        h_full = propagate(g, h_full, norm, add_self_loops=loops)
        h = propagate(block, h, norm, add_self_loops=loops)
    torch.testing.assert_close(h, h_full[seeds], rtol=1e-12, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(g=small_graphs(), fanouts=fanout_lists, weighted=st.booleans(), data=st.data())
def test_coefficients_use_the_blocks_own_degrees(g: gc.Graph, fanouts: list[int], weighted: bool,
                                                 data: st.DataObject) -> None:
    """Every norm's propagation on every block equals the dense formula over the block's adjacency."""
    if weighted:
        g = g.replace(edge_weight=torch.rand(g.num_edges, generator=torch.Generator().manual_seed(3), dtype=DT) + 0.5)
    seeds = torch.tensor(data.draw(st.lists(st.integers(0, g.num_nodes - 1), min_size=1, max_size=6, unique=True)))
    batch = sample_blocks(g, seeds, fanouts, seed=data.draw(st.integers(0, 99)), norms=ALL_NORMS)
    for block in batch.blocks:
        x = torch.randn(block.num_src, 3, dtype=DT, generator=torch.Generator().manual_seed(0))
        for norm, loops in ALL_NORMS + [("sum", False)]:
            torch.testing.assert_close(propagate(block, x, norm, add_self_loops=loops),
                                       dense_propagation(block, x, norm, loops), rtol=1e-10, atol=1e-12)


def test_sampled_blocks_are_normalized_by_sampled_degrees() -> None:
    """Mean coefficients are 1 / fanout, not 1 / in-degree (the dense test above would also pass if
    sampling kept whole neighbourhoods)."""
    g = uniform_rows(50, 8)
    batch = sample_blocks(g, torch.arange(50), [3], seed=0, norms=[("mean", False)])
    coef = batch.blocks[0].norm_coefficients("mean")
    torch.testing.assert_close(coef, torch.full_like(coef, 1 / 3))


def test_same_seed_same_batch_other_seed_other_batch() -> None:
    g = sbm_graph(400)
    seeds = torch.arange(0, 400, 7)

    def draw(**kw: object) -> SampledBatch:
        return sample_blocks(g, seeds, [4, 3], norms=[("gcn", True)], **kw)

    a, b, c = draw(seed=11), draw(seed=11), draw(seed=12)
    for x, y in zip(a.src_ids + a.edge_ids, b.src_ids + b.edge_ids):
        assert torch.equal(x, y)
    assert torch.equal(a.blocks[0].indices, b.blocks[0].indices)
    assert not torch.equal(a.edge_ids[1], c.edge_ids[1])
    gen = torch.Generator().manual_seed(11)
    first, second = draw(generator=gen), draw(generator=gen)
    assert torch.equal(first.edge_ids[0], a.edge_ids[0]), "seed=s is a generator seeded with s"
    assert not torch.equal(first.edge_ids[1], second.edge_ids[1]), "the generator advances"
    torch.manual_seed(5)
    d = draw()
    torch.manual_seed(5)
    assert torch.equal(draw().edge_ids[0], d.edge_ids[0]), "no generator: torch's default one"


def test_each_in_edge_is_kept_with_probability_fanout_over_degree() -> None:
    rows, degree, fanout, draws = 200, 500, 50, 5
    g = uniform_rows(rows, degree)
    kept = torch.zeros(degree, dtype=torch.int64)
    for s in range(draws):
        counts, eids = sample_in_edges(g, torch.arange(rows), fanout, generator=torch.Generator().manual_seed(s))
        assert torch.equal(counts, torch.full((rows,), fanout))
        kept += torch.bincount(eids % degree, minlength=degree)
    freq = kept / (rows * draws)
    # p = 0.1 over 1000 trials per edge: sd 0.0095; 0.05 is over 5 sd for the worst of 500 edges
    assert float((freq - fanout / degree).abs().max()) < 0.05
    assert int(kept.sum()) == rows * draws * fanout


def test_every_subset_is_equally_likely() -> None:
    rows, degree, fanout = 6000, 4, 2
    g = uniform_rows(rows, degree)
    _, eids = sample_in_edges(g, torch.arange(rows), fanout, generator=torch.Generator().manual_seed(0))
    subsets = Counter(map(tuple, (eids % degree).reshape(rows, fanout).tolist()))
    assert set(subsets) == set(itertools.combinations(range(degree), fanout)), "ascending positions, all subsets"
    # 1000 expected per subset, sd about 29
    assert all(abs(c - rows / 6) < 150 for c in subsets.values()), subsets


def test_parallel_edges_are_distinct_candidates() -> None:
    g = uniform_rows(30, 6, parallel=True)
    batch = sample_blocks(g, torch.arange(30), [3], seed=1)
    check_batch(g, batch, torch.arange(30), [3])
    assert batch.blocks[0].num_src == 31  # one source vertex, kept edges all point at it
    per_row = batch.edge_ids[0].reshape(30, 3)
    assert bool((per_row[:, 1:] > per_row[:, :-1]).all()), "three distinct edges per row"


def test_small_in_degrees_keep_everything_and_isolated_seeds_work() -> None:
    g = gc.Graph.from_edge_index(torch.tensor([[1, 2, 0], [0, 0, 1]]), 4)  # vertex 3 isolated
    batch = sample_blocks(g, [3, 0], [5, 2], seed=0, norms=[("gcn", True), ("mean", False)])
    check_batch(g, batch, torch.tensor([3, 0]), [5, 2])
    assert batch.sizes() == [(4, 4, 3), (2, 4, 2)]
    assert batch.input_ids.tolist() == [3, 0, 1, 2]
    h = propagate(batch.blocks[1], torch.ones(4, 1, dtype=torch.float32), "mean")
    assert h.flatten().tolist() == [0.0, 1.0]  # the isolated seed aggregates nothing


def test_bool_mask_seeds_and_empty_batch() -> None:
    g = sbm_graph(100)
    mask = torch.zeros(100, dtype=torch.bool)
    mask[[3, 50, 7]] = True
    assert sample_blocks(g, mask, [2], seed=0).seed_ids.tolist() == [3, 7, 50]
    empty = sample_blocks(g, torch.zeros(0, dtype=torch.int64), [2, 2], seed=0, norms=[("gcn", True)])
    assert empty.sizes() == [(0, 0, 0), (0, 0, 0)]


def test_batch_moves_between_devices() -> None:
    batch = sample_blocks(sbm_graph(100), torch.arange(10), [3, 2], seed=0, norms=[("gcn", True)]).to("cpu")
    assert batch.blocks[0].loop_norm_coefficients("gcn")[0].numel() == batch.blocks[0].num_edges


@pytest.mark.parametrize("kwargs, match", [
    (dict(fanouts=[]), "fanouts: empty"),
    (dict(fanouts=[3, 0]), r"fanouts\[1\] = 0"),
    (dict(fanouts=[-2]), r"fanouts\[0\] = -2"),
    (dict(fanouts=[2.5]), r"fanouts\[0\]: expected an int"),
    (dict(seeds=[0, 100]), r"seeds\[1\] = 100 is not a vertex id in \[0, 100\)"),
    (dict(seeds=[-1]), r"seeds\[0\] = -1"),
    (dict(seeds=[4, 5, 4]), "vertex 4 appears 2 times"),
    (dict(seeds=[[1, 2]]), "1-d tensor"),
    (dict(seeds=[0.5]), "integer vertex ids"),
    (dict(seeds=torch.ones(5, dtype=torch.bool)), r"bool mask must have shape \[100\]"),
    (dict(seed=1, generator=torch.Generator()), "not both"),
])
def test_bad_input_is_rejected(kwargs: dict, match: str) -> None:
    args = dict(seeds=[0, 1], fanouts=[2, 2]) | kwargs
    with pytest.raises(GraphError, match=match):
        sample_blocks(sbm_graph(100), args.pop("seeds"), args.pop("fanouts"), **args)


def test_a_local_graph_is_rejected() -> None:
    block = sample_blocks(sbm_graph(100), [0, 1], [3], seed=0).blocks[0]
    with pytest.raises(GraphError, match="not a rank's local graph"):
        sample_blocks(block, [0], [2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_on_cuda_matches_the_cpu_contract() -> None:
    g = sbm_graph(2000)
    seeds = torch.arange(0, 2000, 3)
    batch = sample_blocks(g.to("cuda"), seeds.cuda(), [5, 3, -1], seed=0, norms=ALL_NORMS)
    assert batch.blocks[0].indices.is_cuda and batch.input_ids.is_cuda
    check_batch(g, batch.to("cpu"), seeds, [5, 3, -1])
    again = sample_blocks(g.to("cuda"), seeds.cuda(), [5, 3, -1], seed=0)
    assert torch.equal(again.edge_ids[0], batch.edge_ids[0])
