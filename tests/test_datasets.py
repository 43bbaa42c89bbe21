"""Loaders and datasets: the shared npz files against their README, the Planetoid raw loader against
the npz, round trips from scipy / networkx / PyG, the search path, malformed files, and the
synthetic generators (determinism, sizes, homophily, usefulness of the structure).

Tests that read ``shared/datasets`` skip with a reason when the folder cannot be found (CI has it
beside the repository as ``../shared``).
"""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

import networkx as nx
import numpy as np
import pytest
import scipy.sparse as sp
import torch

import gnncompile as gc
from gnncompile import DatasetError, Graph, GraphError
from gnncompile import datasets
from gnncompile.graph.io import from_networkx, from_npz, from_planetoid, from_pyg, from_scipy


def _shared_datasets() -> Optional[Path]:
    for directory in datasets.search_paths():
        if (directory / "cora" / "cora.npz").is_file():
            return directory
    return None


SHARED = _shared_datasets()
needs_shared = pytest.mark.skipif(
    SHARED is None,
    reason="shared/datasets not found (looked above the package and the working directory, and in $GNNCOMPILE_DATA)",
)

# From shared/datasets/README.md: nodes, edges stored, sym., symmetrized, features, sparse storage,
# classes, train/val/test sizes (None = no masks).
README = {
    "cora": (2708, 10556, True, 10556, 1433, False, 7, (140, 500, 1000)),
    "citeseer": (3327, 9104, True, 9104, 3703, False, 6, (120, 500, 1000)),
    "pubmed": (19717, 88648, True, 88648, 0, False, 3, (60, 500, 1000)),
    "coauthor_physics": (34493, 495924, True, 495924, 8415, True, 5, (20696, 6899, 6898)),
    "squirrel": (5201, 216933, False, 396706, 2089, False, 5, (2496, 1664, 1041)),
    "soc_slashdot": (82168, 870161, False, 1008460, 0, False, 0, None),
}


def masks_of(g: Graph) -> tuple[torch.Tensor, ...]:
    return g.train_mask, g.val_mask, g.test_mask


def assert_same_graph(a: Graph, b: Graph) -> None:
    assert a.num_nodes == b.num_nodes
    assert torch.equal(a.indptr, b.indptr) and torch.equal(a.indices, b.indices)
    for fa, fb in zip((a.y, *masks_of(a)), (b.y, *masks_of(b))):
        assert (fa is None and fb is None) or torch.equal(fa, fb)
    if a.x is None or b.x is None:
        assert a.x is None and b.x is None
    else:
        assert torch.equal(a.dense_features(), b.dense_features())
    assert a.num_classes == b.num_classes


def write_npz(path: Path, **arrays: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **arrays)
    return path


def tiny_arrays(**overrides: Any) -> dict[str, Any]:
    """A 4-node directed graph in the npz format: 0->1, 1->2, 2->0, 2->3."""
    arrays: dict[str, Any] = dict(
        edge_index=np.array([[0, 1, 2, 2], [1, 2, 0, 3]], dtype=np.int64),
        num_nodes=np.int64(4),
        is_symmetric=np.bool_(False),
        x=np.arange(8, dtype=np.float32).reshape(4, 2),
        y=np.array([0, 1, -1, 1], dtype=np.int64),
        train_mask=np.array([1, 0, 0, 0], dtype=bool),
        val_mask=np.array([0, 1, 0, 0], dtype=bool),
        test_mask=np.array([0, 0, 0, 1], dtype=bool),
        name=np.array("tiny"),
    )
    arrays.update(overrides)
    return {k: v for k, v in arrays.items() if v is not None}


def gerr(match: str, fn, *args, **kwargs) -> str:
    """Expect a GraphError whose message contains every ``|``-separated part of ``match``."""
    with pytest.raises(GraphError) as info:
        fn(*args, **kwargs)
    for part in match.split("|"):
        assert part in str(info.value), f"{part!r} not in {str(info.value)!r}"
    return str(info.value)


# ------------------------------------------------------------------------------------ shared data
@needs_shared
@pytest.mark.parametrize("name", sorted(README))
def test_load_by_name_matches_readme(name: str) -> None:
    nodes, stored, sym, symmetrized, features, sparse, classes, split = README[name]
    g = datasets.load(name, symmetrize=False)
    assert g.name == name and g.num_nodes == nodes and g.num_edges == stored
    assert g.num_features == features and g.num_classes == classes
    assert g.is_symmetric() == sym and not g.has_self_loops()
    if features:
        assert (g.x.layout == torch.sparse_csr) == sparse
    if split is None:
        assert g.y is None and g.train_mask is None
    else:
        assert tuple(int(m.sum()) for m in masks_of(g)) == split
        assert not bool((g.train_mask & g.test_mask).any())
    if not sym:  # default: one-directional graphs are symmetrized for node classification
        default = datasets.load(name)
        assert default.num_edges == symmetrized and default.is_symmetric()
        assert torch.equal(default.y, g.y) if g.y is not None else default.y is None


@needs_shared
def test_load_variants_of_name_and_path() -> None:
    by_name = datasets.load("Coauthor-Physics")
    assert by_name.name == "coauthor_physics"
    assert float(by_name.x.values().max()) == 98.0  # keyword counts as stored
    cora = datasets.load("cora")
    assert_same_graph(datasets.load(SHARED / "cora" / "cora.npz"), cora)
    assert_same_graph(datasets.load(str(SHARED / "cora")), cora)  # a dataset folder
    assert_same_graph(datasets.load(SHARED / "cora" / "raw"), cora)  # a Planetoid raw folder
    assert_same_graph(gc.datasets.load("cora", root=SHARED), cora)
    with pytest.raises(DatasetError, match="no such file"):
        datasets.load(SHARED / "cora" / "missing.npz")


@needs_shared
def test_citeseer_unlabeled_nodes() -> None:
    g = datasets.load("citeseer")
    unlabeled = g.y == -1
    assert int(unlabeled.sum()) == 15
    assert not bool((unlabeled & (g.train_mask | g.val_mask | g.test_mask)).any())
    assert float(g.x[unlabeled].abs().sum()) == 0.0


@needs_shared
def test_multiple_splits() -> None:
    raw = np.load(SHARED / "squirrel" / "squirrel.npz")
    g = datasets.load("squirrel", split=7, symmetrize=False)  # split 0 is checked against the README above
    for field in ("train", "val", "test"):
        assert np.array_equal(getattr(g, f"{field}_mask").numpy(), raw[f"{field}_masks"][7])
    assert not np.array_equal(raw["train_masks"][0], raw["train_masks"][7])
    gerr("squirrel.npz|split|10|10 splits", datasets.load, "squirrel", split=10)
    gerr("cora.npz|split|one split", datasets.load, "cora", split=1)
    gerr("soc_slashdot.npz|split|no masks", datasets.load, "soc_slashdot", split=2)


@needs_shared
@pytest.mark.parametrize("name", ["cora", "citeseer"])
def test_planetoid_raw_equals_npz(name: str) -> None:
    raw = from_planetoid(SHARED / name / "raw", name)
    npz = from_npz(SHARED / name / f"{name}.npz")
    assert raw.name == name and raw.is_symmetric() and not raw.has_self_loops()
    assert_same_graph(raw, npz)  # same node order, so features match row by row
    sparse = from_planetoid(SHARED / name / "raw", name.capitalize(), sparse_features=True)
    assert sparse.x.layout == torch.sparse_csr
    assert torch.equal(sparse.dense_features(), npz.x)


@needs_shared
def test_planetoid_pubmed_without_features() -> None:
    with pytest.raises(DatasetError, match="ind.pubmed.allx"):
        from_planetoid(SHARED / "pubmed" / "raw", "pubmed")
    with pytest.warns(UserWarning, match="ind.pubmed.allx is missing.*ind.pubmed.tx, which is present, is not read"):
        raw = from_planetoid(SHARED / "pubmed" / "raw", "pubmed", allow_missing_features=True)
    assert raw.x is None
    assert_same_graph(raw, from_npz(SHARED / "pubmed" / "pubmed.npz"))


@needs_shared
def test_list_datasets() -> None:
    infos = {info.name: info for info in gc.datasets.list()}
    assert {"cora", "citeseer", "coauthor_physics", "squirrel", "soc_slashdot"} <= set(infos)
    for name, (nodes, stored, sym, _, features, sparse, classes, _) in README.items():
        info = infos[name]
        assert (info.num_nodes, info.num_edges, info.symmetric) == (nodes, stored, sym), name
        assert (info.num_features, info.sparse_features, info.num_classes) == (features, sparse, classes), name
        assert info.path.is_file() and name in str(info)
    assert datasets.list_datasets() == list(infos.values())


@needs_shared
def test_unknown_name_lists_available_and_searched() -> None:
    with pytest.raises(DatasetError) as info:
        datasets.load("not_a_dataset")
    msg = str(info.value)
    assert "'not_a_dataset'" in msg and "cora" in msg and "soc_slashdot" in msg
    assert str(SHARED) in msg and "GNNCOMPILE_DATA" in msg


# ------------------------------------------------------------------------------------ search path
def test_env_var_and_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env_dir, root_dir = tmp_path / "env", tmp_path / "root"
    write_npz(env_dir / "tiny" / "tiny.npz", **tiny_arrays())
    write_npz(env_dir / "flat.npz", **tiny_arrays(name=np.array("flat")))
    write_npz(root_dir / "tiny.npz", **tiny_arrays(name=np.array("from_root")))
    write_npz(env_dir / "cora" / "cora.npz", **tiny_arrays(name=np.array("shadow")))
    monkeypatch.setenv("GNNCOMPILE_DATA", str(env_dir))
    assert datasets.search_paths()[0] == env_dir
    g = datasets.load("tiny")
    assert g.name == "tiny" and g.num_nodes == 4 and g.is_symmetric() and g.num_edges == 8
    assert datasets.load("flat").name == "flat"
    assert datasets.load("cora").name == "shadow"  # $GNNCOMPILE_DATA precedes shared/datasets
    assert datasets.load("tiny", root=root_dir).name == "from_root"  # root precedes everything
    names = [i.name for i in datasets.list_datasets()]
    assert {"tiny", "flat", "cora"} <= set(names)
    info = {i.name: i for i in datasets.list_datasets()}["tiny"]
    assert (info.num_nodes, info.num_edges, info.symmetric, info.num_features, info.num_classes) == (4, 4, False, 2, 2)
    with pytest.raises(DatasetError) as exc:
        datasets.load("absent", root=tmp_path / "nowhere")
    msg = str(exc.value)
    assert "tiny" in msg and "flat" in msg and str(env_dir) in msg and "nowhere (missing)" in msg


def test_shared_folder_found_from_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_npz(tmp_path / "shared" / "datasets" / "walk" / "walk.npz", **tiny_arrays(name=np.array("walk")))
    deep = tmp_path / "main" / "sub"
    deep.mkdir(parents=True)
    monkeypatch.chdir(deep)
    monkeypatch.delenv("GNNCOMPILE_DATA", raising=False)
    assert datasets.load("walk").name == "walk"
    assert (tmp_path / "shared" / "datasets").resolve() in [p.resolve() for p in datasets.search_paths()]


# ------------------------------------------------------------------------------------ npz format
def test_npz_symmetrize_modes(tmp_path: Path) -> None:
    path = write_npz(tmp_path / "t.npz", **tiny_arrays())
    stored = from_npz(path, symmetrize=False)
    assert sorted(zip(stored.src.tolist(), stored.dst.tolist())) == [(0, 1), (1, 2), (2, 0), (2, 3)]
    default = from_npz(path)
    assert default.num_edges == 8 and default.is_symmetric()
    assert_same_graph(from_npz(path, symmetrize=True), default)
    no_flag = write_npz(tmp_path / "n.npz", **tiny_arrays(is_symmetric=None))
    assert from_npz(no_flag).num_edges == 8  # flag absent: symmetry is computed
    lying = write_npz(tmp_path / "l.npz", **tiny_arrays(is_symmetric=np.bool_(True)))
    # a wrong flag is refused where it would be trusted (it used to keep the graph directed silently)
    gerr("l.npz|is_symmetric|says True|column 0 (0 -> 1)|no reverse edge 1 -> 0", from_npz, lying)
    assert from_npz(lying, symmetrize=False).num_edges == 4 and from_npz(lying, symmetrize=True).num_edges == 8
    assert default.name == "tiny" and default.y.tolist() == [0, 1, -1, 1]
    assert default.x.dtype == torch.float32 and default.num_classes == 2


def test_npz_sparse_features_and_optional_arrays(tmp_path: Path) -> None:
    x = sp.random(4, 6, density=0.4, format="csr", random_state=1, dtype=np.float32)
    parts = dict(x=None, x_data=x.data, x_indices=x.indices.astype(np.int64),
                 x_indptr=x.indptr.astype(np.int64), x_shape=np.array(x.shape, dtype=np.int64))
    g = from_npz(write_npz(tmp_path / "s.npz", **tiny_arrays(**parts, class_names=np.array(["a", "b", "c"]))))
    assert g.x.layout == torch.sparse_csr and g.num_features == 6 and g.num_classes == 3
    np.testing.assert_array_equal(g.dense_features().numpy(), x.toarray())
    bare = from_npz(write_npz(tmp_path / "b.npz", **tiny_arrays(
        x=None, y=None, train_mask=None, val_mask=None, test_mask=None, name=None, num_nodes=None)))
    assert bare.x is None and bare.y is None and bare.train_mask is None
    assert bare.name == "b" and bare.num_nodes == 4 and bare.num_classes == 0


def test_npz_bad_files(tmp_path: Path) -> None:
    def bad(stem: str, **overrides: Any) -> Path:
        return write_npz(tmp_path / f"{stem}.npz", **tiny_arrays(**overrides))

    with pytest.raises(DatasetError, match="no such npz file"):
        from_npz(tmp_path / "absent.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip archive")
    with pytest.raises(DatasetError, match="junk.npz"):
        from_npz(tmp_path / "junk.npz")
    gerr("e.npz|'edge_index' is missing", from_npz, bad("e", edge_index=None))
    gerr("r.npz|edge_index|edge 3|(2, 9)|[0, 4)", from_npz, bad("r", edge_index=np.array([[0, 1, 2, 2], [1, 2, 0, 9]])))
    gerr("f.npz|edge_index|[2, E]", from_npz, bad("f", edge_index=np.zeros((3, 2), dtype=np.int64)))
    gerr("d.npz|edge_index|int", from_npz, bad("d", edge_index=np.zeros((2, 2), dtype=np.float32)))
    gerr("n.npz|num_nodes", from_npz, bad("n", num_nodes=np.array([1, 2])))
    gerr("x.npz|x|3 rows|num_nodes=4", from_npz, bad("x", x=np.zeros((3, 2), dtype=np.float32)))
    nan_x = np.zeros((4, 2), dtype=np.float32)
    nan_x[3, 1] = np.nan
    gerr("nan.npz|x|non-finite|row 3, column 1", from_npz, bad("nan", x=nan_x))
    gerr("y.npz|y|label -3|vertex 1", from_npz, bad("y", y=np.array([0, -3, 1, 1])))
    gerr("c.npz|y|label 1|vertex 1|num_classes=1", from_npz, bad("c", class_names=np.array(["only"])))
    gerr("m.npz|train_mask|[4]|[3]", from_npz, bad("m", train_mask=np.ones(3, dtype=bool)))
    gerr("u.npz|val_mask|vertex 2|no label", from_npz, bad("u", val_mask=np.array([0, 0, 1, 0], dtype=bool)))
    gerr("o.npz|'name'|pickle", from_npz, bad("o", name=np.array(["a", 1], dtype=object)))
    csr = dict(x=None, x_data=np.ones(3, np.float32), x_indices=np.array([0, 5, 1]),
               x_indptr=np.array([0, 1, 2, 2, 3]), x_shape=np.array([4, 3]))
    gerr("i.npz|x_indices|entry 1|column 5|[0, 3)", from_npz, bad("i", **csr))
    gerr("p.npz|x_indptr|decreasing at row 1", from_npz, bad("p", **{**csr, "x_indptr": np.array([0, 2, 1, 2, 3])}))
    gerr("l.npz|x_indptr|length 5", from_npz, bad("l", **{**csr, "x_indptr": np.array([0, 1, 3])}))
    gerr("h.npz|x_shape", from_npz, bad("h", **{**csr, "x_shape": np.array([4])}))
    gerr("q.npz|missing parts|x_shape", from_npz, bad("q", **{**csr, "x_shape": None}))
    gerr("b.npz|both dense 'x' and CSR", from_npz, bad("b", **{**csr, "x": np.zeros((4, 3), np.float32)}))
    multi = dict(train_masks=np.zeros((2, 4), bool), val_masks=np.zeros((2, 4), bool), test_masks=np.zeros((3, 4), bool))
    gerr("k.npz|test_masks|3 splits|2", from_npz, bad("k", **multi))
    gerr("s.npz|split|5", from_npz, bad("s", **{**multi, "test_masks": np.zeros((2, 4), bool)}), split=5)
    gerr("v.npz|train_masks|[K, N]", from_npz, bad("v", train_masks=np.zeros(4, bool)))


# ------------------------------------------------------------------------------------ Planetoid files
def write_planetoid(folder: Path, name: str = "toy", skip: tuple[str, ...] = ()) -> None:
    """Nodes 0-3 in allx (train = 0, 1), test ids 6, 4 (tx rows in that order), id 5 missing."""
    folder.mkdir(parents=True, exist_ok=True)
    one_hot = lambda labels: np.eye(3, dtype=np.int32)[labels]  # noqa: E731
    objs = {
        "x": sp.csr_matrix(np.array([[1, 0], [0, 1]], dtype=np.float32)),
        "allx": sp.csr_matrix(np.array([[1, 0], [0, 1], [2, 0], [0, 2]], dtype=np.float32)),
        "tx": sp.csr_matrix(np.array([[6, 6], [4, 4]], dtype=np.float32)),
        "y": one_hot([0, 1]),
        "ally": one_hot([0, 1, 2, 2]),
        "ty": one_hot([1, 0]),
        "graph": {0: [1, 1, 2], 1: [0], 2: [2, 3], 3: [], 4: [6], 5: [], 6: [4]},
    }
    for key, obj in objs.items():
        if key not in skip:
            with open(folder / f"ind.{name}.{key}", "wb") as f:
                pickle.dump(obj, f, protocol=2)
    if "test.index" not in skip:
        (folder / f"ind.{name}.test.index").write_text("6\n4\n")


def test_planetoid_layout_rules(tmp_path: Path) -> None:
    write_planetoid(tmp_path)
    g = from_planetoid(tmp_path, "toy")
    assert g.num_nodes == 7 and g.name == "toy" and g.num_classes == 3
    np.testing.assert_array_equal(
        g.x.numpy(), [[1, 0], [0, 1], [2, 0], [0, 2], [4, 4], [0, 0], [6, 6]]
    )
    assert g.y.tolist() == [0, 1, 2, 2, 0, -1, 1]
    assert g.train_mask.nonzero().flatten().tolist() == [0, 1]
    assert g.val_mask.nonzero().flatten().tolist() == [2, 3]  # next 500, within allx
    assert g.test_mask.nonzero().flatten().tolist() == [4, 6]
    expected = {(0, 1), (1, 0), (0, 2), (2, 0), (2, 3), (3, 2), (4, 6), (6, 4)}
    assert set(zip(g.src.tolist(), g.dst.tolist())) == expected and g.num_edges == len(expected)
    assert_same_graph(datasets.load(tmp_path), g)  # a raw folder path works with load
    gerr("split|1|one split", datasets.load, tmp_path, split=1)


def test_planetoid_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="does not exist"):
        from_planetoid(tmp_path / "nope", "toy")
    write_planetoid(tmp_path / "a", skip=("ty", "graph"))
    with pytest.raises(DatasetError, match="ind.toy.ty, ind.toy.graph"):
        from_planetoid(tmp_path / "a", "toy")
    write_planetoid(tmp_path / "b")
    (tmp_path / "b" / "ind.toy.test.index").write_text("6\nsix\n")
    gerr("ind.toy.test.index|integer", from_planetoid, tmp_path / "b", "toy")
    (tmp_path / "b" / "ind.toy.test.index").write_text("6\n2\n")
    gerr("ind.toy.test.index|line 1|id 2|len(allx)=4", from_planetoid, tmp_path / "b", "toy")
    (tmp_path / "b" / "ind.toy.test.index").write_text("6\n6\n")
    gerr("ind.toy.test.index|line 1|repeats id 6", from_planetoid, tmp_path / "b", "toy")
    write_planetoid(tmp_path / "c")
    with open(tmp_path / "c" / "ind.toy.graph", "wb") as f:
        pickle.dump({0: [1], 1: [0, 9]}, f, protocol=2)
    gerr("ind.toy.graph|neighbour 2|node 9|[0, 7)", from_planetoid, tmp_path / "c", "toy")
    with open(tmp_path / "c" / "ind.toy.graph", "wb") as f:
        pickle.dump(SimpleNamespace(a=1), f, protocol=2)  # a global outside the allowed set
    gerr("ind.toy.graph|cannot unpickle|types.SimpleNamespace", from_planetoid, tmp_path / "c", "toy")
    write_planetoid(tmp_path / "d")
    with open(tmp_path / "d" / "ind.toy.tx", "wb") as f:
        pickle.dump(sp.csr_matrix(np.ones((2, 5), np.float32)), f, protocol=2)
    gerr("ind.toy.tx|5 columns|ind.toy.allx has 2", from_planetoid, tmp_path / "d", "toy")


# ------------------------------------------------------------------------------------ scipy / networkx / PyG
def test_from_scipy_round_trip() -> None:
    a = sp.coo_matrix(([2.0, 3.0, 0.0, 1.0, 1.0], ([0, 1, 2, 3, 3], [1, 2, 0, 0, 0])), shape=(5, 5))
    g = from_scipy(a)  # duplicates (3, 0) summed to 2; the explicit zero is no edge
    assert g.num_nodes == 5 and g.num_edges == 3 and g.name == "scipy"
    np.testing.assert_allclose(g.to_scipy().toarray(), a.toarray().T)  # A[u, v] -> edge u -> v
    assert sorted(zip(g.src.tolist(), g.dst.tolist(), g.edge_weight.tolist())) == [
        (0, 1, 2.0), (1, 2, 3.0), (3, 0, 2.0)]
    ones = from_scipy(sp.csr_array(np.array([[0, 1], [1, 1]], dtype=np.int8)), y=[0, 1], name="b")
    assert ones.edge_weight is None and ones.num_edges == 3 and ones.name == "b" and ones.has_self_loops()
    dense = from_scipy(np.array([[0, 0.5], [0, 0]]))
    assert dense.edge_weight.dtype == torch.float64 and edge_set(dense) == {(0, 1)}
    assert Graph.from_scipy(a).num_edges == 3
    gerr("matrix|square|[2, 3]", from_scipy, sp.csr_matrix((2, 3)))
    gerr("matrix|real|complex", from_scipy, sp.csr_matrix(np.array([[0, 1j], [0, 0]])))
    gerr("matrix|scipy sparse", from_scipy, [[0, 1], [1, 0]])
    gerr("edge_weight|non-finite|nan", from_scipy, sp.csr_matrix(np.array([[0, np.nan], [0, 0]])))
    gerr("x|3 rows|num_nodes=5", from_scipy, a, x=np.zeros((3, 2), np.float32))


def edge_set(g: Graph) -> set[tuple[int, int]]:
    return set(zip(g.src.tolist(), g.dst.tolist()))


def test_from_networkx_round_trip() -> None:
    G = nx.Graph(name="toy")
    G.add_nodes_from([("c", {"f": [0.0, 1.0], "label": 2}), ("a", {"f": [1.0, 0.0], "label": 0}),
                      ("b", {"f": [1.0, 1.0], "label": 1})])
    G.add_edge("c", "a", w=2.0)
    G.add_edge("a", "b", w=0.5)
    G.add_edge("b", "b", w=1.0)
    g = from_networkx(G, node_attr_x="f", node_attr_y="label", edge_attr_weight="w")
    assert g.name == "toy" and g.num_nodes == 3 and g.num_edges == 5  # self loop once
    assert g.y.tolist() == [2, 0, 1] and g.x.tolist() == [[0.0, 1.0], [1.0, 0.0], [1.0, 1.0]]
    ref = nx.to_scipy_sparse_array(G, nodelist=["c", "a", "b"], weight="w").toarray()
    np.testing.assert_allclose(g.to_scipy().toarray(), ref.T)
    D = nx.gnp_random_graph(30, 0.1, seed=3, directed=True)
    d = Graph.from_networkx(D)
    assert edge_set(d) == set(D.edges()) and d.num_edges == D.number_of_edges()
    M = nx.MultiGraph([(0, 1), (0, 1), (1, 2)])
    assert sorted(zip(*from_networkx(M).edge_index().tolist())) == [(0, 1), (0, 1), (1, 0), (1, 0), (1, 2), (2, 1)]
    U = nx.karate_club_graph()
    u = from_networkx(U, edge_attr_weight="weight")
    np.testing.assert_allclose(u.to_scipy().toarray(), nx.to_numpy_array(U, weight="weight"))


def test_from_networkx_errors() -> None:
    G = nx.path_graph(3)
    nx.set_node_attributes(G, {0: [1.0], 1: [1.0, 2.0], 2: [0.0]}, "f")
    gerr("node_attr_x|node 1|2 features|node 0 has 1", from_networkx, G, node_attr_x="f")
    gerr("node_attr_y|node 0|'label'", from_networkx, G, node_attr_y="label")
    nx.set_node_attributes(G, {0: 0, 1: 1.5, 2: 0}, "label")
    gerr("node_attr_y|node 1|non-integer label 1.5", from_networkx, G, node_attr_y="label")
    G.add_edge(0, 1, w=1.0)
    gerr("edge_attr_weight|edge 1|(1, 2)|'w'", from_networkx, G, edge_attr_weight="w")
    gerr("G|networkx", from_networkx, [(0, 1)])


def test_from_pyg_duck_typed_without_torch_geometric() -> None:
    data = SimpleNamespace(edge_index=torch.tensor([[0, 1, 2], [1, 2, 0]]), num_nodes=4,
                           edge_attr=torch.tensor([[0.5], [1.5], [2.5]]), y=torch.tensor([[1], [0], [1], [0]]))
    g = from_pyg(data)
    assert g.num_nodes == 4 and g.y.tolist() == [1, 0, 1, 0] and g.name == "pyg"
    assert sorted(zip(g.src.tolist(), g.dst.tolist(), g.edge_weight.tolist())) == [(0, 1, 0.5), (1, 2, 1.5), (2, 0, 2.5)]
    gerr("data.edge_index|missing", from_pyg, SimpleNamespace(x=torch.zeros(2, 1)))
    gerr("data.y|multi-label", from_pyg, SimpleNamespace(edge_index=torch.zeros(2, 0, dtype=torch.long),
                                                         num_nodes=2, y=torch.zeros(2, 3, dtype=torch.long)))
    gerr("split|3|at most one split", from_pyg, data, split=3)


def test_from_pyg_round_trip() -> None:
    pyg = pytest.importorskip("torch_geometric")
    from torch_geometric.data import Data, HeteroData

    n = 6
    ei = torch.tensor([[0, 1, 2, 3, 4, 5, 0], [1, 2, 3, 4, 5, 0, 3]])
    data = Data(edge_index=ei, x=torch.randn(n, 3), y=torch.tensor([0, 1, 2, 0, 1, 2]),
                edge_weight=torch.rand(7), train_mask=torch.tensor([1, 1, 0, 0, 0, 0], dtype=torch.bool),
                test_mask=torch.zeros(n, 2, dtype=torch.bool))
    data.test_mask[4, 1] = True
    g = Graph.from_pyg(data, split=1)
    assert g.num_nodes == n and torch.equal(g.x, data.x) and torch.equal(g.y, data.y)
    assert g.test_mask.nonzero().flatten().tolist() == [4] and g.val_mask is None
    got = sorted(zip(g.src.tolist(), g.dst.tolist(), g.edge_weight.tolist()))
    assert got == sorted(zip(ei[0].tolist(), ei[1].tolist(), data.edge_weight.tolist()))
    gerr("split|2|test_mask|2 splits", from_pyg, data, split=2)
    isolated = Data(edge_index=torch.tensor([[0], [1]]), num_nodes=5)
    assert from_pyg(isolated).num_nodes == 5
    gerr("HeteroData", from_pyg, HeteroData())
    assert pyg is not None


# ------------------------------------------------------------------------------------ synthetic
def sym_simple(g: Graph) -> None:
    """Symmetric, no self loops, no parallel edges."""
    assert g.is_symmetric() and not g.has_self_loops()
    assert torch.unique(g.dst * g.num_nodes + g.src).numel() == g.num_edges


@pytest.mark.parametrize("kind", datasets.SYNTHETIC_KINDS)
def test_synthetic_determinism_and_sizes(kind: str) -> None:
    kw = dict(num_nodes=3000, avg_degree=12, num_features=16, num_classes=4)
    a, b = datasets.synthetic(kind, seed=5, **kw), datasets.synthetic(kind, seed=5, **kw)
    assert_same_graph(a, b)
    assert torch.equal(a.x, b.x)
    c = datasets.synthetic(kind, seed=6, **kw)
    assert not torch.equal(a.indices, c.indices) if a.num_edges == c.num_edges else True
    assert a.name == f"{kind}-3000" and a.num_nodes == 3000 and a.num_edges == 3000 * 12
    assert a.num_features == 16 and a.num_classes == 4 and a.x.dtype == torch.float32
    sym_simple(a)
    sizes = tuple(int(m.sum()) for m in masks_of(a))
    assert sizes == (1800, 600, 600)
    assert int((a.train_mask | a.val_mask | a.test_mask).sum()) == 3000
    wider = datasets.synthetic(kind, seed=5, **{**kw, "num_features": 8})  # structure stream unchanged
    assert torch.equal(wider.indices, a.indices) and torch.equal(wider.y, a.y)
    exact = datasets.synthetic(kind, num_nodes=500, num_edges=3001, num_features=2, name="e")
    assert exact.num_edges == 3000 and exact.name == "e"


def test_default_sbm_graph() -> None:
    g = datasets.synthetic("sbm", num_nodes=20_000, avg_degree=20, num_features=128, num_classes=8, seed=0)
    assert (g.num_nodes, g.num_edges, g.num_features, g.num_classes) == (20_000, 400_000, 128, 8)
    assert g.name == "sbm-20000"
    sym_simple(g)
    intra = float((g.y[g.src] == g.y[g.dst]).double().mean())
    assert intra == pytest.approx(0.8, abs=0.01)
    assert torch.bincount(g.y).tolist() == [2500] * 8

    # Nearest class mean (fit on train) on the features vs on one-hop mean-aggregated features.
    x, y = g.x.numpy().astype(np.float64), g.y.numpy()
    adj = g.to_scipy()
    agg = sp.diags(1.0 / np.maximum(np.asarray(adj.sum(axis=1)).ravel(), 1)) @ adj @ x

    def centroid_accuracy(f: np.ndarray) -> float:
        tr, te = g.train_mask.numpy(), g.test_mask.numpy()
        means = np.stack([f[tr & (y == c)].mean(axis=0) for c in range(8)])
        pred = (f[te] @ means.T - 0.5 * (means**2).sum(axis=1)).argmax(axis=1)
        return float((pred == y[te]).mean())

    alone, hop = centroid_accuracy(x), centroid_accuracy(agg)
    assert 0.125 < alone < 0.25 and hop > alone + 0.15 and hop < 0.9


def test_sbm_homophily_parameter() -> None:
    for h in (0.3, 0.95):
        g = datasets.synthetic("sbm", num_nodes=4000, avg_degree=10, num_features=4, num_classes=5, homophily=h)
        assert float((g.y[g.src] == g.y[g.dst]).double().mean()) == pytest.approx(h, abs=0.03)
    one = datasets.synthetic("sbm", num_nodes=200, avg_degree=4, num_classes=1, num_features=2)
    assert one.num_edges == 800 and one.num_classes == 1


def test_rmat_is_skewed() -> None:
    g = datasets.synthetic("rmat", num_nodes=5000, num_edges=80_000, num_features=4, seed=1)
    er = datasets.synthetic("er", num_nodes=5000, num_edges=80_000, num_features=4, seed=1)
    assert g.num_edges == er.num_edges == 80_000
    assert int(g.in_degree().max()) > 10 * int(er.in_degree().max())
    assert g.stats().degree_skew > 5 > er.stats().degree_skew
    flat = datasets.synthetic("rmat", num_nodes=1000, avg_degree=6, num_features=2, rmat_probs=(0.25, 0.25, 0.25, 0.25))
    assert flat.num_edges == 6000 and int(flat.in_degree().max()) < 40


def test_synthetic_errors() -> None:
    with pytest.raises(DatasetError, match="unknown kind 'grid'.*sbm, rmat, er"):
        datasets.synthetic("grid")
    gerr("homophily|'sbm' only|'rmat'", datasets.synthetic, "rmat", homophily=0.5)
    gerr("rmat_probs|'rmat' only", datasets.synthetic, "er", rmat_probs=(0.25,) * 4)
    gerr("rmat_probs|summing to 1", datasets.synthetic, "rmat", num_nodes=64, rmat_probs=(0.5, 0.5, 0.5, 0.0))
    gerr("homophily|[0, 1]|1.5", datasets.synthetic, "sbm", num_nodes=10, homophily=1.5)
    gerr("feature_noise|>= 0", datasets.synthetic, "sbm", num_nodes=10, feature_noise=-1.0)
    gerr("num_nodes|>= 1", datasets.synthetic, "er", num_nodes=0)
    gerr("num_edges|at most 90", datasets.synthetic, "er", num_nodes=10, num_edges=100)
    gerr("avg_degree|>= 0", datasets.synthetic, "er", num_nodes=10, avg_degree=-2)
    gerr("num_classes|>= 1", datasets.synthetic, "er", num_nodes=10, num_classes=0)
    gerr("train_fraction", datasets.synthetic, "er", num_nodes=10, train_fraction=0.9, val_fraction=0.2)
    full = datasets.synthetic("er", num_nodes=10, num_edges=90, num_features=1)  # complete graph reachable
    assert full.num_edges == 90


# ------------------------------------------------------------------------------------ first-run messages (issue 18)
def test_garbage_npz_is_not_a_graph_and_no_pickle_is_mentioned(tmp_path: Path) -> None:
    """Random bytes made numpy say "contains pickled data ... load it unsafely": we never load pickles."""
    for stem, data in (("random", bytes(range(7, 250))), ("text", b"hello\n"), ("zip-magic", b"PK\x03\x04junk")):
        path = tmp_path / f"{stem}.npz"
        path.write_bytes(data)
        with pytest.raises(DatasetError) as info:
            from_npz(path)
        msg = str(info.value)
        assert str(path) in msg and "is not a graph file" in msg, msg
        assert "allow_pickle" not in msg and "unsafely" not in msg, msg
    npy = tmp_path / "array.npz"
    with open(npy, "wb") as f:
        np.save(f, np.zeros(3))
    with pytest.raises(DatasetError, match="single .npy array, not a graph"):
        from_npz(npy)
    objects = write_npz(tmp_path / "objects.npz", **tiny_arrays(y=np.array([{"a": 1}, None, 1, 2], dtype=object)))
    msg = gerr("objects.npz|'y'|never loads|not a graph", from_npz, objects)
    assert "allow_pickle" not in msg


def test_label_outside_the_declared_classes_is_refused(tmp_path: Path) -> None:
    """A file declaring its class count (num_classes or class_names) with a label outside it: refused,
    naming the vertex and the label (the count used to widen silently to the largest label + 1)."""
    y = np.array([0, 1, -1, 5])
    declared = write_npz(tmp_path / "declared.npz", **tiny_arrays(y=y, num_classes=np.int64(3)))
    gerr("declared.npz|label 5 at vertex 3|num_classes=3|from num_classes", from_npz, declared)
    named = write_npz(tmp_path / "named.npz", **tiny_arrays(y=y, class_names=np.array(["a", "b", "c"])))
    gerr("named.npz|label 5 at vertex 3|num_classes=3|from class_names", from_npz, named)
    both = write_npz(tmp_path / "both.npz", **tiny_arrays(num_classes=np.int64(4), class_names=np.array(["a", "b"])))
    gerr("both.npz|num_classes|says 4|names 2", from_npz, both)
    gerr("zero.npz|num_classes|positive", from_npz, write_npz(tmp_path / "zero.npz", **tiny_arrays(num_classes=np.int64(0))))
    # declared and consistent: the declared count holds even above the largest label
    assert from_npz(write_npz(tmp_path / "ok.npz", **tiny_arrays(num_classes=np.int64(6)))).num_classes == 6
    # not declared: the count is inferred from the labels (the largest + 1), as documented
    assert from_npz(write_npz(tmp_path / "inferred.npz", **tiny_arrays(y=y))).num_classes == 6


def test_dataset_info_says_what_training_needs(tmp_path: Path) -> None:
    structure = write_npz(tmp_path / "structure" / "structure.npz", **tiny_arrays(x=None, y=None, train_mask=None,
                                                                                   val_mask=None, test_mask=None))
    nofeat = write_npz(tmp_path / "nofeat" / "nofeat.npz", **tiny_arrays(x=None))
    full = write_npz(tmp_path / "full" / "full.npz", **tiny_arrays())
    infos = {i.name: i for i in datasets.list_datasets(root=tmp_path) if i.path in (structure, nofeat, full)}
    assert infos["full"].trainable and infos["full"].missing == ()
    assert not infos["nofeat"].trainable and infos["nofeat"].missing == ("features",)
    assert infos["structure"].missing == ("features", "labels")
    assert "not trainable: no features" in str(infos["nofeat"])
    assert datasets.locate(full) == full and datasets.locate("nofeat", root=tmp_path) == nofeat
    assert datasets.locate(tmp_path / "absent.npz") is None


@needs_shared
def test_pubmed_is_listed_as_not_trainable() -> None:
    info = next(i for i in gc.datasets.list() if i.name == "pubmed")
    assert not info.trainable and info.missing == ("features",)


# ------------------------------------------------------------------------------------ input checks (hunt 4)
def test_sbm_refuses_impossible_requests_instead_of_crashing_or_shrinking() -> None:
    """Fewer vertices than classes raised a raw IndexError; a request the block model cannot draw
    (singleton classes with homophily 1) silently returned far fewer edges (here none)."""
    from gnncompile import ArgumentError

    for kw in (dict(num_nodes=6), dict(num_nodes=5, num_classes=10)):
        with pytest.raises(ArgumentError, match=r"num_nodes: the sbm needs at least one vertex per class.*num_classes"):
            datasets.synthetic("sbm", avg_degree=1, **kw)
    with pytest.raises(ArgumentError, match=r"400 directed edges requested but homophily=1.0 draws only intra-class "
                                            r"pairs.*100 classes of 100 vertices hold 0"):
        datasets.synthetic("sbm", num_nodes=100, num_classes=100, homophily=1.0, avg_degree=4)
    with pytest.raises(ArgumentError, match="homophily=0.0 draws only inter-class pairs.*hold 4 of them"):
        datasets.synthetic("sbm", num_nodes=4, num_classes=2, homophily=0.0, num_edges=10, num_features=1)
    at_most = datasets.synthetic("sbm", num_nodes=4, num_classes=2, homophily=0.0, num_edges=8, num_features=1)
    assert at_most.num_edges == 8 and bool((at_most.y[at_most.src] != at_most.y[at_most.dst]).all())
    exact = datasets.synthetic("sbm", num_nodes=8, num_classes=8, num_edges=56, num_features=1)
    assert exact.num_edges == 56  # every pair: singleton classes are fine when inter-class pairs are drawn


def test_synthetic_reports_a_sampler_shortfall(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the rejection sampler gives up (near the number of pairs a model can produce), the
    graph used to come back smaller than asked without a word."""
    from gnncompile import ArgumentError

    real = datasets._unique_pairs
    monkeypatch.setattr(datasets, "_unique_pairs", lambda draw, n, m, max_rounds=64: real(draw, n, m)[: m - 3])
    for kind in datasets.SYNTHETIC_KINDS:
        with pytest.raises(ArgumentError, match=rf"'{kind}' drew only 97 distinct pairs of the 100 requested"):
            datasets.synthetic(kind, num_nodes=100, num_edges=200, num_features=1)


def test_seed_and_name_arguments_are_checked() -> None:
    from gnncompile import ArgumentError

    with pytest.raises(ArgumentError, match="seed: expected an int >= 0, got -1"):
        datasets.synthetic("er", num_nodes=10, avg_degree=2, seed=-1)
    with pytest.raises(ArgumentError, match="seed: expected an int >= 0, got 1.5"):
        datasets.synthetic("er", num_nodes=10, avg_degree=2, seed=1.5)
    with pytest.raises(ArgumentError, match="name_or_path: expected a dataset name or a path, got NoneType"):
        datasets.load(None)
    with pytest.raises(ArgumentError, match="name_or_path"):
        datasets.locate(3)


def _corrupt_member(path: Path, member: str) -> Path:
    """``path`` (a compressed npz) with the first bytes of ``member``'s compressed data flipped."""
    import zipfile

    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member)
    data = bytearray(path.read_bytes())
    name_len, extra_len = (int.from_bytes(data[info.header_offset + k : info.header_offset + k + 2], "little")
                           for k in (26, 28))
    start = info.header_offset + 30 + name_len + extra_len
    data[start : start + 16] = bytes(b ^ 0xFF for b in data[start : start + 16])
    path.write_bytes(bytes(data))
    return path


def test_listing_skips_unreadable_files_with_the_reason(tmp_path: Path) -> None:
    """One unreadable or malformed npz on the search path made list_datasets (and ``gnncompile
    datasets``) fail entirely; a file without edge_index was listed as trainable."""
    (tmp_path / "broken.npz").write_bytes(b"hello\n")
    write_npz(tmp_path / "bad_nn.npz", edge_index=np.array([[0], [1]]), num_nodes=np.array([2, 3]))
    write_npz(tmp_path / "noei.npz", x=np.ones((3, 2), np.float32), y=np.array([0, 1, 0]))
    write_npz(tmp_path / "badsym.npz", **tiny_arrays(is_symmetric=np.array([True, False])))
    write_npz(tmp_path / "float_ei.npz", **tiny_arrays(edge_index=np.zeros((2, 3), np.float32)))
    random_edges = np.random.default_rng(0).integers(0, 4, (2, 50_000))
    _corrupt_member(write_npz(tmp_path / "corrupt.npz", **tiny_arrays(edge_index=random_edges)), "edge_index.npy")
    good = write_npz(tmp_path / "good.npz", **tiny_arrays())
    with pytest.warns(UserWarning) as caught:
        infos = {i.name: i for i in datasets.list_datasets(root=tmp_path) if i.path.parent == tmp_path}
    assert set(infos) == {"good"} and infos["good"].path == good and infos["good"].trainable
    messages = "\n".join(str(w.message) for w in caught)
    for name, reason in (("broken", "not a zip file"), ("bad_nn", "num_nodes: expected one int, got [2, 3]"),
                         ("noei", "required array 'edge_index' is missing"),
                         ("badsym", "is_symmetric: expected one bool"), ("float_ei", "edge_index: expected an int"),
                         ("corrupt", "cannot read dataset header: zlib.error")):
        assert f"skipped {name!r}, not a readable graph: {tmp_path / name}.npz" in messages, name
        assert reason in messages, reason
    with pytest.raises(DatasetError, match="broken.npz"):
        datasets.load(tmp_path / "broken.npz")
    with pytest.raises(DatasetError, match="corrupt.npz: array 'edge_index' is corrupt"):  # was a raw zlib.error
        datasets.load(tmp_path / "corrupt.npz")
    for name in ("bad_nn", "noei", "badsym", "float_ei"):
        gerr(f"{name}.npz", datasets.load, tmp_path / f"{name}.npz")


def test_npz_symmetry_flag_must_be_one_true_bool(tmp_path: Path) -> None:
    """A non-scalar is_symmetric raised a raw ValueError; a wrong True was trusted (directed graph kept)."""
    gerr("a.npz|is_symmetric|expected one bool|[True, False]", from_npz,
         write_npz(tmp_path / "a.npz", **tiny_arrays(is_symmetric=np.array([True, False]))))
    two = write_npz(tmp_path / "i.npz", **tiny_arrays(is_symmetric=np.int64(2)))
    gerr("i.npz|is_symmetric|expected one bool|2", from_npz, two)
    lie = write_npz(tmp_path / "lie.npz", edge_index=np.array([[0, 1, 2], [1, 2, 0]]), num_nodes=3, is_symmetric=True)
    gerr("lie.npz|is_symmetric|says True|column 0 (0 -> 1)|no reverse edge 1 -> 0", from_npz, lie)
    twice = write_npz(tmp_path / "twice.npz", edge_index=np.array([[0, 0, 1], [1, 1, 0]]), num_nodes=2,
                      is_symmetric=True)
    gerr("twice.npz|column 0 (0 -> 1)|as many times", from_npz, twice)  # multiplicities differ
    sym = write_npz(tmp_path / "sym.npz", edge_index=np.array([[0, 1, 1, 2], [1, 0, 2, 1]]), num_nodes=3,
                    is_symmetric=np.int64(1))
    g = from_npz(sym)
    assert g.num_edges == 4 and g.is_symmetric()


def test_from_pyg_uses_only_floating_edge_attr_as_weights() -> None:
    """Integer edge_attr (edge types, categories) became float edge weights: type 0 a zero weight."""
    ei = torch.tensor([[0, 1, 2], [1, 2, 0]])
    with pytest.warns(UserWarning, match=r"edge_attr holds torch.int64 values \(edge types.*edge_weight = "
                                         r"data.edge_attr.float\(\)"):
        g = from_pyg(SimpleNamespace(edge_index=ei, num_nodes=3, edge_attr=torch.tensor([0, 5, 3])))
    assert g.edge_weight is None and g.num_edges == 3
    with pytest.warns(UserWarning, match=r"edge_attr has shape \[3, 2\] \(edge features"):
        assert from_pyg(SimpleNamespace(edge_index=ei, num_nodes=3, edge_attr=torch.ones(3, 2))).edge_weight is None
    with pytest.warns(UserWarning, match="torch.bool"):
        Graph.from_pyg(SimpleNamespace(edge_index=ei, num_nodes=3, edge_attr=torch.ones(3, 1, dtype=torch.bool)))
    w = from_pyg(SimpleNamespace(edge_index=ei, num_nodes=3, edge_attr=torch.tensor([[0.5], [1.5], [2.5]])))
    assert sorted(w.edge_weight.tolist()) == [0.5, 1.5, 2.5]


def test_planetoid_refuses_fractional_ids_and_says_which_features_it_drops(tmp_path: Path) -> None:
    """A neighbour id 1.5 was truncated to 1; with tx missing, allow_missing_features dropped allx too
    without a word."""
    for key, graph, where in (("n", {0: [1.5], 1: [0]}, "neighbour 0 of key 0 is 1.5"),
                              ("k", {0: [1], 1.5: [0]}, "key 1 is 1.5"),
                              ("f", {0: [1], 1: [2.0]}, "neighbour 0 of key 1 is 2.0")):
        write_planetoid(tmp_path / key)
        with open(tmp_path / key / "ind.toy.graph", "wb") as f:
            pickle.dump(graph, f, protocol=2)
        gerr(f"ind.toy.graph|{where}|integers", from_planetoid, tmp_path / key, "toy")
    write_planetoid(tmp_path / "t", skip=("tx",))
    with pytest.raises(DatasetError, match="ind.toy.tx"):
        from_planetoid(tmp_path / "t", "toy")
    with pytest.warns(UserWarning, match="ind.toy.tx is missing.*without x and ind.toy.allx, which is present"):
        g = from_planetoid(tmp_path / "t", "toy", allow_missing_features=True)
    assert g.x is None and g.num_nodes == 7


def test_unknown_name_for_stats_lists_the_statistics_only_datasets_too() -> None:
    """gc.datasets.stats plans from statistics of datasets not stored here; its error listed only
    the local ones."""
    with pytest.raises(DatasetError, match=r"unknown dataset 'bogus'(.|\n)*statistics only \(for planning\): "
                                           r".*ogbn-papers100M"):
        datasets.stats("bogus")


def test_npz_members_that_are_not_npy_arrays_are_corrupt_not_pickles(tmp_path: Path) -> None:
    """A member that is not in .npy format came back as bytes (raw AttributeError), and a corrupt .npy
    header was reported as "holds Python objects (pickled data)"."""
    import io
    import zipfile

    buf = io.BytesIO()
    np.save(buf, np.array([[0, 1, 1, 2], [1, 0, 2, 1]], dtype=np.int64))
    raw = buf.getvalue()
    for name, blob in (("garbage", b"garbage"), ("shape", raw.replace(b"'shape': (2, 4)", b"'shape': (2, 9)")),
                       ("descr", raw.replace(b"'descr': '<i8'", b"'descr': 'XXX'"))):
        p = tmp_path / f"{name}.npz"
        with zipfile.ZipFile(p, "w") as z:
            z.writestr("edge_index.npy", blob)
        with pytest.raises(DatasetError, match=rf"{name}.npz: array 'edge_index' is corrupt") as info:
            from_npz(p)
        assert "pickle" not in str(info.value)
    p = tmp_path / "objects.npz"
    np.savez(p, edge_index=np.array([[0], [1]], dtype=object))
    gerr("objects.npz: array 'edge_index' holds Python objects", from_npz, p)


def test_npz_feature_shape_too_large_for_a_tensor_is_named(tmp_path: Path) -> None:
    """An x_shape whose rows * cols overflow int64 raised torch's RuntimeError or an OverflowError."""
    for shape in (np.array([2, 2**62]), np.array([2, 2**64 - 1], dtype=np.uint64)):
        p = write_npz(tmp_path / "big.npz", edge_index=np.array([[0], [1]]), num_nodes=2, x_data=np.ones(1),
                      x_indices=np.array([0]), x_indptr=np.array([0, 1, 1]), x_shape=shape)
        gerr(f"big.npz: x_shape: [2, {int(shape[1])}] is too large", from_npz, p)


def test_from_pyg_num_nodes_x_as_a_list_and_split_are_checked() -> None:
    """x as a list raised AttributeError; num_nodes 3.7 or '3' were coerced and a num_nodes
    contradicting x's rows ignored; a split that is not an int raised IndexError."""
    ei = torch.tensor([[0, 1, 2], [1, 2, 0]])
    g = from_pyg(SimpleNamespace(edge_index=ei, x=[[1.0], [2.0], [3.0]]))
    assert g.num_nodes == 3 and g.x.tolist() == [[1.0], [2.0], [3.0]]
    gerr("data.num_nodes: expected an int, got float 3.7", from_pyg, SimpleNamespace(edge_index=ei, num_nodes=3.7))
    gerr("data.num_nodes: expected an int, got str '3'", from_pyg, SimpleNamespace(edge_index=ei, num_nodes="3"))
    gerr("x: has 3 rows but the graph has num_nodes=5", from_pyg,
         SimpleNamespace(edge_index=ei, num_nodes=5, x=torch.zeros(3, 1)))
    assert from_pyg(SimpleNamespace(edge_index=ei, num_nodes=np.int64(4))).num_nodes == 4
    masks = SimpleNamespace(edge_index=ei, num_nodes=3, train_mask=torch.ones(3, 2, dtype=torch.bool))
    assert from_pyg(masks, split=np.int64(1)).train_mask.tolist() == [True] * 3
    for split in (1.0, "1", True):
        gerr(f"split: expected an int, got {type(split).__name__}", from_pyg, masks, split=split)


def test_split_must_be_an_int_for_npz_and_load(tmp_path: Path) -> None:
    p = write_npz(tmp_path / "tiny.npz", **tiny_arrays())
    for split in (1.0, "1", True):
        gerr(f"split: expected an int, got {type(split).__name__}", from_npz, p, split=split)
        gerr(f"split: expected an int, got {type(split).__name__}", datasets.load, p, split=split)


def test_an_empty_dataset_name_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """load("") read the current directory (Path("") is ".")."""
    write_npz(tmp_path / "unrelated.npz", **tiny_arrays())
    monkeypatch.chdir(tmp_path)
    for fn in (datasets.load, datasets.locate, datasets.stats):
        with pytest.raises(gc.ArgumentError, match="name_or_path: is empty"):
            fn("")


@needs_shared
def test_load_forwards_allow_missing_features_to_planetoid_folders() -> None:
    """The error told datasets.load users to pass allow_missing_features=True, which load refused."""
    with pytest.raises(DatasetError, match="ind.pubmed.allx.*pass allow_missing_features=True"):
        datasets.load(SHARED / "pubmed" / "raw")
    with pytest.warns(UserWarning, match="ind.pubmed.allx is missing"):
        g = datasets.load(SHARED / "pubmed" / "raw", allow_missing_features=True)
    assert g.x is None and g.num_nodes == 19717


def test_synthetic_sizes_must_be_ints_and_degree_a_number() -> None:
    """num_features=4.0 and avg_degree='2' raised raw TypeErrors; num_classes=2.5 and num_edges=6.7
    were truncated silently."""
    gerr("num_features: must be an int >= 0, got 4.0", datasets.synthetic, "er", num_nodes=10, num_features=4.0)
    gerr("avg_degree: must be a finite number >= 0, got '2'", datasets.synthetic, "er", num_nodes=10, avg_degree="2")
    gerr("num_classes: must be an int >= 1, got 2.5", datasets.synthetic, "er", num_nodes=10, num_classes=2.5)
    gerr("num_edges: must be an int >= 0, got 6.7", datasets.synthetic, "er", num_nodes=10, num_edges=6.7)
    gerr("num_nodes: must be an int >= 1, got True", datasets.synthetic, "er", num_nodes=True)
    g = datasets.synthetic("er", num_nodes=np.int64(10), num_edges=np.int64(6), num_features=np.int32(2),
                           num_classes=np.int64(2), avg_degree=np.float32(1.0))
    assert (g.num_nodes, g.num_edges, g.num_features, g.num_classes) == (10, 6, 2, 2)


def test_rmat_probabilities_that_cannot_draw_enough_pairs_are_named() -> None:
    """The shortfall blamed the request size ("ask for fewer edges") when rmat_probs was the cause."""
    from gnncompile import ArgumentError

    with pytest.raises(ArgumentError, match=r"'rmat' drew only 0 distinct pairs of the 1 requested.*"
                                            r"rmat_probs=\[0.0, 1.0, 0.0, 0.0\] cannot draw enough"):
        datasets.synthetic("rmat", num_nodes=3, num_edges=2, num_features=1, rmat_probs=(0, 1, 0, 0))


def test_from_scipy_dense_dtypes_scipy_cannot_hold_are_named() -> None:
    gerr("matrix: dtype float16 is not supported by scipy.sparse", from_scipy, np.eye(3, dtype=np.float16))
    gerr("matrix: expected real values, got dtype object", from_scipy, np.eye(3).astype(object))
    assert from_scipy(np.eye(3, dtype=np.float32)[::-1].copy()).num_edges == 3


def test_stats_takes_what_load_takes() -> None:
    """stats(5) and stats(Path(...)) raised AttributeError ('lower')."""
    with pytest.raises(gc.ArgumentError, match="name_or_path: expected a dataset name or a path, got int 5"):
        datasets.stats(5)
    if SHARED is not None:
        assert datasets.stats(SHARED / "cora" / "cora.npz").num_nodes == 2708


def test_a_path_that_is_no_file_or_folder_is_named_so(tmp_path: Path) -> None:
    """``/dev/null`` or a pipe given as a dataset exists: it was reported as "no such file or
    directory"; a path that does not exist still is."""
    import os

    from gnncompile import DatasetError

    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    for path in ("/dev/null", str(pipe)):
        with pytest.raises(DatasetError, match="not a regular file or a directory"):
            gc.datasets.load(path)
    with pytest.raises(DatasetError, match="no such file or directory"):
        gc.datasets.load(str(tmp_path / "absent.npz"))
