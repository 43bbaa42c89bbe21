"""Datasets: load real graphs by name or path, list what is available, generate synthetic graphs.

``load("cora")`` searches, in order,

1. ``root`` when given,
2. every directory in ``$GNNCOMPILE_DATA`` (``os.pathsep``-separated),
3. the ``shared/datasets`` folder found by walking up from this package's location and from the
   current working directory (the repository lives at ``<X>/main`` and the data at
   ``<X>/shared/datasets``),

for ``<dir>/<name>/<name>.npz``, ``<dir>/<name>.npz`` and, failing those, the raw Planetoid files
``<dir>/<name>/raw/ind.<name>.*``. Names are matched as given and then lower-cased with ``-``
replaced by ``_`` (``"Coauthor-Physics"`` finds ``coauthor_physics``). A path to an ``.npz`` file,
to a dataset folder holding ``<folder>/<folder>.npz`` or to a folder of raw Planetoid files works
too.

``synthetic(kind, ...)`` builds graphs without any files: ``"sbm"`` (the built-in default graph,
with labels that graph structure helps to predict), ``"rmat"`` (power-law, Graph500-style) and
``"er"`` (Erdős–Rényi). ``list_datasets()`` (also ``datasets.list()``) describes the npz files found
without loading features.
"""

from __future__ import annotations

import builtins
import math
import os
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import numpy as np

from .errors import ArgumentError, DatasetError, GraphError
from .graph.core import Graph, GraphStats, _as_count
from .graph.io import from_npz, from_planetoid

__all__ = ["DatasetInfo", "SYNTHETIC_KINDS", "KNOWN_STATS", "list_datasets", "load", "locate", "search_paths",
           "stats", "synthetic"]

PathLike = Union[str, "os.PathLike[str]"]

#: Environment variable naming extra dataset directories (``os.pathsep``-separated).
ENV_VAR = "GNNCOMPILE_DATA"

#: Kinds accepted by :func:`synthetic`.
SYNTHETIC_KINDS = ("sbm", "rmat", "er")

_PLANETOID_PARTS = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")


# ---------------------------------------------------------------------------------------- search
def _shared_dirs_above(start: Path) -> builtins.list[Path]:
    """``<A>/shared/datasets`` for every ancestor ``A`` of ``start`` (``start`` included)."""
    found = []
    for anc in (start, *start.parents):
        cand = anc / "shared" / "datasets"
        if cand.is_dir():
            found.append(cand)
    return found


def search_paths(root: Optional[PathLike] = None) -> builtins.list[Path]:
    """Directories :func:`load` searches, in order (``root``, ``$GNNCOMPILE_DATA``, shared folders).

    ``root`` and the ``$GNNCOMPILE_DATA`` entries are listed even when they do not exist (so that
    error messages can show them); the ``shared/datasets`` folders only when found. Duplicates are
    removed, keeping the first position.
    """
    cands: builtins.list[Path] = []
    if root is not None:
        cands.append(Path(root))
    env = os.environ.get(ENV_VAR, "")
    cands.extend(Path(p) for p in env.split(os.pathsep) if p)
    cands.extend(_shared_dirs_above(Path(__file__).resolve().parent))
    cands.extend(_shared_dirs_above(Path.cwd().resolve()))
    out: builtins.list[Path] = []
    seen: set[str] = set()
    for c in cands:
        key = str(c.resolve()) if c.exists() else str(c)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def _name_variants(name: str) -> builtins.list[str]:
    norm = name.lower().replace("-", "_")
    return [name] if norm == name else [name, norm]


def _find_in(directory: Path, name: str) -> Optional[Path]:
    """The npz file (or Planetoid raw folder) for ``name`` inside ``directory``, if any."""
    for variant in _name_variants(name):
        for cand in (directory / variant / f"{variant}.npz", directory / f"{variant}.npz"):
            if cand.is_file():
                return cand
    for variant in _name_variants(name):
        raw = directory / variant / "raw"
        if (raw / f"ind.{variant}.graph").is_file():
            return raw
    return None


def _names_in(directory: Path) -> dict[str, Path]:
    """Every dataset name in ``directory`` mapped to its npz file."""
    found: dict[str, Path] = {}
    if not directory.is_dir():
        return found
    for entry in sorted(directory.iterdir()):
        if entry.is_dir() and (entry / f"{entry.name}.npz").is_file():
            found.setdefault(entry.name, entry / f"{entry.name}.npz")
        elif entry.is_file() and entry.suffix == ".npz":
            found.setdefault(entry.stem, entry)
    return found


def _planetoid_name(folder: Path) -> Optional[str]:
    names = sorted(p.name[4 : -len(".graph")] for p in folder.glob("ind.*.graph"))
    if len(names) > 1:
        raise DatasetError(f"{folder}: holds several Planetoid datasets {names}; use graph.io.from_planetoid(folder, name)")
    return names[0] if names else None


def _load_path(path: Path, symmetrize: Optional[bool], split: int, allow_missing_features: bool = False) -> Graph:
    if path.is_file():
        if path.suffix != ".npz":
            raise DatasetError(f"{path}: not an .npz file (load reads the shared/datasets npz format)")
        return from_npz(path, split=split, symmetrize=symmetrize)
    if path.is_dir():
        own = path / f"{path.name}.npz"
        if own.is_file():
            return from_npz(own, split=split, symmetrize=symmetrize)
        for folder in (path, path / "raw"):
            pname = _planetoid_name(folder) if folder.is_dir() else None
            if pname is not None:
                if split != 0:
                    raise GraphError(f"split: {split} requested but Planetoid data has one split (use split=0)")
                return from_planetoid(folder, pname, allow_missing_features=allow_missing_features)
        npz = sorted(path.glob("*.npz"))
        if len(npz) == 1:
            return from_npz(npz[0], split=split, symmetrize=symmetrize)
        raise DatasetError(
            f"{path}: no dataset found (expected {path.name}.npz, a single .npz file or Planetoid ind.<name>.* files)"
        )
    if path.exists():   # a device, a pipe, a socket
        raise DatasetError(f"{path}: not a regular file or a directory (load reads an .npz file or a dataset folder)")
    raise DatasetError(f"{path}: no such file or directory")


def load(
    name_or_path: PathLike,
    *,
    symmetrize: Optional[bool] = None,
    split: int = 0,
    root: Optional[PathLike] = None,
    allow_missing_features: bool = False,
) -> Graph:
    """Load a dataset by name (searching the dataset directories) or by path.

    Parameters
    ----------
    name_or_path:
        A dataset name such as ``"cora"`` or ``"coauthor_physics"``, or a path to an ``.npz`` file,
        a dataset folder or a folder of raw Planetoid files.
    symmetrize:
        See :func:`gnncompile.graph.io.from_npz`: ``None`` symmetrizes graphs stored in one
        direction (the default for node classification), ``False`` keeps the stored direction,
        ``True`` always symmetrizes. Planetoid raw data is undirected whatever the value.
    split:
        Which stored split to use for datasets with several (squirrel, chameleon, tolokers: 0-9).
    root:
        A directory searched before ``$GNNCOMPILE_DATA`` and the shared datasets folder.
    allow_missing_features:
        Raw Planetoid data only (see :func:`gnncompile.graph.io.from_planetoid`): build a graph
        without ``x`` when ``ind.<name>.allx`` or ``ind.<name>.tx`` is absent instead of raising.

    Raises
    ------
    ArgumentError
        When ``name_or_path`` is neither a string nor a path, or is empty.
    GraphError
        When ``split`` is not an int or not one the dataset stores.
    DatasetError
        When the name is found nowhere; the message lists the available names and every directory
        searched.
    """
    _check_name(name_or_path)
    split = _as_count(split, "split")
    text = os.fspath(name_or_path)
    path = Path(text)
    looks_like_path = isinstance(name_or_path, os.PathLike) or os.sep in text or text.endswith(".npz")
    if looks_like_path:
        return _load_path(path, symmetrize, split, allow_missing_features)
    dirs = search_paths(root)
    for directory in dirs:
        hit = _find_in(directory, text)
        if hit is not None:
            return _load_path(hit, symmetrize, split, allow_missing_features)
    if path.exists():
        return _load_path(path, symmetrize, split, allow_missing_features)
    available = sorted({n for d in dirs for n in _names_in(d)})
    searched = "\n  ".join(f"{d}{'' if d.is_dir() else ' (missing)'}" for d in dirs) or "(none)"
    raise DatasetError(
        f"unknown dataset {text!r}; available: {', '.join(available) or '(none)'}\n"
        f"searched (set ${ENV_VAR} or pass root= to add a directory):\n  {searched}"
    )


# ---------------------------------------------------------------------------------------- listing
@dataclass(frozen=True)
class DatasetInfo:
    """What :func:`list_datasets` reports about one npz dataset (read without loading features).

    ``num_edges`` counts the directed edges stored in the file (before symmetrizing);
    ``symmetric`` is the file's ``is_symmetric`` flag (``None`` when absent); ``num_features`` is 0
    and ``num_classes`` is 0 for structure-only graphs.
    """

    name: str
    path: Path
    num_nodes: int
    num_edges: int
    symmetric: Optional[bool]
    num_features: int
    num_classes: int
    sparse_features: bool

    @property
    def missing(self) -> tuple[str, ...]:
        """What node classification needs and the file lacks: ``"features"``, ``"labels"`` (empty if none)."""
        return tuple(what for what, have in (("features", self.num_features), ("labels", self.num_classes))
                     if not have)

    @property
    def trainable(self) -> bool:
        """Whether ``gc.train`` / ``gnncompile train`` can use it (it has node features and labels)."""
        return not self.missing

    def __str__(self) -> str:
        feat = "-" if not self.num_features else f"{self.num_features}{' (CSR)' if self.sparse_features else ''}"
        sym = {True: "sym", False: "directed", None: "?"}[self.symmetric]
        use = "trainable" if self.trainable else f"not trainable: no {' or '.join(self.missing)}"
        return (
            f"{self.name:<20} |V|={self.num_nodes:>10,} |E|={self.num_edges:>11,} {sym:<8} "
            f"features={feat:<12} classes={self.num_classes or '-'}  {use}"
        )


def _npy_headers(path: Path) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Shapes and dtypes of the arrays in an npz archive, read from the .npy headers only."""
    headers: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
    with zipfile.ZipFile(path) as zf:
        for member in zf.namelist():
            if not member.endswith(".npy"):
                continue
            with zf.open(member) as f:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                elif version == (2, 0):
                    shape, _, dtype = np.lib.format.read_array_header_2_0(f)
                else:
                    continue
            headers[member[: -len(".npy")]] = (tuple(int(s) for s in shape), np.dtype(dtype))
    return headers


def _scalar(z: "np.lib.npyio.NpzFile", key: str, kinds: str) -> int:
    """The one value of array ``key`` (numpy dtype kind in ``kinds``); else a DatasetError."""
    arr = z[key]
    if arr.size != 1 or arr.dtype.kind not in kinds:
        raise DatasetError(f"{key}: expected one {'bool' if 'b' in kinds else 'int'}, got {arr.tolist()!r} "
                           f"(dtype {arr.dtype})")
    return int(arr.reshape(()))


def _describe(name: str, path: Path) -> DatasetInfo:
    """What :func:`list_datasets` reports about ``path``; a :class:`DatasetError` with the reason when
    the file is not a graph :func:`load` can read (not an npz archive, no or a malformed
    ``edge_index``, malformed scalars, corrupt members)."""
    try:
        return _read_header(name, path)
    except DatasetError as exc:
        raise DatasetError(f"{path}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - an untrusted file fails in any reader (zip, zlib, npy headers)
        kind = type(exc).__name__
        if type(exc).__module__ != "builtins":
            kind = f"{type(exc).__module__}.{kind}"
        raise DatasetError(f"{path}: cannot read dataset header: {kind}: {exc}") from exc


def _read_header(name: str, path: Path) -> DatasetInfo:
    headers = _npy_headers(path)
    shapes = {k: shape for k, (shape, _) in headers.items()}
    with np.load(path, allow_pickle=False) as z:
        files = set(z.files)
        for key in files - set(shapes):  # headers of unusual versions: read the array itself
            arr = z[key]
            headers[key] = (tuple(arr.shape), arr.dtype)
            shapes[key] = tuple(arr.shape)
        if "edge_index" not in files:
            raise DatasetError(f"required array 'edge_index' is missing (arrays: {sorted(files)})")
        edges, edge_dtype = headers["edge_index"]
        if len(edges) != 2 or edges[0] != 2 or edge_dtype.kind not in "iu":
            raise DatasetError(f"edge_index: expected an int array of shape [2, E], got dtype {edge_dtype} "
                               f"shape {[*edges]}")
        num_nodes = _scalar(z, "num_nodes", "iu") if "num_nodes" in files else -1
        if "num_nodes" in files and num_nodes < 0:
            raise DatasetError(f"num_nodes: must be >= 0, got {num_nodes}")
        symmetric = bool(_scalar(z, "is_symmetric", "biu")) if "is_symmetric" in files else None
        if "x_shape" in files:
            x_shape = z["x_shape"]
            if x_shape.shape != (2,) or x_shape.dtype.kind not in "iu":
                raise DatasetError(f"x_shape: expected two ints, got {x_shape.tolist()!r}")
            num_features = int(x_shape[1])
        else:
            num_features = shapes["x"][1] if "x" in shapes and len(shapes["x"]) == 2 else 0
        if "num_classes" in files:
            num_classes = _scalar(z, "num_classes", "iu")
        elif "class_names" in files:
            num_classes = int(shapes["class_names"][0]) if shapes["class_names"] else 0
        elif "y" in files:
            y = z["y"]
            if y.dtype.kind not in "iu":
                raise DatasetError(f"y: expected integer class ids, got dtype {y.dtype}")
            num_classes = int(y.max()) + 1 if y.size else 0
        else:
            num_classes = 0
    if num_nodes < 0:
        num_nodes = shapes["x"][0] if "x" in shapes and shapes["x"] else -1
    return DatasetInfo(
        name=name, path=path, num_nodes=num_nodes, num_edges=int(edges[1]), symmetric=symmetric,
        num_features=int(num_features), num_classes=num_classes, sparse_features="x_data" in files,
    )


def _check_name(name_or_path: Any) -> None:
    """Raise :class:`ArgumentError` unless ``name_or_path`` is a dataset name or a path (an empty
    string is neither: as a path it would be the current directory)."""
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ArgumentError(f"name_or_path: expected a dataset name or a path, got {type(name_or_path).__name__} "
                            f"{name_or_path!r}")
    if isinstance(name_or_path, str) and not name_or_path:
        raise ArgumentError("name_or_path: is empty; give a dataset name (e.g. 'cora') or a path")


def locate(name_or_path: PathLike, *, root: Optional[PathLike] = None) -> Optional[Path]:
    """The file or folder :func:`load` would read for ``name_or_path``, or ``None`` if there is none."""
    _check_name(name_or_path)
    text = os.fspath(name_or_path)
    path = Path(text)
    if isinstance(name_or_path, os.PathLike) or os.sep in text or text.endswith(".npz"):
        return path if path.exists() else None
    for directory in search_paths(root):
        hit = _find_in(directory, text)
        if hit is not None:
            return hit
    return path if path.exists() else None


def list_datasets(root: Optional[PathLike] = None) -> builtins.list[DatasetInfo]:
    """Describe every npz dataset in the search path (see :func:`search_paths`), sorted by name.

    A name found in several directories is reported once, from the first directory that has it
    (the one :func:`load` would read). Only array headers, the scalars and ``y`` are read. A file
    that is not a readable graph (not an npz archive, no ``edge_index``, a malformed scalar, a
    corrupt member) and a directory that cannot be listed are left out with a ``UserWarning``
    giving the path and the reason; listing never fails because of one bad entry.
    """
    chosen: dict[str, Path] = {}
    for directory in search_paths(root):
        try:
            names = _names_in(directory)
        except OSError as exc:
            warnings.warn(f"datasets: skipped directory {directory}: cannot list it: {exc}", UserWarning, stacklevel=2)
            continue
        for name, path in names.items():
            chosen.setdefault(name, path)
    infos: builtins.list[DatasetInfo] = []
    for name in sorted(chosen):
        try:
            infos.append(_describe(name, chosen[name]))
        except DatasetError as exc:
            warnings.warn(f"datasets: skipped {name!r}, not a readable graph: {exc}", UserWarning, stacklevel=2)
    return infos


# ---------------------------------------------------------------------------------------- synthetic
def _check(cond: bool, message: str) -> None:
    if not cond:
        raise GraphError(message)


def _is_int(value: Any) -> bool:
    """Whether ``value`` is an int or a numpy integer (not a bool, not an integral float)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value: Any) -> bool:
    """Whether ``value`` is a real number (an int or a float, numpy ones included; not a bool)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _unique_pairs(
    draw: Callable[[int], tuple[np.ndarray, np.ndarray]], n: int, m: int, max_rounds: int = 64
) -> np.ndarray:
    """Up to ``m`` distinct undirected pairs ``lo * n + hi`` (``lo < hi``), in first-drawn order.

    ``draw(k)`` returns ``k`` candidate endpoint pairs; self loops are dropped and repeated pairs
    merged, and more are drawn until ``m`` distinct pairs exist (or ``max_rounds`` is reached,
    which only happens when ``m`` is close to the number of pairs the model can produce).
    """
    keys = np.zeros(0, dtype=np.int64)  # distinct pairs in first-drawn order
    seen = keys  # the same pairs, sorted
    rate = 1.0
    for _ in range(max_rounds):
        need = m - keys.shape[0]
        if need <= 0:
            break
        batch = int(need / max(rate, 0.02) * 1.05) + 16
        u, v = draw(batch)
        keep = u != v
        u, v = u[keep], v[keep]
        new = np.minimum(u, v) * n + np.maximum(u, v)
        uniq, first = np.unique(new, return_index=True)
        if seen.shape[0]:
            pos = np.minimum(np.searchsorted(seen, uniq), seen.shape[0] - 1)
            fresh = seen[pos] != uniq
            uniq, first = uniq[fresh], first[fresh]
        rate = max(uniq.shape[0] / batch, 1e-3)
        keys = np.concatenate([keys, new[np.sort(first)]])
        # Two sorted runs: the stable sort (timsort for int64) merges them in linear time.
        seen = np.sort(np.concatenate([seen, uniq]), kind="stable")
    return keys[:m]


def _drawn_enough(keys: np.ndarray, pairs: int, kind: str, rmat_probs: Optional[builtins.list] = None) -> np.ndarray:
    """``keys`` when :func:`_unique_pairs` found all ``pairs`` requested; otherwise an
    :class:`ArgumentError` (the sampler gives up only when the request is too close to the number
    of pairs the model can produce, or, for ``"rmat"``, when ``rmat_probs`` rarely draw distinct
    pairs inside ``[0, num_nodes)``; a shorter graph than asked would change every size downstream)."""
    if keys.shape[0] < pairs:
        probs = "" if rmat_probs is None else (
            f"rmat_probs={rmat_probs} cannot draw enough distinct pairs with both endpoints below num_nodes, or ")
        raise ArgumentError(
            f"{'rmat_probs / ' if probs else ''}avg_degree / num_edges: {kind!r} drew only {keys.shape[0]:,} distinct "
            f"pairs of the {pairs:,} requested ({2 * pairs:,} directed edges): {probs}the request is too close to the "
            f"number of pairs {'they' if probs else 'this model'} can produce; "
            f"{'spread rmat_probs (default (0.57, 0.19, 0.19, 0.05)) or ' if probs else ''}ask for fewer edges")
    return keys


def _symmetric_csr(keys: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """In-edge CSR (indptr, indices) holding both directions of the pairs ``lo * n + hi``."""
    lo, hi = np.divmod(keys, n) if n else (keys, keys)
    both = np.concatenate([hi * n + lo, lo * n + hi])  # key = dst * n + src
    both.sort()
    dst, src = np.divmod(both, n) if n else (both, both)
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    return indptr, src


def _random_masks(rng: np.random.Generator, n: int, train: float, val: float) -> dict[str, np.ndarray]:
    """Random split: first ``round(train n)`` of a permutation train, next ``round(val n)`` val, rest test."""
    perm = rng.permutation(n)
    n_train, n_val = round(train * n), round(val * n)
    masks = {}
    for field, ids in (
        ("train_mask", perm[:n_train]),
        ("val_mask", perm[n_train : n_train + n_val]),
        ("test_mask", perm[n_train + n_val :]),
    ):
        m = np.zeros(n, dtype=bool)
        m[ids] = True
        masks[field] = m
    return masks


def _pair_target(num_nodes: int, avg_degree: float, num_edges: Optional[int]) -> int:
    if num_edges is None:
        _check(_is_real(avg_degree) and avg_degree >= 0 and math.isfinite(avg_degree),
               f"avg_degree: must be a finite number >= 0, got {avg_degree!r}")
        pairs = int(round(num_nodes * avg_degree / 2))
    else:
        _check(_is_int(num_edges) and num_edges >= 0, f"num_edges: must be an int >= 0, got {num_edges!r}")
        pairs = int(num_edges) // 2
    possible = num_nodes * (num_nodes - 1) // 2
    _check(
        pairs <= possible,
        f"num_edges: {2 * pairs} directed edges requested but {num_nodes} nodes without self loops allow at most "
        f"{2 * possible}",
    )
    return pairs


def synthetic(
    kind: str,
    *,
    num_nodes: int = 20_000,
    avg_degree: float = 20.0,
    num_edges: Optional[int] = None,
    num_features: int = 128,
    num_classes: int = 8,
    seed: int = 0,
    homophily: Optional[float] = None,
    feature_noise: Optional[float] = None,
    rmat_probs: Optional[Sequence[float]] = None,
    train_fraction: float = 0.6,
    val_fraction: float = 0.2,
    name: Optional[str] = None,
) -> Graph:
    """Generate a synthetic undirected graph with features, labels and a random split.

    Every kind gives a symmetric graph (each undirected pair stored in both directions) without
    self loops or parallel edges, float32 features, int64 labels in ``[0, num_classes)`` and random
    ``train_fraction`` / ``val_fraction`` / rest train/val/test masks (default 60/20/20, made like
    the npz datasets' random splits). The same arguments and ``seed`` give an identical graph;
    structure, features and the split use independent random streams, so e.g. changing
    ``num_features`` keeps the edges.

    Kinds
    -----
    ``"sbm"``
        Stochastic block model, the built-in default graph. Class = block; blocks are balanced and
        scattered over the ids (a random permutation). Each edge picks a uniform endpoint ``u``,
        then with probability ``homophily`` (default 0.8) a uniform partner in ``u``'s class,
        otherwise one in a uniformly chosen other class, so about ``homophily`` of the edges are
        intra-class. Degrees are Poisson-like. Features are ``mu[y] + feature_noise * N(0, I)``
        with class means ``mu ~ N(0, I / num_features)`` (norm about 1) and ``feature_noise``
        defaulting to 4.0. With the defaults (20k nodes, degree 20, 128 features, 8 classes) the
        features alone are weak (nearest-class-mean accuracy about 0.14, chance 0.125), one-hop
        mean aggregation lifts that to about 0.42, and a 2-layer GCN (hidden 256, 200 epochs,
        ``gc.train``) reaches about 0.95 test accuracy: the graph structure is what makes the task
        learnable. The GCN accuracy is bounded mostly by ``homophily`` (0.7 gives about 0.91;
        0.6 with ``feature_noise=2`` about 0.88), much less by ``feature_noise``.
    ``"rmat"``
        R-MAT power-law graph (Chakrabarti et al. 2004) with quadrant probabilities ``rmat_probs``
        ``(a, b, c, d)`` (default Graph500's ``(0.57, 0.19, 0.19, 0.05)``). Endpoints are drawn in
        ``[0, 2^s)`` with ``2^s >= num_nodes``; pairs with an endpoint ``>= num_nodes`` are
        discarded (and replaced by new draws), then ids are shuffled by a random permutation (as
        Graph500 does) so hubs are not clustered at low ids. Features ``N(0, I)`` and labels are
        **random**: there is nothing to learn; use it for scaling and partitioning.
    ``"er"``
        Erdős–Rényi ``G(n, m)``: ``m`` distinct uniform pairs. Random features and labels as for
        ``"rmat"``.

    Parameters
    ----------
    kind:
        One of :data:`SYNTHETIC_KINDS`.
    num_nodes:
        Number of vertices.
    avg_degree:
        Average degree of the result: ``round(num_nodes * avg_degree / 2)`` distinct undirected
        pairs are generated, i.e. ``num_edges ≈ num_nodes * avg_degree`` stored directed edges.
    num_edges:
        Number of stored directed edges instead of ``avg_degree`` (rounded down to even).
    num_features, num_classes:
        Feature width and number of classes.
    seed:
        Seed of all random streams.
    homophily, feature_noise:
        ``"sbm"`` only (defaults 0.8 and 4.0).
    rmat_probs:
        ``"rmat"`` only (default ``(0.57, 0.19, 0.19, 0.05)``; must sum to 1).
    train_fraction, val_fraction:
        Split sizes; the test set is the rest.
    name:
        Graph name; defaults to ``"<kind>-<num_nodes>"``.

    Raises
    ------
    DatasetError
        For an unknown ``kind`` (the message lists the valid kinds).
    GraphError
        For invalid sizes or parameters, or parameters of another kind.
    ArgumentError
        For a negative ``seed``, an ``"sbm"`` with fewer vertices than classes, and a request for
        more distinct pairs than the model can draw: ``"sbm"`` with ``homophily`` 1 (0) draws only
        intra- (inter-) class pairs, and the samplers give up near the number of pairs a model can
        produce. The result always has exactly the requested number of edges.
    """
    if kind not in SYNTHETIC_KINDS:
        raise DatasetError(f"synthetic: unknown kind {kind!r}; valid kinds: {', '.join(SYNTHETIC_KINDS)}")
    for param, value, owner in (("homophily", homophily, "sbm"), ("feature_noise", feature_noise, "sbm"),
                                ("rmat_probs", rmat_probs, "rmat")):
        _check(value is None or kind == owner, f"{param}: applies to kind {owner!r} only, not {kind!r}")
    _check(_is_int(num_nodes) and num_nodes >= 1, f"num_nodes: must be an int >= 1, got {num_nodes!r}")
    _check(_is_int(num_features) and num_features >= 0, f"num_features: must be an int >= 0, got {num_features!r}")
    _check(_is_int(num_classes) and num_classes >= 1, f"num_classes: must be an int >= 1, got {num_classes!r}")
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ArgumentError(f"seed: expected an int >= 0, got {seed!r}")
    _check(
        0 <= train_fraction and 0 <= val_fraction and train_fraction + val_fraction <= 1,
        f"train_fraction, val_fraction: need 0 <= train, 0 <= val, train + val <= 1; got {train_fraction}, {val_fraction}",
    )
    h = 0.8 if homophily is None else float(homophily)
    noise = 4.0 if feature_noise is None else float(feature_noise)
    _check(0.0 <= h <= 1.0, f"homophily: must be in [0, 1], got {h}")
    _check(noise >= 0.0 and math.isfinite(noise), f"feature_noise: must be a finite number >= 0, got {noise}")
    probs = np.asarray((0.57, 0.19, 0.19, 0.05) if rmat_probs is None else rmat_probs, dtype=np.float64)
    _check(
        probs.shape == (4,) and bool((probs >= 0).all()) and abs(float(probs.sum()) - 1) < 1e-9,
        f"rmat_probs: expected four probabilities (a, b, c, d) >= 0 summing to 1, got {probs.tolist()}",
    )
    n = int(num_nodes)
    pairs = _pair_target(n, avg_degree, num_edges)
    s_struct, s_feat, s_split = np.random.SeedSequence(seed).spawn(3)
    rng = np.random.default_rng(s_struct)
    rng_feat = np.random.default_rng(s_feat)

    if kind == "sbm":
        c = int(num_classes)
        if n < c:
            raise ArgumentError(f"num_nodes: the sbm needs at least one vertex per class (block), got num_nodes={n} "
                                f"< num_classes={c}")
        sizes = np.bincount(np.arange(n, dtype=np.int64) % c, minlength=c)
        if c == 1:
            h = 1.0
        intra_pairs = int((sizes * (sizes - 1) // 2).sum())
        drawable = {1.0: intra_pairs, 0.0: n * (n - 1) // 2 - intra_pairs}.get(h, n * (n - 1) // 2)
        if pairs > drawable:
            which = "intra-class" if h == 1.0 else "inter-class"
            raise ArgumentError(f"avg_degree / num_edges: {2 * pairs:,} directed edges requested but homophily={h} "
                                f"draws only {which} pairs, and {c} classes of {n} vertices hold {drawable:,} of "
                                f"them ({2 * drawable:,} directed edges)")
        y = rng.permutation(np.arange(n, dtype=np.int64) % c)
        members = np.argsort(y, kind="stable")
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])

        def draw(k: int) -> tuple[np.ndarray, np.ndarray]:
            u = rng.integers(0, n, k)
            cu = y[u]
            intra = rng.random(k) < h
            other = (cu + rng.integers(1, max(c, 2), k)) % c
            target = np.where(intra, cu, other)
            v = members[starts[target] + (rng.random(k) * sizes[target]).astype(np.int64)]
            return u, v

        keys = _drawn_enough(_unique_pairs(draw, n, pairs), pairs, kind)
        means = rng_feat.standard_normal((c, num_features), dtype=np.float32) / np.float32(math.sqrt(max(num_features, 1)))
        x = rng_feat.standard_normal((n, num_features), dtype=np.float32)
        x *= np.float32(noise)
        x += means[y]
    else:
        if kind == "rmat":
            scale = max(1, math.ceil(math.log2(n))) if n > 1 else 1
            cum = np.cumsum(probs)[:3]

            def draw(k: int) -> tuple[np.ndarray, np.ndarray]:
                u = np.zeros(k, dtype=np.int64)
                v = np.zeros(k, dtype=np.int64)
                for _ in range(scale):
                    q = np.searchsorted(cum, rng.random(k), side="right")  # 0=a, 1=b, 2=c, 3=d
                    u = (u << 1) | (q >> 1)
                    v = (v << 1) | (q & 1)
                inside = (u < n) & (v < n)
                return u[inside], v[inside]
        else:

            def draw(k: int) -> tuple[np.ndarray, np.ndarray]:
                return rng.integers(0, n, k), rng.integers(0, n, k)

        keys = _drawn_enough(_unique_pairs(draw, n, pairs), pairs, kind, probs.tolist() if kind == "rmat" else None)
        if kind == "rmat":
            perm = rng.permutation(n).astype(np.int64)
            lo, hi = np.divmod(keys, n)
            a, b = perm[lo], perm[hi]
            keys = np.minimum(a, b) * n + np.maximum(a, b)
        y = rng_feat.integers(0, num_classes, n)
        x = rng_feat.standard_normal((n, num_features), dtype=np.float32)

    indptr, indices = _symmetric_csr(keys, n)
    masks = _random_masks(np.random.default_rng(s_split), n, train_fraction, val_fraction)
    return Graph(
        indptr, indices, n, x=x, y=y, num_classes=int(num_classes), name=name or f"{kind}-{n}", **masks
    )


# ``gc.datasets.list()`` reads naturally; the module's own code uses ``builtins.list`` explicitly.
list = list_datasets  # noqa: A001 - intended shadowing, not exported by ``import *``


#: Statistics of graphs too large to ship, for planning from statistics alone (``gc.plan(model,
#: datasets.stats("ogbn-papers100M"), "8x8xA100-ib200")``).
KNOWN_STATS: dict[str, GraphStats] = {
    # OGB (Hu et al., NeurIPS 2020), ogbn-papers100M: 111,059,956 nodes, 1,615,685,872 edges, 128
    # features, 172 classes. replication: METIS replication factors of NeutronTask (PVLDB 18(6),
    # 2025) Table 2, for 1 to 64 partitions.
    "ogbn-papers100M": GraphStats(
        num_nodes=111_059_956, num_edges=1_615_685_872, num_features=128, num_classes=172,
        replication={1: 1.0, 2: 1.25, 4: 1.52, 8: 2.13, 16: 3.02, 32: 4.46, 64: 6.34}, name="ogbn-papers100M",
        symmetric=False),
    # OGB ogbn-products: 2,449,029 nodes, 61,859,140 edges (stored in both directions), 100 features,
    # 47 classes.
    "ogbn-products": GraphStats(num_nodes=2_449_029, num_edges=61_859_140, num_features=100, num_classes=47,
                                name="ogbn-products", symmetric=True),
}


def stats(name: PathLike) -> GraphStats:
    """The :class:`GraphStats` of a dataset: a local one's (loaded; a name or a path, as for
    :func:`load`), or one of :data:`KNOWN_STATS` (a :class:`DatasetError` for neither names both
    kinds, an :class:`ArgumentError` for neither a name nor a path)."""
    _check_name(name)
    for key, value in KNOWN_STATS.items():
        if isinstance(name, str) and key.lower() == name.lower():
            return value
    try:
        graph = load(name)
    except DatasetError as exc:
        raise DatasetError(f"{exc}\nstatistics only (for planning): {', '.join(KNOWN_STATS)}") from None
    return graph.stats()
