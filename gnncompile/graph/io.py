"""Graph loaders: scipy sparse, networkx, PyG ``Data``, the ``shared/datasets`` npz format and the
raw Planetoid layout.

Every loader returns a validated :class:`~gnncompile.graph.core.Graph`. Malformed input raises
:class:`~gnncompile.errors.GraphError` naming the field (and the file, where there is one) and the
first bad index; a missing or unreadable file raises :class:`~gnncompile.errors.DatasetError`.

Conventions
-----------
- Edges are directed ``source -> destination`` (PyG's ``edge_index[0] -> edge_index[1]``); a
  message flows from the source to the destination.
- Node ids of inputs that have their own labels (networkx) are relabelled ``0..N-1`` in the
  input's node order.
- Optional libraries (networkx, torch_geometric) are never imported here: the loaders only read
  attributes of the objects they are given.
"""

from __future__ import annotations

import operator
import os
import pickle
import sys
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import scipy.sparse as sp
import torch

from ..errors import DatasetError, GraphError
from .core import Graph, _as_count

__all__ = ["from_scipy", "from_networkx", "from_pyg", "from_npz", "from_planetoid"]

PathLike = Union[str, "os.PathLike[str]"]

#: Dense features larger than this are kept as sparse CSR by :func:`from_planetoid` (the same
#: threshold the ``shared/datasets`` npz files use to choose between ``x`` and the CSR parts).
DENSE_FEATURE_LIMIT_BYTES = 200 * 2**20


# ---------------------------------------------------------------------------------------- helpers
def _first(mask: np.ndarray) -> int:
    """Index of the first ``True`` of a 1-d bool array (the caller knows there is one)."""
    return int(np.flatnonzero(mask)[0])


def _csr_from_parts(
    data: np.ndarray, indices: np.ndarray, indptr: np.ndarray, shape: Any, where: str
) -> sp.csr_matrix:
    """Validate CSR parts and build a scipy CSR matrix.

    ``where`` prefixes every message (e.g. ``"cora.npz: x"``), so errors read
    ``"cora.npz: x_indices: entry 17 has column 9000 outside [0, 1433)"``.
    """
    shape_arr = np.asarray(shape)
    if shape_arr.shape != (2,) or not np.issubdtype(shape_arr.dtype, np.integer) or (shape_arr < 0).any():
        raise GraphError(f"{where}_shape: expected two non-negative ints, got {shape_arr.tolist()!r}")
    rows, cols = (int(v) for v in shape_arr)
    if rows * cols >= 2**63:
        raise GraphError(f"{where}_shape: [{rows}, {cols}] is too large: rows * cols must fit in int64")
    indptr = np.asarray(indptr)
    indices = np.asarray(indices)
    data = np.asarray(data)
    for field, arr in (("indptr", indptr), ("indices", indices)):
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise GraphError(f"{where}_{field}: expected a 1-d integer array, got dtype {arr.dtype} shape {list(arr.shape)}")
    if data.ndim != 1:
        raise GraphError(f"{where}_data: expected a 1-d array, got shape {list(data.shape)}")
    if indptr.shape[0] != rows + 1:
        raise GraphError(f"{where}_indptr: expected length {rows + 1} (rows + 1), got {indptr.shape[0]}")
    if indptr[0] != 0:
        raise GraphError(f"{where}_indptr: indptr[0] must be 0, got {int(indptr[0])}")
    dec = indptr[1:] < indptr[:-1]
    if dec.any():
        i = _first(dec)
        raise GraphError(
            f"{where}_indptr: decreasing at row {i} (indptr[{i}]={int(indptr[i])} > indptr[{i + 1}]={int(indptr[i + 1])})"
        )
    nnz = int(indptr[-1])
    if indices.shape[0] != nnz or data.shape[0] != nnz:
        raise GraphError(
            f"{where}: indptr[-1]={nnz} but len(indices)={indices.shape[0]} and len(data)={data.shape[0]}"
        )
    bad = (indices < 0) | (indices >= cols)
    if bad.any():
        k = _first(bad)
        raise GraphError(f"{where}_indices: entry {k} has column {int(indices[k])} outside [0, {cols})")
    if not (np.issubdtype(data.dtype, np.floating) or np.issubdtype(data.dtype, np.integer) or data.dtype == np.bool_):
        raise GraphError(f"{where}_data: expected a real dtype, got {data.dtype}")
    return sp.csr_matrix((data, indices, indptr), shape=(rows, cols))


def _warn(message: str) -> None:
    """``warnings.warn(message)`` (a ``UserWarning``) attributed to the first caller outside this
    package's graph modules (``Graph.from_pyg`` calls :func:`from_pyg`, ``datasets.load`` calls
    :func:`from_planetoid`)."""
    here = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.dirname(os.path.abspath(frame.f_code.co_filename)) == here:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


def _prefix_errors(prefix: str, exc: GraphError) -> GraphError:
    return GraphError(f"{prefix}: {exc}")


# ---------------------------------------------------------------------------------------- scipy
def from_scipy(matrix: Any, **node_data: Any) -> Graph:
    """Build a graph from a square adjacency matrix where ``matrix[u, v] != 0`` is an edge ``u -> v``.

    This is the transpose of :meth:`Graph.to_scipy`, which returns the propagation matrix
    ``A[dst, src]``: the round trip is ``from_scipy(g.to_scipy().T)``.

    Parameters
    ----------
    matrix:
        A scipy sparse matrix or array (any format) or a dense 2-d numpy array. Duplicate entries
        of COO input are summed first; entries equal to zero (explicit or not) are no edges.
    **node_data:
        Passed to :class:`Graph` (``x``, ``y``, ``train_mask``, ``val_mask``, ``test_mask``,
        ``num_classes``, ``name``).

    Returns
    -------
    Graph
        ``num_nodes = matrix.shape[0]``. The stored values become ``edge_weight`` (float32 unless
        the matrix is float64) unless every stored value equals 1, in which case the graph is
        unweighted.

    Raises
    ------
    GraphError
        For a non-square or non-2-d matrix, a complex dtype, a non-finite value (named by its
        position ``matrix[u, v]``) or any invalid ``node_data``.
    """
    if sp.issparse(matrix):
        mat = matrix
    elif isinstance(matrix, np.ndarray):
        if matrix.ndim != 2:
            raise GraphError(f"matrix: expected a 2-d adjacency matrix, got shape {list(matrix.shape)}")
        if matrix.dtype.kind not in "biuf":
            raise GraphError(f"matrix: expected real values, got dtype {matrix.dtype}")
        try:
            mat = sp.csr_matrix(matrix)
        except ValueError as exc:  # float16: scipy.sparse has no such dtype
            raise GraphError(f"matrix: dtype {matrix.dtype} is not supported by scipy.sparse; pass "
                             f"matrix.astype(np.float32) ({exc})") from None
    else:
        raise GraphError(f"matrix: expected a scipy sparse matrix or a 2-d numpy array, got {type(matrix).__name__}")
    if mat.ndim != 2 or mat.shape[0] != mat.shape[1]:
        raise GraphError(f"matrix: expected a square adjacency matrix, got shape {list(mat.shape)}")
    if np.issubdtype(mat.dtype, np.complexfloating) or mat.dtype == np.object_:
        raise GraphError(f"matrix: expected real values, got dtype {mat.dtype}")
    n = int(mat.shape[0])
    # The CSC form of A (column v lists the rows u with A[u, v] != 0) is exactly the in-edge CSR.
    csc = sp.csc_matrix(mat, copy=True)
    csc.sum_duplicates()
    csc.eliminate_zeros()
    csc.sort_indices()
    values = csc.data
    if np.issubdtype(values.dtype, np.floating):
        bad = ~np.isfinite(values)
        if bad.any():  # the first in the caller's row-major order, named by its matrix position
            cols = np.repeat(np.arange(n, dtype=np.int64), np.diff(csc.indptr))
            k = np.flatnonzero(bad)
            k = k[np.lexsort((cols[k], csc.indices[k]))[0]]
            u, v = int(csc.indices[k]), int(cols[k])
            raise GraphError(f"edge_weight: non-finite value {values[k]} at matrix[{u}, {v}] (edge {u} -> {v})")
    weight: Optional[np.ndarray] = None
    if values.size and not np.all(values == 1):
        weight = values.astype(np.float64 if values.dtype == np.float64 else np.float32, copy=False)
    node_data.setdefault("name", "scipy")
    return Graph(
        csc.indptr.astype(np.int64), csc.indices.astype(np.int64), n, edge_weight=weight, **node_data
    )


# ---------------------------------------------------------------------------------------- networkx
_MISSING = object()


def from_networkx(
    G: Any,
    node_attr_x: Optional[str] = None,
    node_attr_y: Optional[str] = None,
    edge_attr_weight: Optional[str] = None,
    **node_data: Any,
) -> Graph:
    """Build a graph from a networkx graph.

    Parameters
    ----------
    G:
        ``nx.Graph``, ``nx.DiGraph``, ``nx.MultiGraph`` or ``nx.MultiDiGraph``. Nodes are relabelled
        ``0..N-1`` in ``G.nodes`` order. Directed graphs keep their edges as given; every edge
        ``{u, v}`` of an undirected graph gives both ``u -> v`` and ``v -> u`` (a self loop gives
        one edge). Parallel edges of multigraphs are kept as parallel edges.
    node_attr_x:
        Node attribute holding a feature vector (same length for every node) -> ``x`` (float32).
    node_attr_y:
        Node attribute holding an integer class id -> ``y``.
    edge_attr_weight:
        Edge attribute holding a number -> ``edge_weight`` (float32). Every edge must have it.
    **node_data:
        Further :class:`Graph` keywords (masks, ``num_classes``, ``name``).

    Raises
    ------
    GraphError
        When an attribute is missing on a node or edge, has the wrong type or a different length;
        the message names the attribute, the node's new index and its networkx label.
    """
    if not (hasattr(G, "nodes") and hasattr(G, "edges") and hasattr(G, "is_directed")):
        raise GraphError(f"G: expected a networkx graph, got {type(G).__name__}")
    nodes = list(G.nodes)
    n = len(nodes)
    index = {node: i for i, node in enumerate(nodes)}
    m = G.number_of_edges()
    if edge_attr_weight is None:
        edge_iter = ((index[u], index[v]) for u, v in G.edges())
        pairs = np.fromiter(
            (k for uv in edge_iter for k in uv), dtype=np.int64, count=2 * m
        ).reshape(-1, 2)
        weights = None
    else:
        pairs = np.empty((m, 2), dtype=np.int64)
        weights = np.empty(m, dtype=np.float64)
        for k, (u, v, w) in enumerate(G.edges(data=edge_attr_weight, default=_MISSING)):
            if w is _MISSING:
                raise GraphError(f"edge_attr_weight: edge {k} ({u!r}, {v!r}) has no attribute {edge_attr_weight!r}")
            try:
                weights[k] = float(w)
            except (TypeError, ValueError) as exc:
                raise GraphError(
                    f"edge_attr_weight: edge {k} ({u!r}, {v!r}) has non-numeric {edge_attr_weight!r}={w!r}"
                ) from exc
            pairs[k, 0] = index[u]
            pairs[k, 1] = index[v]
    src, dst = pairs[:, 0], pairs[:, 1]
    if not G.is_directed():
        back = src != dst
        src, dst = np.concatenate([src, dst[back]]), np.concatenate([dst, src[back]])
        if weights is not None:
            weights = np.concatenate([weights, weights[back]])

    def node_attr(attr: str, field: str) -> list[Any]:
        values = []
        for i, node in enumerate(nodes):
            value = G.nodes[node].get(attr, _MISSING)
            if value is _MISSING:
                raise GraphError(f"{field}: node {i} ({node!r}) has no attribute {attr!r}")
            values.append(value)
        return values

    if node_attr_x is not None:
        rows = node_attr(node_attr_x, "node_attr_x")
        try:
            vecs = [np.asarray(r, dtype=np.float32).reshape(-1) for r in rows]
        except (TypeError, ValueError) as exc:
            raise GraphError(f"node_attr_x: attribute {node_attr_x!r} is not numeric: {exc}") from exc
        width = vecs[0].shape[0] if vecs else 0
        for i, vec in enumerate(vecs):
            if vec.shape[0] != width:
                raise GraphError(
                    f"node_attr_x: node {i} ({nodes[i]!r}) has {vec.shape[0]} features, node 0 has {width}"
                )
        node_data["x"] = np.stack(vecs) if vecs else np.zeros((0, 0), dtype=np.float32)
    if node_attr_y is not None:
        labels = node_attr(node_attr_y, "node_attr_y")
        y = np.empty(n, dtype=np.int64)
        for i, label in enumerate(labels):
            if isinstance(label, (bool, np.bool_)) or not isinstance(label, (int, np.integer)):
                raise GraphError(f"node_attr_y: node {i} ({nodes[i]!r}) has non-integer label {label!r}")
            y[i] = int(label)
        node_data["y"] = y
    name = getattr(G, "name", "") or "networkx"
    node_data.setdefault("name", str(name))
    return Graph.from_edge_index(
        np.stack([src, dst]), n, edge_weight=None if weights is None else weights.astype(np.float32), **node_data
    )


# ---------------------------------------------------------------------------------------- PyG
def _pyg_get(data: Any, key: str) -> Any:
    try:
        return getattr(data, key, None)
    except Exception:  # noqa: BLE001 - PyG stores may raise their own errors for absent keys
        return None


def from_pyg(data: Any, split: int = 0) -> Graph:
    """Build a graph from a PyTorch Geometric ``Data`` object (``torch_geometric`` is not imported).

    Reads ``edge_index`` (required), ``num_nodes`` (an int; with ``x``, its row count), ``x``, ``y`` (``[N]`` or ``[N, 1]``),
    ``edge_weight`` or else a floating 1-d (or ``[E, 1]``) ``edge_attr`` as weights (any other
    ``edge_attr``, integer edge types or ``[E, F]`` features, is not used, with a warning), and
    ``train_mask``/``val_mask``/``test_mask``. Masks of shape ``[N, K]`` (PyG's way of storing
    several splits, e.g. ``WikipediaNetwork``) are reduced to column ``split``.

    Raises
    ------
    GraphError
        For heterogeneous graphs, a missing ``edge_index``, multi-label ``y``, a bad ``split`` or
        anything :class:`Graph` rejects.
    """
    if _pyg_get(data, "node_types") is not None and _pyg_get(data, "edge_types") is not None:
        raise GraphError("data: heterogeneous graphs (HeteroData) are not supported; convert with to_homogeneous()")
    edge_index = _pyg_get(data, "edge_index")
    if edge_index is None:
        raise GraphError(f"data.edge_index: missing on {type(data).__name__} (SparseTensor adj_t is not supported)")
    split = _as_count(split, "split")
    x = _pyg_get(data, "x")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyG warns when it has to infer num_nodes
        num_nodes = _pyg_get(data, "num_nodes")
    if num_nodes is not None:
        num_nodes = _as_count(num_nodes, "data.num_nodes")
    y = _pyg_get(data, "y")
    if y is not None:
        y = torch.as_tensor(y)
        if y.dim() == 2 and y.shape[1] == 1:
            y = y.reshape(-1)
        elif y.dim() != 1:
            raise GraphError(f"data.y: expected class ids of shape [N] or [N, 1], got {list(y.shape)} (multi-label is not supported)")
    weight = _pyg_get(data, "edge_weight")
    if weight is None:
        attr = _pyg_get(data, "edge_attr")
        if attr is not None:
            attr = torch.as_tensor(attr)
            scalar = attr.dim() == 1 or (attr.dim() == 2 and attr.shape[1] == 1)
            if scalar and attr.is_floating_point():
                weight = attr.reshape(-1)
            else:
                what = (f"holds {attr.dtype} values (edge types or categories, not weights)" if scalar
                        else f"has shape {list(attr.shape)} (edge features, not one weight per edge)")
                _warn(f"from_pyg: data.edge_attr {what}; the graph is built unweighted and edge_attr is not used. "
                      f"To use it as weights, set data.edge_weight = data.edge_attr.float()")
    masks: dict[str, Any] = {}
    num_splits = 1
    for field in ("train_mask", "val_mask", "test_mask"):
        mask = _pyg_get(data, field)
        if mask is None:
            continue
        mask = torch.as_tensor(mask)
        if mask.dim() == 2:
            num_splits = int(mask.shape[1])
            if not 0 <= split < num_splits:
                raise GraphError(f"split: {split} is out of range; data.{field} holds {num_splits} splits (columns)")
            mask = mask[:, split]
        masks[field] = mask
    if split != 0 and num_splits == 1:
        raise GraphError(f"split: {split} requested but data holds at most one split (1-d masks)")
    name = _pyg_get(data, "name")
    return Graph.from_edge_index(
        edge_index,
        num_nodes,
        edge_weight=weight,
        x=x,
        y=y,
        name=str(name) if isinstance(name, str) else "pyg",
        **masks,
    )


# ---------------------------------------------------------------------------------------- npz
#: the arrays an npz graph holds (see ``shared/datasets/README.md``), for error messages
_NPZ_ARRAYS = "edge_index, num_nodes, x, y, masks, ..."


def _require_npz_archive(p: Path) -> None:
    """Refuse a file that is not a zip archive before numpy tries it as a pickle."""
    if zipfile.is_zipfile(p):
        return
    with open(p, "rb") as f:
        head = f.read(8)
    if head.startswith(b"\x93NUMPY"):
        raise DatasetError(f"{p}: is a single .npy array, not a graph (an npz archive of arrays: {_NPZ_ARRAYS})")
    raise DatasetError(f"{p}: is not a graph file: an npz graph is a zip archive of arrays ({_NPZ_ARRAYS}), and "
                       f"this file is not a zip archive (it starts with the bytes {head!r})")


def _declared_classes(get: Any, files: set[str], where: str) -> Optional[tuple[int, str]]:
    """The class count the file declares (``num_classes``, or the length of ``class_names``) and which
    array says so; ``None`` when the file declares none (the count is then inferred from ``y``)."""
    declared: Optional[tuple[int, str]] = None
    if "class_names" in files:
        declared = (int(get("class_names").shape[0]), "class_names")
    if "num_classes" in files:
        nc = get("num_classes")
        if nc.size != 1 or not np.issubdtype(nc.dtype, np.integer) or int(nc.reshape(())) < 1:
            raise GraphError(f"{where}: num_classes: expected one positive int, got {nc.tolist()!r}")
        count = int(nc.reshape(()))
        if declared is not None and declared[0] != count:
            raise GraphError(f"{where}: num_classes: says {count} but class_names names {declared[0]} classes")
        declared = (count, "num_classes")
    return declared


def from_npz(path: PathLike, split: int = 0, symmetrize: Optional[bool] = None) -> Graph:
    """Read a graph in the ``shared/datasets`` npz format (see ``shared/datasets/README.md``).

    Parameters
    ----------
    path:
        The ``.npz`` file. It is read with ``allow_pickle=False``.
    split:
        Which of the ``K`` stored splits to use when the file has ``train_masks``/``val_masks``/
        ``test_masks`` of shape ``[K, N]``; files with one split accept only ``split=0``.
    symmetrize:
        ``None`` (default): use the file's ``is_symmetric`` flag and symmetrize one-directional
        graphs (what node classification expects; the edge counts then equal the README's
        "symmetrized" column). A ``True`` flag is checked against the edges (one transpose, which
        training would build anyway); a wrong one is a :class:`GraphError` naming an edge without
        its reverse. ``False``: keep the edges in the stored direction. ``True``: always
        symmetrize with :meth:`Graph.to_undirected`.

    Returns
    -------
    Graph
        Features stored as CSR parts (``x_data``/``x_indices``/``x_indptr``/``x_shape``) stay
        sparse (a torch sparse CSR ``x``); dense ``x`` stays dense. ``y = -1`` marks unlabeled
        vertices. ``num_classes`` is the file's ``num_classes`` scalar or ``len(class_names)`` when the
        file declares its classes (a label outside them is a :class:`GraphError`), else inferred from
        ``y`` (its largest label + 1). Arrays
        the file lacks (``x``, ``y``, masks) are ``None``.

    Raises
    ------
    DatasetError
        When the file is missing or is not an npz archive.
    GraphError
        When an array is missing, malformed or inconsistent; the message starts with the file name
        and names the array and the first bad index.
    """
    split = _as_count(split, "split")
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"{p}: no such npz file")
    _require_npz_archive(p)
    try:
        archive = np.load(p, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise DatasetError(f"{p}: is not a graph file: cannot read it as an npz archive ({exc})") from exc
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise DatasetError(f"{p}: is a single .npy array, not a graph (an npz archive of arrays: {_NPZ_ARRAYS})")
    where = p.name
    with archive:
        files = set(archive.files)

        def get(key: str) -> np.ndarray:
            try:
                arr = archive[key]
            except ValueError as exc:
                if "allow_pickle" in str(exc):  # object arrays need pickles, which are never loaded
                    raise GraphError(f"{where}: array {key!r} holds Python objects (pickled data), which gnncompile "
                                     f"never loads: this file is not a graph in the npz format (plain arrays: "
                                     f"{_NPZ_ARRAYS})") from exc
                raise DatasetError(f"{where}: array {key!r} is corrupt: {exc}") from exc  # e.g. its .npy header
            except (OSError, zipfile.BadZipFile, EOFError, zlib.error) as exc:
                raise DatasetError(f"{where}: array {key!r} is corrupt: {exc}") from exc
            if not isinstance(arr, np.ndarray):  # a member without the .npy suffix comes back as raw bytes
                raise DatasetError(f"{where}: array {key!r} is corrupt: the archive member is not a .npy array")
            return arr

        if "edge_index" not in files:
            raise GraphError(f"{where}: required array 'edge_index' is missing (arrays: {sorted(files)})")
        edge_index = get("edge_index")
        if not np.issubdtype(edge_index.dtype, np.integer) or edge_index.ndim != 2 or edge_index.shape[0] != 2:
            raise GraphError(
                f"{where}: edge_index: expected an int array of shape [2, E], got dtype {edge_index.dtype} "
                f"shape {list(edge_index.shape)}"
            )
        num_nodes: Optional[int] = None
        if "num_nodes" in files:
            nn = get("num_nodes")
            if nn.size != 1 or not np.issubdtype(nn.dtype, np.integer) or int(nn.reshape(())) < 0:
                raise GraphError(f"{where}: num_nodes: expected one non-negative int, got {nn.tolist()!r}")
            num_nodes = int(nn.reshape(()))

        node_data: dict[str, Any] = {}
        # Masks (and the split choice) first: a bad split fails before the features are read.
        multi = [k for k in ("train_masks", "val_masks", "test_masks") if k in files]
        single = [k for k in ("train_mask", "val_mask", "test_mask") if k in files]
        if multi:
            num_splits = None
            for key in multi:
                masks = get(key)
                if masks.ndim != 2:
                    raise GraphError(f"{where}: {key}: expected shape [K, N], got {list(masks.shape)}")
                if num_splits is not None and masks.shape[0] != num_splits:
                    raise GraphError(f"{where}: {key}: has {masks.shape[0]} splits, {multi[0]} has {num_splits}")
                num_splits = masks.shape[0]
                if not 0 <= split < num_splits:
                    raise GraphError(f"{where}: split: {split} is out of range; {key} holds {num_splits} splits")
                node_data[key[:-1]] = masks[split]
        elif single:
            if split != 0:
                raise GraphError(f"{where}: split: {split} requested but the file holds one split (use split=0)")
        elif split != 0:
            raise GraphError(f"{where}: split: {split} requested but the file has no masks")
        for key in single:
            if key not in node_data:
                node_data[key] = get(key)
        x_parts = [k for k in ("x_data", "x_indices", "x_indptr", "x_shape") if k in files]
        if "x" in files and x_parts:
            raise GraphError(f"{where}: x: both dense 'x' and CSR parts {x_parts} are present")
        if "x" in files:
            node_data["x"] = get("x")
        elif x_parts:
            if len(x_parts) != 4:
                missing = sorted({"x_data", "x_indices", "x_indptr", "x_shape"} - set(x_parts))
                raise GraphError(f"{where}: x: CSR features are missing parts {missing}")
            node_data["x"] = _csr_from_parts(
                get("x_data"), get("x_indices"), get("x_indptr"), get("x_shape"), f"{where}: x"
            )
        if num_nodes is None:
            if "x" in node_data:
                num_nodes = int(node_data["x"].shape[0])
            else:
                num_nodes = int(edge_index.max()) + 1 if edge_index.size else 0
        if "y" in files:
            node_data["y"] = get("y")
        declared = _declared_classes(get, files, where)
        if declared is not None:
            count, source = declared
            node_data["num_classes"] = count
            y = node_data.get("y")
            if y is not None and np.issubdtype(y.dtype, np.integer) and y.ndim == 1 and y.size:
                outside = y >= count
                if outside.any():
                    i = _first(outside)
                    raise GraphError(f"{where}: y: label {int(y[i])} at vertex {i} is outside the classes the file "
                                     f"declares (num_classes={count}, from {source}); labels must lie in [0, {count}) "
                                     f"or be -1 (unlabeled)")

        flag: Optional[bool] = None
        if "is_symmetric" in files:
            sym = get("is_symmetric")
            if sym.size != 1 or not (sym.dtype == np.bool_ or np.issubdtype(sym.dtype, np.integer)
                                     and int(sym.reshape(())) in (0, 1)):
                raise GraphError(f"{where}: is_symmetric: expected one bool, got {sym.tolist()!r} (dtype {sym.dtype})")
            flag = bool(sym.reshape(()))
        name = p.stem
        if "name" in files:
            arr = get("name")
            if arr.size == 1:
                name = str(arr.reshape(()))
    try:
        # Structure first (symmetrizing rebuilds it), then the node data, validated once.
        g = Graph.from_edge_index(edge_index, num_nodes, name=name)
        if symmetrize is None and flag is True and not g.is_symmetric():
            raise GraphError(f"is_symmetric: the file says True but {_edge_without_reverse(edge_index, g.num_nodes)}; "
                             f"fix the flag, or pass symmetrize=True (store both directions) or False (keep the "
                             f"stored direction)")
        if symmetrize or (symmetrize is None and not g.is_symmetric()):
            g = g.to_undirected()
        return g.replace(**node_data)
    except GraphError as exc:
        raise _prefix_errors(where, exc) from exc


def _edge_without_reverse(edge_index: np.ndarray, n: int) -> str:
    """Names the first column ``u -> v`` of ``edge_index`` whose reverse ``v -> u`` is missing or
    stored a different number of times: what makes the graph not symmetric."""
    src, dst = edge_index[0].astype(np.int64), edge_index[1].astype(np.int64)
    n = max(n, 1)
    key, rev = src * n + dst, dst * n + src
    uniq, counts = np.unique(key, return_counts=True)
    pos = np.minimum(np.searchsorted(uniq, rev), uniq.shape[0] - 1)
    bad = (uniq[pos] != rev) | (counts[pos] != counts[np.searchsorted(uniq, key)])
    if not bad.any():  # pragma: no cover - only called on asymmetric graphs
        return "the edges are not symmetric"
    e = _first(bad)
    u, v = int(src[e]), int(dst[e])
    return f"edge_index column {e} ({u} -> {v}) has no reverse edge {v} -> {u} (as many times)"


# ---------------------------------------------------------------------------------------- Planetoid
class _PickledSparse:
    """Stand-in for scipy sparse classes found in old pickles: keeps the pickled state only.

    Old scipy pickled ``csr_matrix`` objects by ``__dict__`` (``_shape``, ``indptr``, ...); rebuilding
    them from that state avoids depending on the private layout and module paths
    (``scipy.sparse.csr``) of whichever scipy wrote them. Subclasses set ``fmt``.
    """

    fmt = "csr"

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            state = {**(state[0] or {}), **state[1]}
        self.state = dict(state) if isinstance(state, dict) else {}

    def to_csr(self, where: str) -> sp.csr_matrix:
        s = getattr(self, "state", {})
        shape = s.get("_shape", s.get("shape"))
        if shape is None:
            raise GraphError(f"{where}: pickled sparse matrix has no shape")
        if self.fmt in ("csr", "csc"):
            try:
                data, indices, indptr = s["data"], s["indices"], s["indptr"]
            except KeyError as exc:
                raise GraphError(f"{where}: pickled {self.fmt} matrix lacks {exc.args[0]!r}") from exc
            if self.fmt == "csr":
                return _csr_from_parts(data, indices, indptr, shape, where)
            return _csr_from_parts(data, indices, indptr, tuple(shape)[::-1], where).T.tocsr()
        if self.fmt == "coo":
            if "coords" in s:
                row, col = (np.asarray(c) for c in s["coords"])
            else:
                row, col = np.asarray(s.get("row")), np.asarray(s.get("col"))
            data = np.asarray(s.get("data"))
            rows, cols = (int(v) for v in shape)
            bad = (row < 0) | (row >= rows) | (col < 0) | (col >= cols)
            if bad.any():
                k = _first(bad)
                raise GraphError(f"{where}: entry {k} at ({int(row[k])}, {int(col[k])}) outside shape {tuple(shape)}")
            return sp.csr_matrix((data, (row, col)), shape=(rows, cols))
        raise GraphError(f"{where}: pickled sparse format {self.fmt!r} is not supported (csr, csc, coo)")


_SPARSE_STUBS = {
    name: type(f"_Pickled_{name}", (_PickledSparse,), {"fmt": name[:3]})
    for name in ("csr_matrix", "csr_array", "csc_matrix", "csc_array", "coo_matrix", "coo_array")
}


class _PlanetoidUnpickler(pickle.Unpickler):
    """Unpickler for Planetoid's Python 2 pickles that admits only the classes they use.

    numpy arrays and dtypes, ``collections.defaultdict``, builtin containers and the two helpers
    protocol-2 pickles call (``copyreg._reconstructor``, ``_codecs.encode``) are allowed; scipy
    sparse matrices become :class:`_PickledSparse`; anything else is refused (pickles can run
    arbitrary code, so a file naming other globals is treated as malformed).
    """

    _BUILTINS = {"list", "dict", "set", "frozenset", "tuple", "int", "float", "bool", "str", "bytes", "complex", "object"}

    def find_class(self, module: str, name: str) -> Any:
        if module.startswith("scipy.sparse") and name in _SPARSE_STUBS:
            return _SPARSE_STUBS[name]
        if module in ("numpy.core.multiarray", "numpy._core.multiarray") and name in ("_reconstruct", "scalar"):
            return _numpy_multiarray_attr(name)
        if module == "numpy" and name in ("ndarray", "dtype"):
            return getattr(np, name)
        if module == "collections" and name in ("defaultdict", "OrderedDict"):
            return super().find_class(module, name)
        if module in ("builtins", "__builtin__") and name in self._BUILTINS:
            return super().find_class(module, name)
        if (module, name) in (("copy_reg", "_reconstructor"), ("copyreg", "_reconstructor"), ("_codecs", "encode")):
            return super().find_class(module, name)  # used by numpy pickles of protocol 2
        raise pickle.UnpicklingError(f"global {module}.{name} is not allowed in a Planetoid file")


def _numpy_multiarray_attr(name: str) -> Any:
    try:
        from numpy._core import multiarray  # numpy >= 2
    except ImportError:  # pragma: no cover - numpy 1.x
        from numpy.core import multiarray  # type: ignore[no-redef]
    return getattr(multiarray, name)


def _load_pickle(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            return _PlanetoidUnpickler(f, encoding="latin1").load()
    except FileNotFoundError as exc:
        raise DatasetError(f"{path}: no such file") from exc
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError, ValueError) as exc:
        raise GraphError(f"{path.name}: cannot unpickle: {exc}") from exc


def _as_csr(obj: Any, where: str) -> sp.csr_matrix:
    if isinstance(obj, _PickledSparse):
        return obj.to_csr(where)
    if sp.issparse(obj):
        return sp.csr_matrix(obj)
    if isinstance(obj, np.ndarray) and obj.ndim == 2:
        return sp.csr_matrix(obj)
    raise GraphError(f"{where}: expected a 2-d feature matrix, got {type(obj).__name__}")


def _one_hot_labels(obj: Any, where: str) -> tuple[np.ndarray, int]:
    """Class ids from a one-hot ``[n, C]`` array; all-zero rows become -1."""
    if isinstance(obj, _PickledSparse):
        obj = obj.to_csr(where).toarray()
    arr = np.asarray(obj)
    if arr.ndim != 2:
        raise GraphError(f"{where}: expected one-hot labels of shape [n, C], got {list(arr.shape)}")
    labels = arr.argmax(axis=1).astype(np.int64) if arr.shape[1] else np.zeros(arr.shape[0], np.int64)
    labels[~(arr != 0).any(axis=1)] = -1
    return labels, int(arr.shape[1])


def _first_non_integer(graph: dict) -> str:
    """Names the first key or neighbour of a Planetoid adjacency dict that is not an integer."""
    for k, (key, nbrs) in enumerate(graph.items()):
        try:
            operator.index(key)
        except TypeError:
            return f"key {k} is {key!r}"
        try:
            items = list(nbrs)
        except TypeError:
            return f"key {key!r} has a neighbour list of type {type(nbrs).__name__}"
        for i, u in enumerate(items):
            try:
                operator.index(u)
            except TypeError:
                return f"neighbour {i} of key {key!r} is {u!r}"
    return "an id is out of the int64 range"


def from_planetoid(
    folder: PathLike,
    name: str,
    *,
    allow_missing_features: bool = False,
    sparse_features: Optional[bool] = None,
) -> Graph:
    """Read the raw Planetoid layout ``ind.<name>.{x,tx,allx,y,ty,ally,graph,test.index}``.

    Rebuilt the way Kipf & Welling's ``load_data`` and PyG's ``Planetoid`` do:

    - nodes ``0..len(allx)-1`` are the rows of ``allx``/``ally``; test node ``test.index[i]`` has
      features ``tx[i]`` and label ``ty[i]``; ``N = max(len(allx), max(test.index) + 1)``;
    - test-range ids absent from ``test.index`` (CiteSeer has 15) get zero features and ``y = -1``
      (PyG labels them 0); all-zero one-hot rows also give ``y = -1``;
    - masks: train = the first ``len(y)`` nodes, val = the next 500 (within the ``allx`` rows), test
      = the ``test.index`` nodes;
    - edges: the ``graph`` adjacency dict read as undirected (both directions), duplicates and self
      loops removed.

    Parameters
    ----------
    folder:
        Directory holding the files.
    name:
        Dataset prefix (``"cora"``, ``"citeseer"``, ``"pubmed"``); matched exactly first, then
        lower-cased.
    allow_missing_features:
        Build a graph without ``x`` when ``allx`` or ``tx`` is absent (the PubMed copy in
        ``shared/datasets`` lacks ``ind.pubmed.allx``) instead of raising. When only one of them
        is absent, the other is not read and a warning says so (features of some vertices would be
        unknown).
    sparse_features:
        ``True``: ``x`` is a sparse CSR tensor; ``False``: dense; ``None`` (default): dense unless
        the dense float32 matrix would exceed 200 MiB (the npz files' rule).

    Raises
    ------
    DatasetError
        When the folder or a required file is missing (the message lists the missing files).
    GraphError
        When the files are inconsistent (row counts, duplicate or out-of-range test ids, edge ids
        outside the node range); the message names the file and the first bad index.
    """
    root = Path(folder)
    if not root.is_dir():
        raise DatasetError(f"{root}: Planetoid folder does not exist")
    prefix = name
    if not (root / f"ind.{prefix}.graph").is_file() and (root / f"ind.{name.lower()}.graph").is_file():
        prefix = name.lower()
    parts = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")
    paths = {k: root / f"ind.{prefix}.{k}" for k in parts}
    missing = [k for k in parts if not paths[k].is_file()]
    feature_parts = {"x", "tx", "allx"}
    if missing and not (allow_missing_features and set(missing) <= feature_parts):
        raise DatasetError(
            f"{root}: Planetoid files missing: {', '.join(paths[k].name for k in missing)}"
            + (" (pass allow_missing_features=True to load without features)" if set(missing) <= feature_parts else "")
        )
    has_features = not (set(missing) & {"tx", "allx"})
    if not has_features and len(set(missing) & {"tx", "allx"}) == 1:
        absent, present = ("tx", "allx") if "tx" in missing else ("allx", "tx")
        _warn(f"{root}: {paths[absent].name} is missing, so some vertices have no features: the graph is built "
              f"without x and {paths[present].name}, which is present, is not read")

    def fname(key: str) -> str:
        return paths[key].name

    ally, num_classes = _one_hot_labels(_load_pickle(paths["ally"]), fname("ally"))
    ty, ty_classes = _one_hot_labels(_load_pickle(paths["ty"]), fname("ty"))
    y_train, y_classes = _one_hot_labels(_load_pickle(paths["y"]), fname("y"))
    for key, c in (("ty", ty_classes), ("y", y_classes)):
        if c != num_classes:
            raise GraphError(f"{fname(key)}: has {c} classes (columns) but {fname('ally')} has {num_classes}")

    try:
        text = paths["test.index"].read_text().split()
        test_index = np.array([int(tok) for tok in text], dtype=np.int64)
    except ValueError as exc:
        raise GraphError(f"{fname('test.index')}: expected one integer per line: {exc}") from exc
    if test_index.shape[0] != ty.shape[0]:
        raise GraphError(
            f"{fname('test.index')}: has {test_index.shape[0]} ids but {fname('ty')} has {ty.shape[0]} rows"
        )
    n_all = ally.shape[0]
    if test_index.size:
        low = test_index < n_all
        if low.any():
            i = _first(low)
            raise GraphError(
                f"{fname('test.index')}: line {i} holds id {int(test_index[i])} < len(allx)={n_all} "
                "(test ids must follow the allx rows)"
            )
        order = np.argsort(test_index, kind="stable")
        dup = test_index[order][1:] == test_index[order][:-1]
        if dup.any():
            i = int(order[1:][_first(dup)])
            raise GraphError(f"{fname('test.index')}: line {i} repeats id {int(test_index[i])}")
    n = max(n_all, int(test_index.max()) + 1 if test_index.size else 0)

    y = np.full(n, -1, dtype=np.int64)
    y[:n_all] = ally
    y[test_index] = ty
    if y_train.shape[0] > n_all:
        raise GraphError(f"{fname('y')}: has {y_train.shape[0]} rows but {fname('ally')} only {n_all}")
    if (y_train != ally[: y_train.shape[0]]).any():
        i = _first(y_train != ally[: y_train.shape[0]])
        raise GraphError(f"{fname('y')}: row {i} label {int(y_train[i])} differs from {fname('ally')} ({int(ally[i])})")

    x: Any = None
    if has_features:
        allx = _as_csr(_load_pickle(paths["allx"]), fname("allx"))
        tx = _as_csr(_load_pickle(paths["tx"]), fname("tx"))
        if allx.shape[0] != n_all:
            raise GraphError(f"{fname('allx')}: has {allx.shape[0]} rows but {fname('ally')} has {n_all}")
        if tx.shape[0] != test_index.shape[0]:
            raise GraphError(f"{fname('tx')}: has {tx.shape[0]} rows but {fname('test.index')} has {test_index.shape[0]} ids")
        if tx.shape[1] != allx.shape[1]:
            raise GraphError(f"{fname('tx')}: has {tx.shape[1]} columns but {fname('allx')} has {allx.shape[1]}")
        # Row r of vstack(allx, tx) belongs to node row_of[r]; the remaining test-range rows stay zero.
        row_of = np.concatenate([np.arange(n_all, dtype=np.int64), test_index])
        stacked = sp.vstack([allx, tx], format="coo")
        x_csr = sp.csr_matrix(
            (stacked.data.astype(np.float32), (row_of[stacked.row], stacked.col)), shape=(n, allx.shape[1])
        )
        x_csr.sum_duplicates()
        dense_bytes = 4 * n * allx.shape[1]
        sparse = sparse_features if sparse_features is not None else dense_bytes > DENSE_FEATURE_LIMIT_BYTES
        x = x_csr if sparse else x_csr.toarray()

    graph = _load_pickle(paths["graph"])
    if not isinstance(graph, dict):
        raise GraphError(f"{fname('graph')}: expected an adjacency dict, got {type(graph).__name__}")
    try:
        keys = np.fromiter(map(operator.index, graph.keys()), dtype=np.int64, count=len(graph))
        lengths = np.fromiter((len(v) for v in graph.values()), dtype=np.int64, count=len(graph))
        nbrs = np.fromiter((operator.index(u) for v in graph.values() for u in v), dtype=np.int64,
                           count=int(lengths.sum()))
    except (TypeError, ValueError, OverflowError) as exc:
        raise GraphError(f"{fname('graph')}: {_first_non_integer(graph)}: keys and neighbour lists must be "
                         f"integers (ids are never rounded)") from exc
    src = np.repeat(keys, lengths)
    for field, ids in (("key", keys), ("neighbour", nbrs)):
        bad = (ids < 0) | (ids >= n)
        if bad.any():
            i = _first(bad)
            raise GraphError(f"{fname('graph')}: {field} {i} is node {int(ids[i])}, outside [0, {n})")
    keep = src != nbrs
    a, b = src[keep].astype(np.int64), nbrs[keep].astype(np.int64)   # int64 keys a * n + b
    pair = np.unique(np.concatenate([a * n + b, b * n + a]))
    edge_index = np.stack([pair // n, pair % n]) if n else np.zeros((2, 0), dtype=np.int64)

    train = np.zeros(n, dtype=bool)
    train[: y_train.shape[0]] = True
    val = np.zeros(n, dtype=bool)
    val[y_train.shape[0] : min(y_train.shape[0] + 500, n_all)] = True
    test = np.zeros(n, dtype=bool)
    test[test_index] = True
    try:
        return Graph.from_edge_index(
            edge_index, n, x=x, y=y, train_mask=train, val_mask=val, test_mask=test,
            num_classes=num_classes, name=prefix.lower(),
        )
    except GraphError as exc:
        raise _prefix_errors(f"{root} (Planetoid {prefix})", exc) from exc
