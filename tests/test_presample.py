"""GSPLIT's offline splitting (`gnncompile.graph.presample`) and the weighted METIS of `partition`.

Presampling counts are compared with a brute-force recount from the same `SampledBatch` objects;
edge counts are checked to line up with the graph's CSR edges. Weighted METIS is checked on toy
graphs whose weights force the answer (a heavy clique that must be split to balance, a ring whose
light edges must be the cut) and the symmetrized weights against a direct sum. Split statistics are
compared with a brute-force per-layer enumeration and with a hand-made batch.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile.errors import GraphError, PlanningError
from gnncompile.graph import (PresampleWeights, SplitStats, partition, presample, presampled_partition,
                              sample_blocks, split_stats)
from gnncompile.graph.partition import _fit_index_type, _metis_adjacency
from gnncompile.graph.presample import presample_batches
from gnncompile.graph.sampling import SampledBatch
from gnncompile.graph.shard import LocalGraph
from graph_strategies import sbm_graph, small_graphs


def edges_graph(edges: list[tuple[int, int]], n: int) -> gc.Graph:
    return gc.Graph.from_edge_index(torch.tensor(edges, dtype=torch.int64).reshape(-1, 2).T, n)


# ------------------------------------------------------------------------------------- presampling
def brute_counts(g: gc.Graph, batches: list[SampledBatch]) -> tuple[list[int], list[int], list[int]]:
    """(k_v, k_e, input counts) by Python enumeration of every block's destinations and edges."""
    kv, ke, ki = [0] * g.num_nodes, [0] * g.num_edges, [0] * g.num_nodes
    for b in batches:
        for i in range(b.num_layers):
            for v in b.dst_ids(i).tolist():
                kv[v] += 1
            for e in b.edge_ids[i].tolist():
                ke[e] += 1
        for v in b.input_ids.tolist():
            ki[v] += 1
    return kv, ke, ki


@settings(max_examples=40, deadline=None)
@given(g=small_graphs(), fanouts=st.lists(st.sampled_from([-1, 1, 2, 3]), min_size=1, max_size=3),
       batch_size=st.integers(1, 7), epochs=st.integers(1, 3), seed=st.integers(0, 50))
def test_presample_counts_match_brute_force(g, fanouts, batch_size, epochs, seed):
    w = presample(g, fanouts, batch_size, epochs=epochs, seed=seed)
    batches = list(presample_batches(g, fanouts, batch_size, epochs=epochs, seed=seed))
    kv, ke, ki = brute_counts(g, batches)
    assert w.vertex.tolist() == kv and w.edge.tolist() == ke and w.inputs.tolist() == ki
    assert w.samples == len(batches)
    train = torch.nonzero(g.train_mask).flatten()
    per_epoch = -(-train.numel() // batch_size)
    assert w.samples == epochs * per_epoch
    # every epoch's seeds are the targets, each once
    for e in range(epochs):
        seeds = torch.cat([b.seed_ids for b in batches[e * per_epoch:(e + 1) * per_epoch]])
        assert sorted(seeds.tolist()) == train.tolist()
    # the last layer's seeds are counted once per epoch; weights are counts / N
    assert bool((w.vertex[train] >= epochs).all())
    torch.testing.assert_close(w.vertex_weight, w.vertex.double() / w.samples)
    torch.testing.assert_close(w.edge_weight, w.edge.double() / w.samples)


def test_presample_is_reproducible_and_seeded():
    g = sbm_graph(200)
    a = presample(g, [3, 2], 16, epochs=2, seed=4)
    b = presample(g, [3, 2], 16, epochs=2, seed=4)
    c = presample(g, [3, 2], 16, epochs=2, seed=5)
    assert torch.equal(a.vertex, b.vertex) and torch.equal(a.edge, b.edge)
    assert not torch.equal(a.edge, c.edge)
    assert a.fanouts == (3, 2) and a.batch_size == 16 and a.epochs == 2


def test_presample_edge_weights_align_with_csr_edges():
    # parallel edges (1 -> 0 twice) and a self loop (2 -> 2): full neighbourhoods of target 0 in one
    # layer sample exactly the in-edges of 0, whatever their multiplicity
    edges = [(1, 0), (1, 0), (2, 0), (2, 2), (3, 1), (0, 3), (3, 2)]
    g = edges_graph(edges, 4)
    w = presample(g, [-1], 1, targets=[0])
    dst = g.dst
    assert w.edge.tolist() == [1 if int(d) == 0 else 0 for d in dst]
    assert w.vertex.tolist() == [1, 0, 0, 0] and w.inputs.tolist() == [1, 1, 1, 0]
    # two full layers: block 1 samples 0's in-edges, block 0 the in-edges of {0, 1, 2}
    w2 = presample(g, [-1, -1], 1, targets=torch.tensor([True, False, False, False]))
    expected = [int(int(d) == 0) + int(int(d) in (0, 1, 2)) for d in dst]
    assert w2.edge.tolist() == expected
    assert w2.vertex.tolist() == [2, 1, 1, 0]  # 0 at both layers l > 0, its in-neighbours 1 and 2 at layer 1
    # every sampled edge's source in the block is the CSR source of its edge id
    for b in presample_batches(g, [-1, -1], 1, targets=[0]):
        for i, block in enumerate(b.blocks):
            assert torch.equal(b.src_ids[i][block.indices], g.indices[b.edge_ids[i]])


def test_presample_default_targets_and_errors():
    g = sbm_graph(60)
    w = presample(g, [2], 1000)
    assert w.samples == 1 and int(w.vertex.sum()) == int(g.train_mask.sum())
    all_targets = presample(g.replace(train_mask=None), [2], 1000)
    assert int(all_targets.vertex.sum()) == g.num_nodes
    with pytest.raises(GraphError, match="batch_size"):
        presample(g, [2], 0)
    with pytest.raises(GraphError, match="epochs"):
        presample(g, [2], 4, epochs=0)
    with pytest.raises(GraphError, match="fanouts"):
        presample(g, [], 4)
    with pytest.raises(GraphError, match="seeds"):
        presample(g, [2], 4, targets=[0, 0])


# ------------------------------------------------------------------------------------- weighted METIS
@settings(max_examples=40, deadline=None)
@given(g=small_graphs(), data=st.data())
def test_metis_adjacency_sums_both_directions(g, data):
    w = torch.tensor(data.draw(st.lists(st.integers(0, 5), min_size=g.num_edges, max_size=g.num_edges)),
                     dtype=torch.int64)
    xadj, adjncy, ew = _metis_adjacency(g, w)
    pair: Counter = Counter()
    for s, d, x in zip(g.indices.tolist(), g.dst.tolist(), w.tolist()):
        if s != d:
            pair[(min(s, d), max(s, d))] += x
    got = {}
    for u in range(g.num_nodes):
        for j in range(int(xadj[u]), int(xadj[u + 1])):
            got[(u, int(adjncy[j]))] = int(ew[j])
    expected = {}
    for (a, b), x in pair.items():
        if x > 0:
            expected[(a, b)] = expected[(b, a)] = x
    assert got == expected
    # unweighted: the plain symmetrized structure, unchanged
    xadj0, adjncy0, ew0 = _metis_adjacency(g)
    assert ew0 is None
    assert {(u, int(v)) for u in range(g.num_nodes) for v in adjncy0[xadj0[u]:xadj0[u + 1]]} == set(
        pair) | {(b, a) for a, b in pair}


def test_metis_vertex_weights_force_the_heavy_clique_apart():
    # a heavy 16-clique (weight 30 each: 480) tied by one edge to a light 160-ring (weight 1 each):
    # unweighted, the clique fits in one of two parts; weighted, balance (320 per part) needs it split
    k, n_ring = 16, 160
    heavy = range(k)
    ring = [(k + i, k + (i + 1) % n_ring) for i in range(n_ring)]
    edges = [(a, b) for a in heavy for b in heavy if a != b] + ring + [(d, s) for s, d in ring] + [(0, k), (k, 0)]
    g = edges_graph(edges, k + n_ring)
    weights = torch.tensor([30] * k + [1] * n_ring)
    plain = partition(g, 2, "metis")
    assert len({int(plain.parts[v]) for v in heavy}) == 1
    p = partition(g, 2, "metis", vertex_weights=weights)
    load = torch.zeros(2, dtype=torch.int64).index_add_(0, p.parts, weights)
    assert len({int(p.parts[v]) for v in heavy}) == 2
    assert int(load.max()) <= 1.05 * int(weights.sum()) / 2


def test_metis_edge_weights_choose_the_light_cut():
    # a 12-ring: every edge heavy (100) except (2, 3) and (8, 9) (1 each): the cut takes the light pair
    n = 12
    edges = [(v, (v + 1) % n) for v in range(n)] + [((v + 1) % n, v) for v in range(n)]
    g = edges_graph(edges, n)
    light = {(2, 3), (3, 2), (8, 9), (9, 8)}
    ew = torch.tensor([1 if (int(s), int(d)) in light else 100 for s, d in zip(g.indices, g.dst)])
    p = partition(g, 2, "metis", edge_weights=ew, name="weighted")
    assert p.method == "weighted"
    parts = p.parts.tolist()
    cut = {(s, d) for s, d in edges if parts[s] != parts[d]}
    assert cut == light
    assert sorted(torch.bincount(p.parts).tolist()) == [6, 6]


def test_metis_multi_constraint_and_weight_errors():
    g = sbm_graph(120)
    two = torch.stack([g.train_mask.long(), g.in_degree()], dim=1)
    p = partition(g, 3, "metis", vertex_weights=two)
    assert p.parts.shape == (120,) and sorted(set(p.parts.tolist())) == [0, 1, 2]
    for col in range(2):
        load = torch.zeros(3, dtype=torch.int64).index_add_(0, p.parts, two[:, col])
        assert float(load.max()) <= 1.25 * float(two[:, col].sum()) / 3
    ew = torch.ones(g.num_edges, dtype=torch.int64)
    with pytest.raises(GraphError, match="integer"):
        partition(g, 2, "metis", edge_weights=ew.double())
    with pytest.raises(GraphError, match="shape"):
        partition(g, 2, "metis", edge_weights=ew[1:])
    with pytest.raises(GraphError, match="negative"):
        partition(g, 2, "metis", edge_weights=-ew)
    with pytest.raises(PlanningError, match="metis"):
        partition(g, 2, "contiguous", edge_weights=ew)
    with pytest.raises(PlanningError, match="metis"):
        partition(g, 2, "contiguous", vertex_weights=two)
    with pytest.raises(GraphError, match="constraint"):
        partition(g, 2, "metis", vertex_weights=torch.zeros(120, 2, dtype=torch.int64))


def test_weights_scaled_to_fit_a_narrow_metis_index():
    w = np.array([1, 0, 2**40, 5], dtype=np.int64)
    narrow = _fit_index_type(w, np.int32)
    assert narrow.dtype == np.int32 and int(narrow.sum()) <= np.iinfo(np.int32).max // 4
    assert narrow.tolist()[:2] == [1, 0] and narrow[3] >= 1  # zero stays zero, positive stays positive
    assert _fit_index_type(w, np.int64).tolist() == w.tolist()


def test_presampled_partition_on_a_sampled_graph():
    g = sbm_graph(300)
    w = presample(g, [4, 3], 32, epochs=3, seed=1)
    full = presampled_partition(g, 4, w, seed=2)
    node = presampled_partition(g, 4, w, edge_weights=False, seed=2)
    assert full.method == "presampled-metis" and node.method == "presampled-metis-vertex"
    for p in (full, node):
        assert sorted(set(p.parts.tolist())) == [0, 1, 2, 3]
        load = torch.zeros(4, dtype=torch.int64).index_add_(0, p.parts, w.vertex)
        assert float(load.max()) <= 1.1 * float(w.vertex.sum()) / 4
    # the weighted cut of the edge-weighted partition is no worse than the vertex-only one's (up to METIS noise)
    def weighted_cut(p):
        return int(w.edge[p.parts[g.indices] != p.parts[g.dst]].sum())
    assert weighted_cut(full) <= 1.1 * weighted_cut(node)
    # balancing the sampled in-edges (alone or with k_v as a second constraint)
    edge_load = w.in_edge_load(g)
    assert edge_load.tolist() == [int(w.edge[g.dst == v].sum()) for v in range(g.num_nodes)]
    # (two constraints on 300 vertices: METIS meets them more loosely)
    for balance, name, tol in (("edges", "presampled-metis-edges", 1.1), ("both", "presampled-metis-both", 1.25)):
        p = presampled_partition(g, 4, w, balance=balance, seed=2)
        assert p.method == name and sorted(set(p.parts.tolist())) == [0, 1, 2, 3]
        load = torch.zeros(4, dtype=torch.int64).index_add_(0, p.parts, edge_load)
        assert float(load.max()) <= tol * float(edge_load.sum()) / 4
    with pytest.raises(PlanningError, match="balance"):
        presampled_partition(g, 4, w, balance="rows")
    with pytest.raises(GraphError, match="weights are for"):
        presampled_partition(sbm_graph(100), 2, w)
    with pytest.raises(GraphError, match="PresampleWeights"):
        presampled_partition(g, 2, w.vertex)


# ------------------------------------------------------------------------------------- split statistics
def brute_split(batch: SampledBatch, parts: list[int], p: int) -> dict[str, list]:
    out: dict[str, list] = {k: [] for k in ("dst", "src", "remote", "owned_src", "edges", "cross", "send")}
    for i, block in enumerate(batch.blocks):
        ids = batch.src_ids[i].tolist()
        indptr, indices = block.indptr.tolist(), block.indices.tolist()
        dst, edges, cross, owned = [0] * p, [0] * p, [0] * p, [0] * p
        need: list[set[int]] = [set() for _ in range(p)]
        for v in ids:
            owned[parts[v]] += 1
        for j in range(block.num_nodes):
            q = parts[ids[j]]
            dst[q] += 1
            need[q].add(ids[j])
            for k in range(indptr[j], indptr[j + 1]):
                s = ids[indices[k]]
                edges[q] += 1
                cross[q] += parts[s] != q
                need[q].add(s)
        send = [[0] * p for _ in range(p)]
        for q in range(p):
            for v in need[q]:
                if parts[v] != q:
                    send[parts[v]][q] += 1
        for k, val in (("dst", dst), ("src", [len(x) for x in need]), ("owned_src", owned), ("edges", edges),
                       ("cross", cross), ("send", send), ("remote", [sum(send[r][q] for r in range(p))
                                                                     for q in range(p)])):
            out[k].append(val)
    return out


@settings(max_examples=50, deadline=None)
@given(g=small_graphs(), data=st.data())
def test_split_stats_match_brute_force(g, data):
    p = data.draw(st.integers(1, 4))
    parts = data.draw(st.lists(st.integers(0, p - 1), min_size=g.num_nodes, max_size=g.num_nodes))
    fanouts = data.draw(st.lists(st.sampled_from([-1, 1, 2]), min_size=1, max_size=3))
    seeds = data.draw(st.lists(st.integers(0, g.num_nodes - 1), min_size=1, max_size=g.num_nodes, unique=True))
    batch = sample_blocks(g, seeds, fanouts, seed=data.draw(st.integers(0, 99)))
    s = split_stats(batch, parts, p)
    expected = brute_split(batch, parts, p)
    for k, v in expected.items():
        assert getattr(s, k).tolist() == v, k
    # the per-part counts add up to the batch's sizes
    for i, (n_dst, n_src, n_edges) in enumerate(batch.sizes()):
        assert int(s.dst[i].sum()) == n_dst and int(s.owned_src[i].sum()) == n_src
        assert int(s.edges[i].sum()) == n_edges
    assert s.total_edges == sum(e for _, _, e in batch.sizes())
    assert torch.equal(s.shuffle_rows, s.remote.sum(dim=1))
    assert bool((s.remote <= s.src).all()) and bool((s.cross <= s.edges).all())


def test_split_stats_hand_made_batch():
    # block 0: destinations [a=0, b=1] (sources 0, 1, 2, 3); block 1: destination a (sources a, b).
    # parts: {0, 2} -> 0, {1, 3} -> 1.
    b0 = LocalGraph(torch.tensor([0, 3, 5]), torch.tensor([1, 2, 3, 0, 2]), 2, 4)  # 0 <- 1, 2, 3; 1 <- 0, 2
    b1 = LocalGraph(torch.tensor([0, 1]), torch.tensor([1]), 1, 2)  # 0 <- 1
    batch = SampledBatch([b0, b1], [torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1])],
                         [torch.tensor([0, 1, 2, 3, 4]), torch.tensor([5])])
    s = split_stats(batch, torch.tensor([0, 1, 0, 1]), 2)
    assert s.dst.tolist() == [[1, 1], [1, 0]]
    assert s.edges.tolist() == [[3, 2], [1, 0]]
    # block 0: 0 <- 1 (cross), 0 <- 2, 0 <- 3 (cross); 1 <- 0 (cross), 1 <- 2 (cross). block 1: 0 <- 1 (cross)
    assert s.cross.tolist() == [[2, 2], [1, 0]]
    # part 0 needs {0, 1, 2, 3} (1, 3 remote), part 1 needs {1, 0, 2} (0, 2 remote)
    assert s.src.tolist() == [[4, 3], [2, 0]] and s.remote.tolist() == [[2, 2], [1, 0]]
    assert s.send[0].tolist() == [[0, 2], [2, 0]] and s.send[1].tolist() == [[0, 0], [1, 0]]
    assert s.owned_src.tolist() == [[2, 2], [1, 1]]
    assert s.load().tolist() == [2, 1] and s.load("edges").tolist() == [4, 2] and s.load("inputs").tolist() == [2, 2]
    assert s.imbalance() == pytest.approx(2 / 1.5) and s.imbalance("edges") == pytest.approx(4 / 3)
    assert s.layer_imbalance() == [pytest.approx(1.0), pytest.approx(2.0)]
    assert s.cross_ratio == pytest.approx(5 / 6) and s.total_cross == 5
    with pytest.raises(PlanningError, match="kind"):
        s.load("rows")
    with pytest.raises(GraphError, match="entries"):
        split_stats(batch, torch.tensor([0, 1, 0]), 2)
    with pytest.raises(GraphError, match="outside"):
        split_stats(batch, torch.tensor([0, 1, 0, 2]), 2)
    assert isinstance(s, SplitStats)
    text = str(s)
    assert len(text.splitlines()) == 1 + 4 + 1 and "cross-split edges 5 of 6" in text
    assert "SplitStats(layers=2, parts=2" in repr(s)


def test_split_stats_of_a_presampled_partition_beat_random():
    g = sbm_graph(400)
    w = presample(g, [4, 3], 64, epochs=4, seed=0)
    gsplit = presampled_partition(g, 4, w)
    rand = partition(g, 4, "random")
    seeds = torch.nonzero(g.train_mask).flatten()[:64]
    batch = sample_blocks(g, seeds, [4, 3], seed=9)
    sg, sr = split_stats(batch, gsplit.parts, 4), split_stats(batch, rand.parts, 4)
    assert sg.cross_ratio < sr.cross_ratio
    assert isinstance(w, PresampleWeights)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_presample_and_split_stats_on_cuda() -> None:
    g = sbm_graph(500)
    gpu = g.to("cuda")
    w = presample(gpu, [4, 3], 64, epochs=2, seed=3)
    assert not w.vertex.is_cuda and w.samples == 2 * -(-int(g.train_mask.sum()) // 64)
    batches = [b.to("cpu") for b in presample_batches(gpu, [4, 3], 64, epochs=2, seed=3)]
    kv, ke, ki = brute_counts(g, batches)
    assert w.vertex.tolist() == kv and w.edge.tolist() == ke and w.inputs.tolist() == ki
    parts = presampled_partition(g, 4, w).parts
    batch = presample_batches(gpu, [4, 3], 64, seed=7).__next__()
    on_gpu, on_cpu = split_stats(batch, parts, 4), split_stats(batch.to("cpu"), parts, 4)
    for k in ("dst", "src", "remote", "owned_src", "edges", "cross", "send"):
        assert torch.equal(getattr(on_gpu, k), getattr(on_cpu, k)), k
