"""`Graph` and `GraphStats`: construction, validation errors, transformations against references.

Validation tests feed one bad input at a time and check that a `GraphError` is raised whose message
names the bad field and the first bad index. Transformations (`to_undirected`, `add_self_loops`,
`remove_self_loops`, `transpose`, `norm_coefficients`) are compared with scipy / networkx (and PyG
where installed) on small graphs holding an isolated vertex, a self loop, a duplicated edge and a
hub; hypothesis checks the structural properties on random small edge lists.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter

import networkx as nx
import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gnncompile import Graph, GraphError, GraphStats

# 6 vertices: 0 is a hub, 1 -> 1 is a self loop, (2, 3) appears twice, 5 is isolated.
MIXED_EDGES = [(0, 1), (0, 2), (0, 3), (0, 4), (1, 0), (1, 1), (2, 3), (2, 3), (3, 0), (4, 2)]
MIXED_N = 6


def mixed_graph(weighted: bool = False) -> Graph:
    ei = torch.tensor(MIXED_EDGES, dtype=torch.int64).T
    w = torch.arange(1, len(MIXED_EDGES) + 1, dtype=torch.float64) if weighted else None
    return Graph.from_edge_index(ei, MIXED_N, edge_weight=w)


def edge_list(g: Graph) -> list[tuple[int, int]]:
    return list(zip(g.src.tolist(), g.dst.tolist()))


def dense_adj(g: Graph) -> np.ndarray:
    """``A[dst, src]`` summed over parallel edges (float64)."""
    a = np.zeros((g.num_nodes, g.num_nodes))
    w = np.ones(g.num_edges) if g.edge_weight is None else g.edge_weight.double().numpy()
    np.add.at(a, (g.dst.numpy(), g.src.numpy()), w)
    return a


def raises(match: str, fn, *args, **kwargs) -> str:
    """Call ``fn`` expecting a GraphError whose message contains every ``|``-separated part of ``match``."""
    with pytest.raises(GraphError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    for part in match.split("|"):
        assert part in msg, f"{part!r} not in error message {msg!r}"
    return msg


# ------------------------------------------------------------------------------------ construction
def test_from_edge_index_sorts_by_destination_and_keeps_parallel_edges() -> None:
    g = mixed_graph(weighted=True)
    assert g.num_nodes == MIXED_N and g.num_edges == len(MIXED_EDGES)
    assert g.indptr.tolist() == [0, 2, 4, 6, 9, 10, 10]
    assert Counter(edge_list(g)) == Counter(MIXED_EDGES)
    for s, d, w in zip(g.src.tolist(), g.dst.tolist(), g.edge_weight.tolist()):
        assert MIXED_EDGES[int(w) - 1] == (s, d)  # weights travel with their edge
    for v in range(MIXED_N):  # sources sorted inside every row
        row = g.indices[g.indptr[v] : g.indptr[v + 1]]
        assert torch.equal(row, torch.sort(row).values)
    assert g.in_degree().tolist() == [2, 2, 2, 3, 1, 0]
    assert g.out_degree().tolist() == [4, 2, 2, 1, 1, 0]
    assert g.has_self_loops() and not g.is_symmetric()


def test_num_nodes_defaults() -> None:
    assert Graph.from_edge_index([[0, 3], [1, 2]]).num_nodes == 4
    assert Graph.from_edge_index([[0], [1]], x=np.zeros((7, 2), np.float32)).num_nodes == 7
    assert Graph.from_edge_index(torch.zeros(2, 0, dtype=torch.int64)).num_nodes == 0
    g = Graph([0, 0, 0], np.zeros(0, np.int64), y=[1, -1])
    assert g.num_nodes == 2 and g.num_classes == 2 and g.num_edges == 0


def test_node_data_conversions() -> None:
    g = Graph.from_edge_index(
        [[0, 1], [1, 0]], 3, x=np.ones((3, 2), dtype=np.int32), train_mask=[1, 0, 1], edge_weight=[2, 3]
    )
    assert g.x.dtype == torch.float32 and g.train_mask.dtype == torch.bool
    assert g.edge_weight.dtype == torch.float32 and g.edge_weight.tolist() == [3.0, 2.0]
    xs = sp.random(3, 5, density=0.5, format="csr", random_state=0, dtype=np.float64)
    h = Graph.from_edge_index([[0], [1]], 3, x=xs)
    assert h.x.layout == torch.sparse_csr and h.num_features == 5
    np.testing.assert_allclose(h.dense_features().numpy(), xs.toarray(), rtol=1e-6)


# ------------------------------------------------------------------------------------ validation
def test_edge_index_ids_out_of_range() -> None:
    raises("edge_index|edge 2|(2, 5)|[0, 5)", Graph.from_edge_index, [[0, 1, 2], [1, 2, 5]], 5)
    raises("edge_index|edge 1|(-1, 0)", Graph.from_edge_index, [[0, -1], [1, 0]], 3)


def test_edge_index_shape_and_dtype() -> None:
    raises("edge_index|[2, E]|[3, 2]", Graph.from_edge_index, torch.zeros(3, 2, dtype=torch.int64))
    raises("edge_index|[2, E]", Graph.from_edge_index, [0, 1, 2])
    raises("edge_index|integer", Graph.from_edge_index, [[0.0, 1.0], [1.0, 0.0]])
    raises("edge_index|integer", Graph.from_edge_index, torch.ones(2, 2, dtype=torch.bool))
    raises("edge_index|object", Graph.from_edge_index, np.array([[0, None], [1, 0]], dtype=object))
    raises("num_nodes|>= 0", Graph.from_edge_index, torch.zeros(2, 0, dtype=torch.int64), -1)


def test_indices_out_of_range() -> None:
    raises("indices|edge 2|source id 4|[0, 3)", Graph, [0, 1, 2, 3], [0, 1, 4])
    raises("indices|edge 0|source id -1", Graph, [0, 1, 1, 1], [-1])
    raises("indices|1-d", Graph, [0, 1], [[0]])
    raises("indices|integer", Graph, [0, 1], [0.5])


def test_indptr_errors() -> None:
    raises("indptr|negative in-degree|vertex 1|indptr[1]=2 > indptr[2]=1", Graph, [0, 2, 1, 3], [0, 0, 0])
    raises("indptr|[4]|num_nodes + 1|[3]", Graph, [0, 1, 2], [0, 1], 3)
    raises("indptr|indptr[0] must be 0|got 1", Graph, [1, 1, 2], [0])
    raises("indptr|indptr[-1]=2|len(indices)=3", Graph, [0, 1, 2], [0, 1, 1])
    raises("indptr|integer", Graph, [0.0, 1.0], [0])
    raises("num_nodes|>= 0", Graph, [0], np.zeros(0, np.int64), -1)


def test_edge_weight_errors() -> None:
    raises("edge_weight|[3]|[2]", Graph.from_edge_index, [[0, 1, 2], [1, 2, 0]], edge_weight=[1.0, 2.0])
    raises("edge_weight|[2]", Graph, [0, 1, 2], [1, 0], edge_weight=[[1.0, 2.0]])
    raises("edge_weight|non-finite|edge 1", Graph, [0, 1, 2], [1, 0], edge_weight=[1.0, math.inf])
    raises("edge_weight|non-finite|nan|edge 0", Graph, [0, 1, 2], [1, 0], edge_weight=[math.nan, 1.0])


def test_feature_errors() -> None:
    ip, ix = [0, 1, 2, 2], [1, 0]
    raises("x|3 rows|num_nodes=4", Graph, [0, 1, 2, 2, 2], ix, x=np.zeros((3, 2), np.float32))
    raises("x|[num_nodes, num_features]|[3]", Graph, ip, ix, x=np.zeros(3, np.float32))
    x = np.zeros((3, 4), np.float32)
    x[2, 1] = np.nan
    x[2, 3] = np.inf
    raises("x|non-finite|nan|row 2, column 1", Graph, ip, ix, x=x)
    x = np.zeros((3, 4), np.float32)
    x[1, 3] = -np.inf
    raises("x|non-finite|-inf|row 1, column 3", Graph, ip, ix, x=x)
    xs = sp.csr_matrix(([1.0, np.nan, 2.0], ([0, 2, 2], [0, 1, 3])), shape=(3, 4))
    raises("x|non-finite|row 2, column 1", Graph, ip, ix, x=xs)
    raises("x|object", Graph, ip, ix, x=np.array([[None]] * 3, dtype=object))


def test_label_errors() -> None:
    ip, ix = [0, 1, 2, 2], [1, 0]
    raises("y|[3]|[2]", Graph, ip, ix, y=[0, 1])
    raises("y|label -2|vertex 1|-1 = unlabeled", Graph, ip, ix, y=[0, -2, 1])
    raises("y|label 3|vertex 2|num_classes=3", Graph, ip, ix, y=[0, 1, 3], num_classes=3)
    raises("y|integer", Graph, ip, ix, y=[0.0, 1.0, 1.0])
    raises("num_classes|>= 0", Graph, ip, ix, num_classes=-1)
    assert Graph(ip, ix, y=[0, -1, 2], num_classes=3).num_classes == 3


def test_mask_errors() -> None:
    ip, ix = [0, 1, 2, 2], [1, 0]
    raises("train_mask|[3]|[4]", Graph, ip, ix, train_mask=[True, False, True, False])
    raises("val_mask|[3]|[1, 3]", Graph, ip, ix, val_mask=[[True, False, True]])
    raises("test_mask|bool|non-0/1", Graph, ip, ix, test_mask=[0, 2, 1])
    raises("train_mask|bool", Graph, ip, ix, train_mask=[0.0, 1.0, 1.0])
    raises("test_mask|vertex 1|no label", Graph, ip, ix, y=[0, -1, 1], test_mask=[False, True, True])


# ------------------------------------------------------------------------------------ transformations
def test_to_undirected_matches_scipy() -> None:
    g = mixed_graph()
    u = g.to_undirected()
    a = sp.csr_matrix(dense_adj(g))
    ref = ((a + a.T) != 0).astype(np.float64).toarray()
    np.testing.assert_array_equal(dense_adj(u), ref)  # parallel edges merged into one
    assert u.is_symmetric() and u.edge_weight is None
    assert len(set(edge_list(u))) == u.num_edges


@pytest.mark.parametrize("reduce", ["max", "sum", "mean"])
def test_to_undirected_weight_reduction(reduce: str) -> None:
    g = mixed_graph(weighted=True)
    groups: dict[tuple[int, int], list[float]] = {}
    for (s, d), w in zip(MIXED_EDGES, range(1, len(MIXED_EDGES) + 1)):
        groups.setdefault((s, d), []).append(float(w))
        groups.setdefault((d, s), []).append(float(w))
    f = {"max": max, "sum": sum, "mean": lambda v: sum(v) / len(v)}[reduce]
    u = g.to_undirected(reduce=reduce)
    got = {(s, d): w for s, d, w in zip(u.src.tolist(), u.dst.tolist(), u.edge_weight.tolist())}
    assert got.keys() == groups.keys()
    for key, ws in groups.items():
        assert got[key] == pytest.approx(f(ws)), key
    raises("reduce|'min'", g.to_undirected, reduce="min")


def test_self_loops_match_scipy() -> None:
    g = mixed_graph(weighted=True)
    a = dense_adj(g)
    loops = g.add_self_loops(fill_value=0.5)
    np.testing.assert_allclose(dense_adj(loops), a + 0.5 * np.eye(MIXED_N))
    assert loops.num_edges == g.num_edges + MIXED_N
    np.testing.assert_allclose(dense_adj(mixed_graph().add_self_loops()), dense_adj(mixed_graph()) + np.eye(MIXED_N))
    removed = g.remove_self_loops()
    np.testing.assert_allclose(dense_adj(removed), a - np.diag(np.diag(a)))
    assert not removed.has_self_loops()
    np.testing.assert_allclose(g.to_scipy().toarray(), a)


def test_transpose_matches_scipy() -> None:
    g = mixed_graph(weighted=True)
    indptr_t, indices_t, perm = g.transpose()
    at = sp.csr_matrix(dense_adj(g).T)  # row u: destinations of u's out-edges (duplicates summed)
    assert indptr_t.tolist()[-1] == g.num_edges
    assert torch.equal(indptr_t[1:] - indptr_t[:-1], g.out_degree())
    assert sorted(perm.tolist()) == list(range(g.num_edges))
    assert torch.equal(indices_t, g.dst[perm])
    rebuilt = sp.csr_matrix(
        (g.edge_weight[perm].double().numpy(), indices_t.numpy(), indptr_t.numpy()), shape=at.shape
    )
    np.testing.assert_allclose(rebuilt.toarray(), at.toarray())
    for u in range(g.num_nodes):
        assert (g.src[perm[indptr_t[u] : indptr_t[u + 1]]] == u).all()


def test_norm_coefficients_against_references() -> None:
    g = mixed_graph(weighted=True)
    a = dense_adj(g)
    deg_in, deg_out = a.sum(axis=1), a.sum(axis=0)
    src, dst, w = g.src.numpy(), g.dst.numpy(), g.edge_weight.double().numpy()
    gcn = g.norm_coefficients("gcn").double().numpy()
    with np.errstate(divide="ignore"):
        ref = w / np.sqrt(deg_in[dst] * deg_out[src])
    np.testing.assert_allclose(gcn, ref, rtol=1e-6)
    np.testing.assert_allclose(g.norm_coefficients("mean").double().numpy(), w / deg_in[dst], rtol=1e-6)
    assert g.norm_coefficients("sum") is g.edge_weight
    assert mixed_graph().norm_coefficients("none") is None
    raises("norm|'sym'|'gcn'", g.norm_coefficients, "sym")


def test_gcn_norm_matches_networkx_on_symmetric_graph() -> None:
    G = nx.karate_club_graph()
    g = Graph.from_networkx(G)
    lap = nx.normalized_laplacian_matrix(G, nodelist=range(G.number_of_nodes()), weight=None).toarray()
    c = sp.csr_matrix(
        (g.norm_coefficients("gcn").double().numpy(), g.indices.numpy(), g.indptr.numpy()), shape=lap.shape
    ).toarray()
    np.testing.assert_allclose(c, np.eye(len(lap)) - lap, atol=1e-6)  # D^-1/2 A D^-1/2 = I - L


def test_gcn_norm_matches_pyg() -> None:
    pytest.importorskip("torch_geometric")
    from torch_geometric.nn.conv.gcn_conv import gcn_norm

    g = mixed_graph().to_undirected().add_self_loops()
    ei, w = gcn_norm(g.edge_index(), None, g.num_nodes, add_self_loops=False)
    ref = {(int(s), int(d)): float(v) for s, d, v in zip(ei[0], ei[1], w)}
    got = dict(zip(edge_list(g), g.norm_coefficients("gcn").tolist()))
    assert got.keys() == ref.keys()
    for key in ref:
        assert got[key] == pytest.approx(ref[key], rel=1e-5)


def test_isolated_vertices_get_zero_coefficients() -> None:
    g = Graph.from_edge_index([[0], [1]], 3)
    assert g.norm_coefficients("gcn").tolist() == [1.0]
    assert g.weighted_in_degree().tolist() == [0.0, 1.0, 0.0]


def test_replace_and_repr() -> None:
    g = mixed_graph()
    h = g.replace(y=torch.zeros(MIXED_N, dtype=torch.int64), name="m")
    assert h.num_classes == 1 and h.name == "m" and torch.equal(h.indices, g.indices)
    with pytest.raises(TypeError, match="unknown fields"):
        g.replace(colour=1)
    raises("y|[6]", g.replace, y=[0])
    assert "num_nodes=6" in repr(g) and "num_edges=10" in repr(g)


# ------------------------------------------------------------------------------------ GraphStats
def test_graph_stats_from_graph() -> None:
    g = mixed_graph().replace(x=torch.zeros(MIXED_N, 3), y=torch.tensor([0, 1, 2, 0, 1, 1]), name="mixed")
    s = GraphStats.from_graph(g)
    deg = np.array([2, 2, 2, 3, 1, 0], dtype=np.float64)
    skew = ((deg - deg.mean()) ** 3).mean() / deg.std() ** 3
    assert (s.num_nodes, s.num_edges, s.num_features, s.num_classes) == (6, 10, 3, 3)
    assert s.degree_mean == pytest.approx(deg.mean()) and s.avg_degree == s.degree_mean
    assert s.degree_max == 3 and s.degree_skew == pytest.approx(skew)
    assert s.name == "mixed" and g.stats() == s
    assert "|V|=6" in str(s) and "|E|=10" in str(s)
    regular = GraphStats.from_graph(Graph.from_edge_index([[0, 1], [1, 0]]))
    assert regular.degree_skew == 0.0 and regular.degree_mean == 1.0
    empty = GraphStats.from_graph(Graph([0], np.zeros(0, np.int64)))
    assert (empty.num_nodes, empty.degree_mean, empty.degree_max) == (0, 0.0, 0)


def test_graph_stats_by_hand() -> None:
    s = GraphStats(num_nodes=111_059_956, num_edges=1_615_685_872, num_features=128, num_classes=172)
    assert s.degree_mean == pytest.approx(1_615_685_872 / 111_059_956)
    assert math.isnan(s.degree_skew) and s.degree_max == -1 and s.replication is None
    s2 = GraphStats(10, 40, 8, 2, replication={2: 1.3, 4: 1.7}, name="x")
    assert s2.replication[4] == 1.7 and s2.avg_degree == 4.0
    assert GraphStats(np.int64(5), 0, 0, 0).num_nodes == 5
    with pytest.raises(Exception):
        s.num_nodes = 3  # frozen


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_nodes=-1, num_edges=0, num_features=0, num_classes=0), "GraphStats.num_nodes|>= 0|-1"),
        (dict(num_nodes=1, num_edges=-5, num_features=0, num_classes=0), "GraphStats.num_edges|>= 0|-5"),
        (dict(num_nodes=1.5, num_edges=0, num_features=0, num_classes=0), "GraphStats.num_nodes|int|float"),
        (dict(num_nodes=1, num_edges=0, num_features=True, num_classes=0), "GraphStats.num_features|int|bool"),
        (dict(num_nodes=1, num_edges=0, num_features=0, num_classes="3"), "GraphStats.num_classes|int|str"),
    ],
)
def test_graph_stats_bad_input(kwargs: dict, match: str) -> None:
    raises(match, GraphStats, **kwargs)


# ------------------------------------------------------------------------------------ properties
@st.composite
def edge_lists(draw, max_nodes: int = 10, max_edges: int = 30):
    n = draw(st.integers(1, max_nodes))
    edges = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=max_edges))
    return n, edges


PROPS = settings(max_examples=60, deadline=None)


@PROPS
@given(edge_lists(), st.randoms(use_true_random=False))
def test_prop_from_edge_index_round_trip(case, rnd) -> None:
    n, edges = case
    weights = [float(rnd.randint(1, 9)) for _ in edges]
    ei = torch.tensor(edges, dtype=torch.int64).reshape(-1, 2).T
    g = Graph.from_edge_index(ei, n, edge_weight=torch.tensor(weights))
    assert Counter(edge_list(g)) == Counter(edges)
    assert Counter(zip(edge_list(g), g.edge_weight.tolist())) == Counter(zip(edges, weights))
    assert torch.equal(g.edge_index(), torch.stack([g.src, g.dst]))
    assert g.in_degree().tolist() == [sum(1 for _, d in edges if d == v) for v in range(n)]
    again = Graph.from_edge_index(g.edge_index(), n, edge_weight=g.edge_weight)
    assert torch.equal(again.indptr, g.indptr) and torch.equal(again.indices, g.indices)
    assert torch.equal(again.edge_weight, g.edge_weight)


@PROPS
@given(edge_lists())
def test_prop_transpose_consistent(case) -> None:
    n, edges = case
    g = Graph.from_edge_index(torch.tensor(edges, dtype=torch.int64).reshape(-1, 2).T, n)
    indptr_t, indices_t, perm = g.transpose()
    assert sorted(perm.tolist()) == list(range(g.num_edges))
    rows = torch.repeat_interleave(torch.arange(n), indptr_t[1:] - indptr_t[:-1])
    assert torch.equal(rows, g.src[perm]) and torch.equal(indices_t, g.dst[perm])
    reversed_graph = Graph.from_edge_index(torch.stack([g.dst, g.src]), n)
    assert torch.equal(indptr_t, reversed_graph.indptr) and torch.equal(indices_t, reversed_graph.indices)
    assert g.is_symmetric() == (Counter(edges) == Counter((d, s) for s, d in edges))


@PROPS
@given(edge_lists())
def test_prop_to_undirected_symmetric(case) -> None:
    n, edges = case
    y = torch.arange(n) % 3
    g = Graph.from_edge_index(torch.tensor(edges, dtype=torch.int64).reshape(-1, 2).T, n, y=y, name="p")
    u = g.to_undirected()
    expected = set(edges) | {(d, s) for s, d in edges}
    assert sorted(edge_list(u)) == sorted(expected)  # no duplicates
    assert u.is_symmetric()
    assert torch.equal(u.y, y) and u.name == "p" and u.num_nodes == n
    assert edge_list(u.to_undirected()) == edge_list(u)
    assert Counter(edge_list(u.remove_self_loops())) == Counter(e for e in expected if e[0] != e[1])


def test_to_undirected_of_a_compact_graph_past_int32_keys() -> None:
    """``dst * n + src`` in int32 (a compact graph's indices) wrapped once n > 46341."""
    n = 100_000
    g = Graph.from_edge_index(torch.tensor([[5, 7], [90_000, 99_999]]), n)
    want = g.to_undirected()
    got = g.compact().to_undirected()
    assert torch.equal(got.edge_index().long(), want.edge_index().long())
    assert sorted(map(tuple, want.edge_index().t().tolist())) == [(5, 90_000), (7, 99_999), (90_000, 5), (99_999, 7)]


@pytest.mark.parametrize("field, value", [("degree_mean", -1.0), ("degree_mean", math.inf), ("degree_max", -5),
                                          ("degree_skew", math.inf), ("replication", {2: 0.5})])
def test_graph_stats_refuse_impossible_degrees(field: str, value: object) -> None:
    with pytest.raises(GraphError, match=rf"GraphStats\.{field}"):
        GraphStats(num_nodes=100, num_edges=500, num_features=8, num_classes=2, **{field: value})


# ------------------------------------------------------------------------------------ input checks (hunt 4)
def _csr(crow: list[int], col: list[int], shape: tuple[int, int]) -> torch.Tensor:
    """A torch sparse CSR tensor built without torch's invariant checks (what a caller can hand in)."""
    return torch.sparse_csr_tensor(torch.tensor(crow), torch.tensor(col), torch.ones(len(col)), size=shape,
                                   check_invariants=False)


def test_sparse_feature_structure_is_validated() -> None:
    """A torch CSR ``x`` with a column outside the matrix or a broken ``crow_indices`` used to be
    accepted (only its values were checked) and trained on, reading out of bounds."""
    ei = [[0, 1, 2], [1, 2, 0]]
    raises("x|entry 1 (row 1)|column 7|[0, 3)", Graph.from_edge_index, ei, x=_csr([0, 1, 2, 3], [0, 7, 1], (3, 3)))
    raises("x|entry 2 (row 2)|column -1", Graph.from_edge_index, ei, x=_csr([0, 1, 2, 3], [0, 1, -1], (3, 3)))
    raises("x|crow_indices decreasing at row 1|crow_indices[1]=2 > crow_indices[2]=1",
           Graph.from_edge_index, ei, x=_csr([0, 2, 1, 3], [0, 1, 1], (3, 3)))
    raises("x|crow_indices[0] must be 0|got 1", Graph.from_edge_index, ei, x=_csr([1, 1, 2, 3], [0, 1, 1], (3, 3)))
    raises("x|crow_indices[-1]=2|len(col_indices)=3", Graph.from_edge_index, ei,
           x=_csr([0, 1, 2, 2], [0, 1, 1], (3, 3)))
    raises("x|crow_indices|[4] (rows + 1)|[3]", Graph.from_edge_index, ei, x=_csr([0, 1, 3], [0, 1, 1], (3, 3)))
    coo = torch.sparse_coo_tensor(torch.tensor([[0, 1, 3], [0, 1, 1]]), torch.ones(3), size=(3, 2))
    raises("x|COO entry 2|(3, 1)|[3, 2]", Graph.from_edge_index, ei, x=coo)
    raises("x|sparse_csc|to_sparse_csr", Graph.from_edge_index, ei, x=torch.eye(3).to_sparse_csc())
    ok = Graph.from_edge_index(ei, x=_csr([0, 1, 1, 3], [2, 0, 1], (3, 3)))  # a valid one still passes
    assert ok.dense_features().tolist() == [[0, 0, 1], [0, 0, 0], [1, 1, 0]]


def _sparse_case() -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    n = 40
    ei = torch.randint(0, n, (2, 160), generator=gen)
    y, tm = torch.arange(n) % 3, torch.rand(n, generator=gen) < 0.5
    return ei, n, y, tm, (torch.rand(n, 8, generator=gen) < 0.3).double()


def test_sparse_features_follow_the_dense_dtype_policy() -> None:
    """Sparse integer features were refused ("expected a floating dtype") while dense ones became
    float32; now every layout has one policy: integer and bool -> float32, floating kept."""
    import gnncompile as gc

    ei, n, y, tm, dense = _sparse_case()
    for x in (dense.int(), dense.int().to_sparse_csr(), dense.int().to_sparse(), dense.bool().to_sparse_csr()):
        g = Graph.from_edge_index(ei, n, x=x, y=y, train_mask=tm)
        assert g.x.dtype == torch.float32 and torch.equal(g.dense_features(), dense.float()), (x.layout, x.dtype)
    for x in (dense, dense.to_sparse_csr(), dense.to_sparse()):
        g = Graph.from_edge_index(ei, n, x=x, y=y, train_mask=tm)
        assert g.x.dtype == torch.float64 and torch.equal(g.dense_features(), dense), x.layout
    g = Graph.from_edge_index(ei, n, x=dense.to_sparse_csr(), y=y, train_mask=tm)
    h = gc.train(gc.nn.GCN(8, 8, 3), g, epochs=1, verbose=False, dtype=torch.float64)
    assert math.isfinite(h.loss[0])
    g32 = Graph.from_edge_index(ei, n, x=dense.float().to_sparse_csr(), y=y, train_mask=tm)
    assert math.isfinite(gc.train(gc.nn.GCN(8, 8, 3), g32, epochs=1, verbose=False).loss[0])


def test_train_casts_sparse_float64_features_to_a_float32_model() -> None:
    import gnncompile as gc

    ei, n, y, tm, dense = _sparse_case()
    g = Graph.from_edge_index(ei, n, x=dense.to_sparse_csr(), y=y, train_mask=tm)
    assert math.isfinite(gc.train(gc.nn.GCN(8, 8, 3), g, epochs=1, verbose=False).loss[0])
    plan = gc.plan(gc.nn.GCN(8, 8, 3), g, gpus=2, strategy="data", partitioner="contiguous")
    assert math.isfinite(plan.run(epochs=1, timeout=60).history.loss[0])  # the ranks cast it too


def test_complex_features_and_weights_are_refused() -> None:
    """Complex ``x`` was cast to float32 with the imaginary part dropped (a warning at most)."""
    ei = [[0, 1], [1, 0]]
    raises("x|complex64|imaginary", Graph.from_edge_index, ei, x=torch.ones(2, 2, dtype=torch.complex64))
    raises("x|complex", Graph.from_edge_index, ei, x=torch.eye(2, dtype=torch.complex64).to_sparse_csr())
    raises("x|real|complex", Graph.from_edge_index, ei, x=sp.csr_matrix(np.eye(2, dtype=np.complex64)))
    raises("edge_weight|real|complex", Graph.from_edge_index, ei, edge_weight=torch.ones(2, dtype=torch.complex64))


def test_bad_edge_weight_is_named_by_the_callers_index() -> None:
    """The index used to be the position after the internal (dst, src) sort: edge 2 for the
    caller's edge 1 below."""
    ei = [[0, 1, 2, 3], [3, 2, 1, 0]]
    raises("edge_weight|non-finite|nan|edge 1 (1 -> 2)", Graph.from_edge_index, ei,
           edge_weight=[1.0, math.nan, 1.0, 1.0])
    raises("edge_weight|inf|edge 3 (3 -> 0)", Graph.from_edge_index, ei, edge_weight=[1.0, 1.0, 1.0, math.inf])
    a = sp.csr_matrix(np.array([[0, 1, 0], [np.nan, 0, 0], [0, np.inf, 0]]))  # CSC order would name [2, 1] first
    raises("edge_weight|non-finite|nan|matrix[1, 0]|edge 1 -> 0", Graph.from_scipy, a)


def test_to_scipy_and_from_scipy_are_transposes() -> None:
    """``to_scipy`` is the propagation matrix ``A[dst, src]``, ``from_scipy`` reads the adjacency
    ``matrix[u, v] = u -> v``: ``from_scipy(to_scipy())`` reversed every edge of a directed graph;
    the round trip is ``from_scipy(to_scipy().T)``."""
    g = mixed_graph(weighted=True).remove_self_loops()
    back = Graph.from_scipy(g.to_scipy().T)
    merged = Counter()
    for s, d, w in zip(g.src.tolist(), g.dst.tolist(), g.edge_weight.tolist()):
        merged[(s, d)] += w  # to_scipy sums parallel edges
    assert sorted(zip(back.src.tolist(), back.dst.tolist(), back.edge_weight.tolist())) == sorted(
        (s, d, w) for (s, d), w in merged.items())
    plain = Graph.from_edge_index([[0, 1], [1, 2]])
    assert edge_list(Graph.from_scipy(plain.to_scipy().T)) == edge_list(plain) == [(0, 1), (1, 2)]
    assert edge_list(Graph.from_scipy(plain.to_scipy())) == [(1, 0), (2, 1)]  # the documented transpose
    x = torch.eye(3)
    np.testing.assert_allclose(plain.to_scipy() @ x.numpy(), [[0, 0, 0], [1, 0, 0], [0, 1, 0]])  # out[v] = sum x[u]


def test_num_nodes_and_num_classes_must_be_ints() -> None:
    ei = [[0, 1], [1, 0]]
    raises("num_nodes|expected an int|float 2.5", Graph.from_edge_index, ei, num_nodes=2.5)
    raises("num_nodes|expected an int|str '3'", Graph.from_edge_index, ei, num_nodes="3")
    raises("num_nodes|float", Graph, [0, 1, 2], [1, 0], 2.0)  # the constructor used to truncate silently
    raises("num_nodes|bool", Graph.from_edge_index, ei, num_nodes=True)
    raises("num_classes|expected an int|2.5", Graph.from_edge_index, ei, num_classes=2.5)
    for n in (3, np.int64(3), torch.tensor(3)):
        assert Graph.from_edge_index(ei, num_nodes=n).num_nodes == 3


def test_absurd_vertex_counts_are_refused_before_allocating(monkeypatch: pytest.MonkeyPatch) -> None:
    """A vertex id of 2**40 made the constructor try to allocate terabytes (a raw RuntimeError)."""
    from gnncompile.graph import core

    raises("edge_index|vertex id 1,099,511,627,776|max id + 1|more than gnncompile can index|renumber",
           Graph.from_edge_index, torch.tensor([[0, 2**40], [1, 0]]))
    raises("num_nodes|1,099,511,627,776 vertices|at most 3,037,000,499", Graph.from_edge_index, [[0], [1]],
           num_nodes=2**40)
    monkeypatch.setattr(core, "_memory_bytes", lambda device: 2**20)  # a machine with 1 MiB
    raises("edge_index|vertex id 100,000|need 1.5 MiB|16 bytes per vertex|cpu memory is 1.0 MiB",
           Graph.from_edge_index, torch.tensor([[0, 100_000], [1, 0]]))
    assert Graph.from_edge_index([[0, 9_999], [1, 0]]).num_nodes == 10_000  # 160 kB: fits


def test_graph_to_cuda_without_a_gpu_is_a_gnncompile_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Graph.to("cuda")`` raised torch's AssertionError ("Torch not compiled with CUDA enabled")."""
    from gnncompile import ArgumentError, RuntimeFailure

    g = mixed_graph()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeFailure, match=r"Graph.to\('cuda'\): no CUDA GPU is visible"):
        g.to("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeFailure, match=r"cuda:3.*no such GPU \(1 visible\)"):
        g.to("cuda:3")
    with pytest.raises(ArgumentError, match="'gpu' is not a device"):
        g.to("gpu")
    assert g.to("cpu") is g


def test_float_masks_are_refused_for_their_dtype() -> None:
    """A float 0./1. mask was refused with "non-0/1 values", which it does not have."""
    ip, ix = [0, 1, 2, 2], [1, 0]
    msg = raises("train_mask|bool|got dtype torch.float32|mask.bool()", Graph, ip, ix,
                 train_mask=torch.tensor([0.0, 1.0, 1.0]))
    assert "non-0/1" not in msg
    raises("val_mask|non-0/1|2 at vertex 1", Graph, ip, ix, val_mask=[0, 2, 1])
    assert Graph(ip, ix, test_mask=[0, 1, 1]).test_mask.tolist() == [False, True, True]


def test_numpy_arrays_of_non_numeric_dtypes_are_refused_naming_the_field() -> None:
    """They raised torch.from_numpy's raw TypeError (only object arrays were checked)."""
    ei = [[0, 1], [1, 0]]
    raises("x: numpy dtype <U1 is not supported", Graph.from_edge_index, ei, x=np.array([["a"], ["b"]]))
    raises("y: numpy dtype <U1", Graph.from_edge_index, ei, y=np.array(["a", "b"]))
    raises("train_mask: numpy dtype <U1", Graph.from_edge_index, ei, train_mask=np.array(["1", "0"]))
    raises("x: numpy dtype datetime64", Graph.from_edge_index, ei, x=np.zeros((2, 1), dtype="datetime64[s]"))
    if np.dtype(np.longdouble).itemsize > 8:  # longdouble is float64 on some platforms
        raises("x: numpy dtype float128", Graph.from_edge_index, ei, x=np.zeros((2, 1), dtype=np.longdouble))


def test_ids_past_int64_are_reported_as_given() -> None:
    """uint64 ids from 2**63 up wrapped to negative int64 before the range check, and a list holding
    2**63 (numpy makes it float64) was called a float64 input."""
    raises("edge_index: value 9223372036854775813 at (0, 1) does not fit in int64",
           Graph.from_edge_index, np.array([[0, 2**63 + 5], [1, 0]], dtype=np.uint64))
    raises("indptr: value 18446744073709551615 at 2 does not fit in int64",
           Graph, np.array([0, 1, 2**64 - 1], dtype=np.uint64), [1, 0])
    raises("edge_index: 9223372036854775808 does not fit in int64", Graph.from_edge_index, [[0, 2**63], [1, 0]])
    g = Graph.from_edge_index(np.array([[0, 1], [1, 0]], dtype=np.uint64))  # small uint64 ids still work
    assert edge_list(g) == [(1, 0), (0, 1)]


def test_sparse_coo_features_need_two_sparse_dimensions() -> None:
    """A 3-d or hybrid COO tensor raised torch's RuntimeError from the CSR conversion."""
    ei = [[0, 1], [1, 0]]
    raises("x: expected shape [num_nodes, num_features]|sparse COO of shape [2, 2, 2]|sparse_dim=3",
           Graph.from_edge_index, ei, x=torch.ones(2, 2, 2).to_sparse())
    raises("x: expected shape [num_nodes, num_features]|sparse_dim=1",
           Graph.from_edge_index, ei, x=torch.ones(2, 2).to_sparse(1))


def test_overlapping_masks_warn_naming_the_masks_and_counts() -> None:
    """A test mask overlapping the training mask inflated the reported test accuracy silently; it is
    a warning, not an error (some runs do it on purpose)."""
    ei = [[0, 1, 2, 3], [1, 2, 3, 0]]
    train = np.array([1, 1, 0, 0], dtype=bool)
    with pytest.warns(UserWarning, match=r"train_mask and test_mask share 1 vertices"):
        g = Graph.from_edge_index(ei, train_mask=train, val_mask=~train, test_mask=np.array([0, 1, 1, 0], bool))
    assert g.test_mask.tolist() == [False, True, True, False]
    with pytest.warns(UserWarning, match=r"train_mask and val_mask share 2 vertices; val_mask and test_mask share 2"):
        Graph.from_edge_index(ei, train_mask=train, val_mask=np.ones(4, bool), test_mask=~train)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Graph.from_edge_index(ei, train_mask=train, val_mask=np.array([0, 0, 1, 0], bool),
                              test_mask=np.array([0, 0, 0, 1], bool))


def test_out_of_range_edge_says_the_bound_came_from_the_rows_of_x() -> None:
    msg = raises("edge_index: edge 1 = (1, 2) has a vertex id outside [0, 2)|number of rows of x",
                 Graph.from_edge_index, [[0, 1], [1, 2]], x=np.zeros((2, 1), np.float32))
    assert "rows of x" not in raises("outside [0, 2)", Graph.from_edge_index, [[0, 1], [1, 2]], 2)
    assert msg
