"""Vertex partitioners (`gnncompile.graph.partition`): validity, determinism, balance, statistics.

The statistics of every method are compared with a brute-force Python computation on small random
graphs drawn by hypothesis (isolated vertices, self loops, parallel edges, directed edges, hubs) and
on arbitrary assignments with empty parts. Quality is checked on a stochastic block model: ids
sorted by block make contiguous ranges beat a random assignment, and METIS cuts far fewer edges
than random on the shuffled ids.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gnncompile import DatasetError, Graph, GraphError, PlanningError, datasets
from gnncompile.graph import PARTITIONERS, Partition, partition
from gnncompile.graph.partition import partition_stats

# 7 vertices: 0 is a hub (in and out), 1 -> 1 is a self loop, (2, 3) appears twice, 6 is isolated,
# 4 -> 5 has no reverse edge.
MIXED_EDGES = [(0, 1), (0, 2), (0, 3), (0, 4), (1, 0), (1, 1), (2, 3), (2, 3), (3, 0), (4, 0), (4, 5), (5, 0)]
MIXED_N = 7


def _load(name: str) -> Graph:
    """A shared dataset, or skip where ``../shared/datasets`` is not there (a bare clone)."""
    try:
        return datasets.load(name)
    except DatasetError as e:
        pytest.skip(f"{name} not available: {e}")


def make_graph(edges: list[tuple[int, int]], n: int) -> Graph:
    ei = torch.tensor(edges, dtype=torch.int64).reshape(-1, 2).T
    return Graph.from_edge_index(ei, n)


def brute_stats(edges: list[tuple[int, int]], n: int, parts: list[int], num_parts: int) -> dict:
    """Per-part statistics by direct enumeration of the (source, destination) pairs."""
    local = [0] * num_parts
    for v in range(n):
        local[parts[v]] += 1
    num_edges, cut = [0] * num_parts, [0] * num_parts
    needed: list[set[int]] = [set() for _ in range(num_parts)]
    for s, d in edges:
        p = parts[d]
        num_edges[p] += 1
        if parts[s] != p:
            cut[p] += 1
            needed[p].add(s)
    halo = [[0] * num_parts for _ in range(num_parts)]
    for p in range(num_parts):
        for s in needed[p]:
            halo[p][parts[s]] += 1
    num_halo = [len(x) for x in needed]
    alpha = (n + sum(num_halo)) / n if n else 1.0
    return dict(num_local=local, num_halo=num_halo, num_edges=num_edges, edge_cut=cut, halo=halo, alpha=alpha,
                total_cut=sum(cut))


def assert_matches_brute(p: Partition, edges: list[tuple[int, int]], n: int) -> None:
    ref = brute_stats(edges, n, p.parts.tolist(), p.num_parts)
    assert p.num_local.tolist() == ref["num_local"]
    assert p.num_halo.tolist() == ref["num_halo"]
    assert p.num_edges.tolist() == ref["num_edges"]
    assert p.edge_cut.tolist() == ref["edge_cut"]
    assert p.halo_matrix().tolist() == ref["halo"]
    assert p.total_edge_cut == ref["total_cut"]
    assert p.replication_factor == pytest.approx(ref["alpha"])


@st.composite
def small_graphs(draw: st.DrawFn) -> tuple[list[tuple[int, int]], int]:
    """Directed multigraphs with up to 24 vertices; optionally a hub with many in- and out-edges."""
    n = draw(st.integers(1, 24))
    vid = st.integers(0, n - 1)
    edges = draw(st.lists(st.tuples(vid, vid), max_size=60))
    if draw(st.booleans()):
        hub = draw(vid)
        others = draw(st.lists(vid, max_size=n))
        edges += [(hub, v) for v in others] + [(v, hub) for v in others[::2]]
    return edges, n


def community_graph(sorted_ids: bool) -> Graph:
    """A 2,000-vertex SBM with 4 blocks (85% of edges inside a block); ids sorted by block if asked."""
    g = datasets.synthetic("sbm", num_nodes=2000, avg_degree=10, num_features=2, num_classes=4, homophily=0.85)
    if not sorted_ids:
        return g
    new_id = torch.empty_like(g.y)
    new_id[torch.argsort(g.y, stable=True)] = torch.arange(g.num_nodes)
    return Graph.from_edge_index(new_id[g.edge_index()], g.num_nodes)


# ------------------------------------------------------------------------------------- validity
@settings(max_examples=60, deadline=None)
@given(small_graphs(), st.integers(1, 6), st.sampled_from(PARTITIONERS), st.integers(0, 3))
def test_every_method_matches_brute_force(graph_spec, num_parts, method, seed):
    edges, n = graph_spec
    g = make_graph(edges, n)
    if method == "metis" and num_parts > n:
        with pytest.raises(PlanningError, match=f"num_parts={num_parts} > num_nodes={n}"):
            partition(g, num_parts, method, seed=seed)
        return
    p = partition(g, num_parts, method, seed=seed)
    assert p.parts.dtype == torch.int64 and p.parts.shape == (n,)
    assert bool(((p.parts >= 0) & (p.parts < num_parts)).all())
    assert p.method == method and p.num_parts == num_parts
    assert_matches_brute(p, edges, n)
    if method == "metis":
        assert bool((p.num_local > 0).all()), "METIS parts are filled when num_parts <= num_nodes"


@settings(max_examples=60, deadline=None)
@given(small_graphs(), st.integers(1, 8), st.data())
def test_stats_of_arbitrary_assignment(graph_spec, num_parts, data):
    """Any assignment, empty parts included, gets the brute-force statistics."""
    edges, n = graph_spec
    parts = data.draw(st.lists(st.integers(0, num_parts - 1), min_size=n, max_size=n))
    g = make_graph(edges, n)
    p = Partition(torch.tensor(parts), num_parts, "custom", partition_stats(g, parts, num_parts))
    assert_matches_brute(p, edges, n)


@pytest.mark.parametrize("method", PARTITIONERS)
def test_mixed_graph_brute_force_and_one_part(method):
    g = make_graph(MIXED_EDGES, MIXED_N)
    for num_parts in (2, 3):
        assert_matches_brute(partition(g, num_parts, method), MIXED_EDGES, MIXED_N)
    one = partition(g, 1, method)
    assert one.parts.tolist() == [0] * MIXED_N
    assert one.replication_factor == 1.0
    assert one.total_edge_cut == 0 and one.num_halo.tolist() == [0]
    assert one.num_edges.tolist() == [len(MIXED_EDGES)]


@pytest.mark.parametrize("method", PARTITIONERS)
def test_deterministic_for_a_seed(method):
    g = _load("cora")
    a, b = partition(g, 8, method, seed=5), partition(g, 8, method, seed=5)
    assert torch.equal(a.parts, b.parts)
    assert torch.equal(a.halo_matrix(), b.halo_matrix())


@pytest.mark.parametrize("seed", [-1, 2**64, True, 1.0])
def test_seeds_are_ints_below_2_63(seed):
    """-1 raised numpy's ValueError for "random" and was taken mod 2^31 by METIS; 2^64 was taken."""
    with pytest.raises(PlanningError, match=r"seed must be an int in \[0, 2\^63\)"):
        partition(make_graph([(0, 1), (1, 2)], 3), 2, "random", seed=seed)


def test_random_seed_changes_assignment():
    g = _load("cora")
    assert not torch.equal(partition(g, 4, "random", seed=0).parts, partition(g, 4, "random", seed=1).parts)


# ------------------------------------------------------------------------------------- balance
@pytest.mark.parametrize("n, num_parts", [(10, 3), (2708, 8), (5, 5), (100, 7), (3, 7)])
@pytest.mark.parametrize("method", ["random", "contiguous"])
def test_balanced_by_vertices(n, num_parts, method):
    g = make_graph([(i, (i + 1) % n) for i in range(n)], n)
    p = partition(g, num_parts, method)
    sizes = p.num_local
    assert int(sizes.max() - sizes.min()) <= 1
    assert int(sizes.sum()) == n
    if method == "contiguous":
        assert bool((p.parts[1:] >= p.parts[:-1]).all()), "contiguous parts are id ranges"


def test_contiguous_edge_balance_cuts_at_indptr():
    g = _load("cora")
    p = partition(g, 4, "contiguous", balance="edges")
    assert bool((p.parts[1:] >= p.parts[:-1]).all())
    share, max_deg = g.num_edges / 4, int(g.in_degree().max())
    assert bool((p.num_edges <= share + max_deg).all()) and bool((p.num_edges >= share - max_deg).all())
    # the first vertex of part k is the first whose exclusive edge prefix reaches k/4 of the edges
    starts = [int(p.members(k)[0]) for k in range(4)]
    assert starts == [int(torch.searchsorted(g.indptr[:-1] * 4, k * g.num_edges)) for k in range(4)]


def test_contiguous_vertex_weights():
    g = _load("cora")
    w = torch.arange(g.num_nodes) % 5  # zeros included
    p = partition(g, 4, "contiguous", vertex_weights=w)
    per_part = torch.zeros(4, dtype=torch.int64).index_add_(0, p.parts, w)
    assert bool((per_part - w.sum() / 4).abs().max() <= 4)


@pytest.mark.parametrize("weights", ["edges", "explicit"])
def test_metis_weights(weights):
    g = _load("cora")
    if weights == "edges":
        p, w = partition(g, 4, "metis", balance="edges"), g.in_degree()
    else:
        w = 1 + g.in_degree()
        p = partition(g, 4, "metis", vertex_weights=w)
    per_part = torch.zeros(4, dtype=torch.int64).index_add_(0, p.parts, w)
    assert float(per_part.max()) <= 1.1 * float(w.sum()) / 4


# ------------------------------------------------------------------------------------- quality
def test_contiguous_beats_random_on_sorted_communities():
    g = community_graph(sorted_ids=True)
    cont, rand = partition(g, 4, "contiguous"), partition(g, 4, "random")
    assert cont.replication_factor < rand.replication_factor
    assert cont.total_edge_cut < rand.total_edge_cut


def test_metis_beats_random_on_sbm():
    g = community_graph(sorted_ids=False)
    metis, rand = partition(g, 4, "metis"), partition(g, 4, "random")
    assert metis.total_edge_cut < 0.5 * rand.total_edge_cut
    assert metis.replication_factor < rand.replication_factor


# ------------------------------------------------------------------------------------- empty parts
@pytest.mark.parametrize("method", ["contiguous", "random"])
def test_more_parts_than_vertices(method):
    g = make_graph([(0, 1), (1, 2), (2, 0)], 3)
    p = partition(g, 7, method)
    assert int((p.num_local == 0).sum()) == 4
    assert_matches_brute(p, [(0, 1), (1, 2), (2, 0)], 3)
    for part in range(7):
        members = p.members(part)
        assert members.numel() == int(p.num_local[part])
    assert len(str(p).splitlines()) == 7 + 3


@pytest.mark.parametrize("edges, n, num_parts", [
    ([(i, j) for i in range(10) for j in range(10) if i != j], 10, 7),  # METIS puts the clique in one part
    ([(0, 1), (1, 2), (2, 3)], 4, 4),
    ([], 5, 3),
])
def test_metis_fills_empty_parts(edges, n, num_parts):
    p = partition(make_graph(edges, n), num_parts, "metis")
    assert bool((p.num_local > 0).all())
    assert_matches_brute(p, edges, n)


def test_empty_graph():
    g = make_graph([], 0)
    for method in ("contiguous", "random"):
        p = partition(g, 3, method)
        assert p.parts.numel() == 0 and p.replication_factor == 1.0
        assert p.members(2).numel() == 0
    assert partition(g, 1, "metis").parts.numel() == 0


# ------------------------------------------------------------------------------------- members, printing
def test_members_and_table():
    g = _load("cora")
    p = partition(g, 5, "metis")
    all_members = torch.cat([p.members(k) for k in range(5)])
    assert torch.equal(torch.sort(all_members).values, torch.arange(g.num_nodes))
    for k in range(5):
        m = p.members(k)
        assert bool((p.parts[m] == k).all()) and bool((m[1:] > m[:-1]).all())
    with pytest.raises(PlanningError, match="part 5 outside"):
        p.members(5)
    text = str(p)
    assert text.splitlines()[0].split() == ["part", "local", "halo", "edges", "cut"]
    assert f"alpha = {p.replication_factor:.4f}" in text and "10,556" in text
    assert "alpha=" in repr(p)


def test_halo_matrix_row_sums_and_diagonal():
    p = partition(_load("citeseer"), 6, "random")
    h = p.halo_matrix()
    assert torch.equal(h.sum(dim=1), p.num_halo)
    assert int(h.diagonal().abs().sum()) == 0


# ------------------------------------------------------------------------------------- serialization
def test_dict_round_trip():
    p = partition(_load("cora"), 4, "metis")
    q = Partition.from_dict(json.loads(json.dumps(p.to_dict())))
    assert torch.equal(q.parts, p.parts) and q.method == "metis" and q.num_parts == 4
    for name in ("num_local", "num_halo", "num_edges", "edge_cut"):
        assert torch.equal(getattr(q, name), getattr(p, name))
    assert torch.equal(q.halo_matrix(), p.halo_matrix())
    assert q.replication_factor == p.replication_factor and q.total_edge_cut == p.total_edge_cut

    light = Partition.from_dict(json.loads(json.dumps(p.to_dict(include_parts=False))))
    assert light.parts is None and light.replication_factor == p.replication_factor
    assert str(light) == str(p)
    with pytest.raises(PlanningError, match="without its vertex map"):
        light.members(0)


def test_from_dict_rejects_bad_input():
    d = partition(_load("cora"), 3, "contiguous").to_dict()
    with pytest.raises(GraphError, match="missing keys"):
        Partition.from_dict({k: v for k, v in d.items() if k != "num_halo"})
    bad = dict(d, num_halo=[0, 0, 0])
    with pytest.raises(GraphError, match="row sums"):
        Partition.from_dict(bad)
    bad = dict(d, parts=[0] * len(d["parts"]))
    with pytest.raises(GraphError, match="disagree"):
        Partition.from_dict(bad)


# ------------------------------------------------------------------------------------- errors
def test_errors():
    g = make_graph(MIXED_EDGES, MIXED_N)
    with pytest.raises(PlanningError, match="'contiguous', 'random', 'metis'"):
        partition(g, 2, "spectral")
    for bad in (0, -3):
        with pytest.raises(PlanningError, match=f"must be >= 1, got {bad}"):
            partition(g, bad, "random")
    for bad in (2.0, True):
        with pytest.raises(PlanningError, match="expected an int"):
            partition(g, bad, "random")
    with pytest.raises(PlanningError, match="num_parts=8 > num_nodes=7"):
        partition(g, 8, "metis")
    with pytest.raises(PlanningError, match="'vertices', 'edges'"):
        partition(g, 2, "contiguous", balance="bytes")
    with pytest.raises(PlanningError, match="vertex counts only"):
        partition(g, 2, "random", balance="edges")
    with pytest.raises(PlanningError, match="not both"):
        partition(g, 2, "metis", vertex_weights=torch.ones(MIXED_N, dtype=torch.int64), balance="edges")
    with pytest.raises(GraphError, match=r"expected shape \[7\]"):
        partition(g, 2, "metis", vertex_weights=torch.ones(3, dtype=torch.int64))
    with pytest.raises(GraphError, match="integer dtype"):
        partition(g, 2, "metis", vertex_weights=torch.ones(MIXED_N))
    with pytest.raises(GraphError, match="vertex 2 has negative weight -1"):
        partition(g, 2, "contiguous", vertex_weights=torch.tensor([1, 1, -1, 1, 1, 1, 1]))
    with pytest.raises(GraphError, match=r"vertex 3 has part id 9 outside \[0, 2\)"):
        partition_stats(g, [0, 1, 0, 9, 0, 0, 0], 2)
    with pytest.raises(GraphError, match=r"expected shape \[7\]"):
        partition_stats(g, [0, 1], 2)


@pytest.mark.parametrize("method", PARTITIONERS)
def test_compact_graphs_past_int32_keys(method: str) -> None:
    """A compact graph's int32 indices: keys ``dst * n + src`` pass 2**31 once n > 46341 (METIS's
    adjacency and the halo statistics form them in int64)."""
    n = 50_000
    ei = torch.tensor([[5, n - 1, 1, 49_000], [n - 1, 5, 49_000, 2]])
    g = Graph.from_edge_index(ei, n)
    c = g.compact()
    assert c.indices.dtype == torch.int32
    a, b = partition(g, 2, method, seed=0), partition(c, 2, method, seed=0)
    assert torch.equal(a.parts, b.parts) and repr(a) == repr(b)   # (alpha, edge cut)
