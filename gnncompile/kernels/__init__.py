"""Sparse kernels behind one interface: SpMM and SDDMM over a CSR structure.

Two products cover every P op and the backward of every P op:

- ``spmm(csr, values, x, row_scale=, col_scale=)``:
  ``out[r] = row_scale[r] * sum_{e in row r} values[e] * col_scale[col[e]] * x[col[e]]`` (per head
  when ``values`` is ``[E, H]`` and ``x`` is ``[N, H, C]``; a missing factor is 1). The per-vertex
  scales carry degree normalizations (GCN's ``D^-1/2 A D^-1/2``, mean's ``D^-1 A``), so a
  normalized product needs no per-edge array.
- with ``loop=`` factors, self-loop terms in the same call: ``out[r] += loop[r] * x[r]`` for the
  own rows (``loop_at`` places them in a rectangular matrix): ``A + diag(loop)`` without two more
  passes over vertex tensors (native: added as each row is stored; torch, scipy: fixed loops folded
  into the matrix once).
- ``sddmm(csr, a, b)``: ``w[e] = <a[row(e)], b[col[e]]>`` (per head), the gradient of SpMM
  with respect to its edge values.

Edge ops, native on the CPU (:func:`native_edge_ops`): ``gather_rows`` (rows by an index,
prefetched), ``segment_sum`` (an edge tensor summed per row), ``scatter_sum`` (per column) and
``edge_softmax_step`` (a softmax over each row's edges in three steps), the E ops' forward and
backward without index copies or spread temporaries; ``attention_scores`` / ``attention_backward``
(GAT's LeakyReLU scores and their softmax fused: no per-edge gathers, sums or pre-activations);
on CUDA, with the ``cupy`` backend, ``attention_coefficients`` / ``attention_backward`` by
gnncompile's own kernels (:func:`fused_attention`), with another backend where they are measured
faster than the torch formulation on the structure (:func:`attention_measured`).

Backends
--------
``native``  C++/OpenMP kernel compiled on first use (``csrc/spmm.cpp``): edge-balanced row blocks
            scheduled dynamically, whole-row register accumulation (all heads of a row at once),
            int32 indices, cross-row prefetching, huge pages for large outputs. CPU,
            float32/float64; deterministic whatever the thread count.
``torch``   ``torch.sparse.mm`` on a CSR tensor (MKL on CPU, cuSPARSE on CUDA); all heads of a
            multi-head product in one call, over a head-interleaved copy of the structure (cached).
            SDDMM by ``torch.sparse.sampled_addmm`` (on CUDA cuSPARSE's, where it is measured
            against gathering both operands on first use and the faster kept).
``scipy``   ``scipy.sparse.csr_matrix @ ndarray`` (single-threaded; CPU).
``cupy``    CUDA tensors, through CuPy. float32: per structure and shape, the fastest correct one
            (measured on the first call, :func:`cuda.choose`) of cuSPARSE's SpMM and gnncompile's
            own kernels (``csrc/spmm.cu``: a group of lanes per row, vector loads, all heads in one
            pass, scales inside, hub rows split into chunks; SDDMM likewise against the gathering
            reference). float64: cuSPARSE's generic SpMM through CuPy's bindings, row-major dense
            operands read and written in place (no copies, outputs allocated by torch), on torch's
            current stream; the CSR descriptor is built once per structure, device and dtype.

The default backend is chosen by the tensor's device (``native`` on CPU when the extension builds,
otherwise ``torch`` with a warning; ``torch`` on CUDA, where it was measured fastest; ``cupy`` by name)
and can be overridden per call, with :func:`set_default_backend`, or with the environment variable
``GNNCOMPILE_BACKEND``. Nothing here materializes a dense adjacency: the backward product uses the
transposed CSR that :class:`~gnncompile.graph.Graph` caches.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import math
import os
import sys
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np
import torch

from ..errors import KernelError
from . import cuda

__all__ = [
    "CSR",
    "BACKENDS",
    "available_backends",
    "default_backend",
    "set_default_backend",
    "spmm",
    "sddmm",
    "gather_rows",
    "segment_sum",
    "scatter_sum",
    "edge_softmax_step",
    "attention_scores",
    "attention_backward",
    "attention_coefficients",
    "fused_attention",
    "attention_fusable",
    "attention_measured",
    "native_edge_ops",
    "prepare_native",
    "native_extension_name",
]


@dataclass(eq=False)
class CSR:
    """A CSR structure (rows = destinations) plus per-backend derived data cached on it.

    ``indptr``: int64 ``[rows + 1]``; ``indices``: int32 or int64 ``[E]`` column (source) ids
    (graphs store int32 whenever the columns fit).
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    num_rows: int
    num_cols: int
    cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def nnz(self) -> int:
        return int(self.indices.numel())

    @property
    def device(self) -> torch.device:
        return self.indptr.device

    def cached(self, key: str, build: Callable[[], Any]) -> Any:
        try:
            return self.cache[key]
        except KeyError:
            v = self.cache[key] = build()
            return v

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indptr, indices)`` on ``device``: the structure itself, or a copy made once and cached."""
        if device == self.device:
            return self.indptr, self.indices
        return self.cached(f"index:{device}", lambda: (self.indptr.to(device), self.indices.to(device)))

    def matched(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(indptr, indices)`` on ``device`` with one index dtype (what torch's and SciPy's CSR
        constructors need): int32 offsets when the indices are int32 and the edge count fits, else
        int64 indices. Only the converted array is copied (once, cached)."""
        indptr, indices = self.on(device)
        if indptr.dtype == indices.dtype:
            return indptr, indices
        if indices.dtype == torch.int32 and self.nnz <= _INT32_MAX:
            return self.cached(f"indptr32:{device}", lambda: indptr.to(torch.int32)), indices
        return indptr, self.cached(f"indices64:{device}", lambda: indices.to(torch.int64))


# --------------------------------------------------------------------------- helpers
def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as ``[rows, prod(trailing dims)]`` (well defined for zero rows too)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def _shaped(out: torch.Tensor, rows: int, tail: tuple[int, ...]) -> torch.Tensor:
    """``out`` ``[rows, heads * d]`` (contiguous) as ``[rows, *tail]``: itself when the shapes agree,
    else a tensor of its own over the same storage, not a view of ``out`` (a view keeps a base: a
    plan's ``Free`` releases only a stage output that is no view, ``runtime.executor``)."""
    shape = (rows,) + tail
    if tuple(out.shape) == shape:
        return out
    if not out.is_contiguous():
        return out.reshape(shape)
    return out.new_empty(0).set_(out.untyped_storage(), out.storage_offset(), shape)


def _split_heads(values: Optional[torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, int, tuple[int, ...]]:
    """Return ``(x2d, heads, out_shape_tail)`` with ``x2d`` contiguous ``[N, H*C]``."""
    if values is not None and values.dim() == 2 and values.shape[1] > 1:
        heads = values.shape[1]
        if x.dim() != 3 or x.shape[1] != heads:
            raise KernelError(
                f"spmm: edge values have {heads} heads, so x must be [N, {heads}, C]; got {list(x.shape)}"
            )
    else:
        heads = 1
    tail = tuple(x.shape[1:])
    return _as_rows(x).contiguous(), heads, tail


def _check(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor, row_scale: Optional[torch.Tensor],
           col_scale: Optional[torch.Tensor], transpose: bool = False, loop: Optional[torch.Tensor] = None,
           loop_at: tuple[int, int] = (0, 0)) -> None:
    for name, t, n in (("row_scale", row_scale, csr.num_rows), ("col_scale", col_scale, csr.num_cols)):
        if t is not None and (t.dim() != 1 or t.shape[0] != n or t.dtype != x.dtype or t.device != x.device):
            raise KernelError(f"spmm: {name} must be a 1-d {x.dtype} tensor of {n} entries on {x.device}; got "
                              f"{t.dtype} {list(t.shape)} on {t.device}")
    if transpose and x.shape[0] != csr.num_rows:
        raise KernelError(f"spmm: x has {x.shape[0]} rows but the transposed product needs one per sparse "
                          f"matrix row ({csr.num_rows})")
    if not transpose and x.shape[0] != csr.num_cols:
        raise KernelError(f"spmm: x has {x.shape[0]} rows but the sparse matrix has {csr.num_cols} columns")
    if values is not None:
        if values.shape[0] != csr.nnz:
            raise KernelError(f"spmm: {values.shape[0]} edge values for {csr.nnz} edges")
        if values.dtype != x.dtype:
            raise KernelError(f"spmm: values dtype {values.dtype} differs from x dtype {x.dtype}")
        if values.device != x.device:
            raise KernelError(f"spmm: edge values are on {values.device} but x is on {x.device}")
    if loop is not None:
        row0, col0 = loop_at
        n = loop.shape[0] if loop.dim() else -1
        heads = x.shape[1] if x.dim() == 3 else 1
        if (loop.dim() not in (1, 2) or loop.dim() == 2 and loop.shape[1] not in (1, heads)
                or loop.dtype != x.dtype or loop.device != x.device):
            raise KernelError(f"spmm: loop must be a {x.dtype} tensor on {x.device} of shape [n] or [n, H] with x "
                              f"[N, H, C] (one factor per row or per head); got {loop.dtype} {list(loop.shape)} on "
                              f"{loop.device} for x {list(x.shape)}")
        if min(row0, col0) < 0 or row0 + n > csr.num_rows or col0 + n > csr.num_cols:
            raise KernelError(f"spmm: {n} self loops from {tuple(loop_at)} do not fit the "
                              f"{csr.num_rows} x {csr.num_cols} matrix")


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Within the block torch's CPU ops (and the native kernels) use ``n`` threads; the caller's
    count is restored on exit. For work made of many small ops: each parallel region of an op
    waits for its slowest thread, and on a busy host that is one descheduled for a time slice."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# --------------------------------------------------------------------------- native backend
_native_module: Any = None
_native_error: Optional[str] = None
_NATIVE_SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "spmm.cpp")
# -fopenmp: without it ATen's parallel_for (inlined from its headers) and the kernels' simd pragmas
# compile to serial code. The extension then links against the libgomp that torch has already
# loaded (same soname), so torch.set_num_threads governs both.
_NATIVE_CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fopenmp")
_NATIVE_LDFLAGS = ("-fopenmp",)


def native_extension_name(source: bytes, torch_version: str, interpreter: str,
                          flags: tuple[str, ...] = _NATIVE_CFLAGS + _NATIVE_LDFLAGS, source_path: str = "") -> str:
    """The torch-extension name the native kernels are built under: a key of everything the build depends on.

    ``source`` is the C++ source and ``source_path`` where it lies, ``torch_version`` and
    ``interpreter`` identify the torch build and the Python that load it (:func:`_native_build_key`
    passes torch's version and install path, and the interpreter's path and version), ``flags`` the
    compiler and linker flags. Two checkouts or virtual environments get different names, so they
    never rebuild each other's extension in the shared torch extension cache (torch's build file
    names the source's path: two checkouts of one source in one folder rebuilt it in turn).
    """
    h = hashlib.sha256()
    for part in (source, torch_version.encode(), interpreter.encode(), "\0".join(flags).encode(),
                 source_path.encode()):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return f"gnncompile_native_{h.hexdigest()[:12]}"


def _native_build_key() -> dict[str, Any]:
    """The arguments of :func:`native_extension_name` for this environment and checkout."""
    with open(_NATIVE_SOURCE, "rb") as f:
        source = f.read()
    torch_id = f"{torch.__version__} {os.path.dirname(torch.__file__)}"
    interpreter = f"{sys.executable} {sys.version}"
    return dict(source=source, torch_version=torch_id, interpreter=interpreter,
                source_path=os.path.realpath(_NATIVE_SOURCE))


#: written beside the extension once torch's build of it has been loaded: a later process imports
#: the library directly (:func:`_import_built`)
_BUILT_MARK = "gnncompile.built"


def _default_extensions_root() -> str:
    """torch's default extension cache, as ``torch.utils.cpp_extension.get_default_build_root``
    computes it, without importing that module (it imports setuptools: a fifth of a second in every
    rank that loads the kernels)."""
    try:
        from torch import _appdirs
    except ImportError:  # pragma: no cover - torch without its vendored appdirs
        from torch.utils.cpp_extension import get_default_build_root
        return get_default_build_root()
    return os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))


def _import_built(name: str, build_dir: str) -> Optional[Any]:
    """The extension ``name`` imported from ``build_dir`` when a process loaded torch's build of it
    there before (:data:`_BUILT_MARK`), else ``None`` (build or load it through torch)."""
    import importlib.util

    library = os.path.join(build_dir, f"{name}.so")
    if not (os.path.exists(os.path.join(build_dir, _BUILT_MARK)) and os.path.exists(library)):
        return None
    loaded = sys.modules.get(name)
    if loaded is not None and os.path.realpath(getattr(loaded, "__file__", "") or "") == os.path.realpath(library):
        return loaded
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception:  # noqa: BLE001 - unreadable or stale: torch's load rebuilds it
        return None
    sys.modules[name] = module
    return module


def _load_native() -> Any:
    """Compile (once per source, torch and interpreter; cached by torch) and import the C++ kernels.

    The extension is built in its own folder of torch's extension cache (``TORCH_EXTENSIONS_DIR``
    or torch's default), named by :func:`native_extension_name`. A build prints one line to stderr.
    """
    global _native_module, _native_error
    if _native_module is not None:
        return _native_module
    if _native_error is not None:
        raise KernelError(f"native backend unavailable: {_native_error}")
    name = native_extension_name(**_native_build_key())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or _default_extensions_root()
    build_dir = os.path.join(root, name)
    built = _import_built(name, build_dir)
    if built is not None:
        _native_module = built
        return built
    try:
        from torch.utils.cpp_extension import load

        os.makedirs(build_dir, exist_ok=True)
        # torch's build lock is a plain file that a killed build leaves behind, after which every
        # later load waits for it forever. An flock (released by the kernel when its holder dies)
        # serializes our builds instead: whoever holds it and still sees torch's lock knows it is stale.
        with open(os.path.join(build_dir, "gnncompile.flock"), "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                os.remove(stale)
            if not os.path.exists(os.path.join(build_dir, f"{name}.so")):
                print("gnncompile: building native CPU kernels (once, ~30 s)...", file=sys.stderr, flush=True)
            _native_module = load(name, [_NATIVE_SOURCE], extra_cflags=list(_NATIVE_CFLAGS),
                                  extra_ldflags=list(_NATIVE_LDFLAGS), build_directory=build_dir, verbose=False)
            with contextlib.suppress(OSError):   # (without the mark, later loads go through torch's)
                with open(os.path.join(build_dir, _BUILT_MARK), "w") as f:
                    f.write(f"{name}.so\n")
    except Exception as exc:  # compiler missing, ninja missing, ...
        _native_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise KernelError(f"native backend unavailable: {_native_error}") from exc
    return _native_module


def _native_index(csr: CSR) -> torch.Tensor:
    def build() -> torch.Tensor:
        if csr.num_cols < 2**31 - 1:
            return csr.indices.to(torch.int32).contiguous()
        return csr.indices.contiguous()
    return csr.cached("native:indices", build)


def _require_cpu(backend: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu":
            raise KernelError(f"{backend} backend: runs on CPU tensors, got one on {t.device}; use the 'torch' "
                              "or 'cupy' backend for CUDA tensors (kernels.set_default_backend(None) picks by device)")


def _spmm_native(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor,
                 row_scale: Optional[torch.Tensor] = None, col_scale: Optional[torch.Tensor] = None,
                 transpose: bool = False, loop: Optional[torch.Tensor] = None,
                 loop_at: tuple[int, int] = (0, 0)) -> torch.Tensor:
    _require_cpu("native", x, csr.indptr)
    mod = _load_native()
    x2, heads, tail = _split_heads(values, x)
    if loop is not None and loop.numel() not in (loop.shape[0], loop.shape[0] * heads):
        # per-head factors of a single-head product ([N, H] over x [N, H, C]): applied apart
        out = _spmm_native(csr, values, x, row_scale, col_scale, transpose)
        _add_loop_terms(out, loop, x, loop_at, transpose)
        return out
    vals = None if values is None else values.contiguous()
    rs = None if row_scale is None else row_scale.contiguous()
    cs = None if col_scale is None else col_scale.contiguous()
    lp = None if loop is None else loop.contiguous()
    width = x2.shape[1]
    padded = _padded_width(csr, width, transpose) if heads == 1 else None
    if padded is not None:
        x2 = torch.nn.functional.pad(x2, (0, padded - width))
    if transpose:
        out = mod.spmm_t(csr.indptr, _native_index(csr), vals, x2, heads, csr.num_cols,
                         _push_parts(csr, torch.get_num_threads()), rs, cs, lp, *loop_at)
    else:
        out = mod.spmm(csr.indptr, _native_index(csr), vals, x2, heads, 0, rs, cs, lp, *loop_at)
    if padded is not None:
        out = out[:, :width].contiguous()
    return _shaped(out, out.shape[0], tail)


#: Narrow single-head widths the native kernels run zero-padded to a power of two (SpMM: the
#: columns are independent, the same sums bit for bit; SDDMM: the zero columns add nothing to the
#: dot products, summed in the compile-time width's order: width 5 on coauthor_physics 3.7 -> 1.1
#: ms). Rows of such widths straddle cache lines and miss the kernels' compile-time loops: on
#: coauthor_physics (2 threads) width 5 took 1.3 ms pulled and 3.7 ms pushed against 0.47 and 1.8
#: ms at width 8, width 12 2.0 and 4.3 ms against 0.47 and 1.9 at 16, width 20 1.5 and 3.1 against
#: 0.66 and 2.1 at 32; at width 40 padding to 64 no longer paid.
_PADDED_WIDTHS = {w: 1 << (w - 1).bit_length() for w in range(3, 32) if w & (w - 1)}

#: Edges per row of the padded input and output below which an SpMM runs unpadded: padding copies
#: every row of the input and of the output (a chunk's product pads the whole source tensor), which
#: pays only over enough edges. Measured on coauthor_physics (2 threads), width 5, a chunk of the
#: rows against all 34,493 sources, padded against unpadded: a quarter of the rows (3.1 edges per
#: padded row) pulled 0.42 against 0.43 ms; an eighth (1.7) pulled 0.31 against 0.17, pushed 0.47
#: against 0.59; a sixteenth (0.84) pushed 0.32 against 0.27; all rows (7.2) 0.98 against 1.65 and
#: 2.67 against 4.60.
_PAD_EDGES_PER_ROW = {False: 3.0, True: 1.0}


def _padded_width(csr: CSR, width: int, transpose: bool) -> Optional[int]:
    """The width an SpMM of ``csr`` (``transpose``: its transposed product) with ``width`` columns
    runs at in the native kernel: a power of two when padding pays (above), else ``None``."""
    padded = _PADDED_WIDTHS.get(width)
    if padded is None or csr.nnz < _PAD_EDGES_PER_ROW[transpose] * (csr.num_rows + csr.num_cols):
        return None
    return padded


def prepare_native(csr: CSR, transpose_threads: Optional[int] = None) -> None:
    """Build now what the native kernels derive from ``csr`` and cache on it: its index form (int32
    column indices where they fit) and, with ``transpose_threads``, the transposed product's output
    parts for that many threads; later products then allocate nothing for the structure."""
    _native_index(csr)
    if transpose_threads:
        _push_parts(csr, transpose_threads)


def _push_parts(csr: CSR, threads: int) -> torch.Tensor:
    """Bounds (int64, ``threads + 1`` entries) cutting the columns into ranges of about equal work
    (in-edges + 1 per column): the output parts of the native transposed product's threads. Cached
    per thread count as plain integers (not topology); computing them reads the indices once."""
    def build() -> tuple[int, ...]:
        work = torch.bincount(csr.indices.to(torch.int64), minlength=csr.num_cols).add_(1).cumsum_(0)
        total = int(work[-1]) if csr.num_cols else 0
        targets = torch.arange(1, threads, dtype=torch.int64, device=work.device) * total // max(threads, 1)
        inner = torch.searchsorted(work, targets, right=True).clamp_(max=csr.num_cols)
        return (0, *inner.tolist(), csr.num_cols)
    return torch.tensor(csr.cached(f"native:push_parts:{threads}", build), dtype=torch.int64, device="cpu")


def _sddmm_native(csr: CSR, a: torch.Tensor, b: torch.Tensor, heads: int) -> torch.Tensor:
    _require_cpu("native", a, b, csr.indptr)
    mod = _load_native()
    a2 = _as_rows(a).contiguous()
    b2 = _as_rows(b).contiguous()
    padded = _PADDED_WIDTHS.get(a2.shape[1]) if heads == 1 else None
    if padded is not None:  # zero columns add nothing to the dot products
        a2 = torch.nn.functional.pad(a2, (0, padded - a2.shape[1]))
        b2 = torch.nn.functional.pad(b2, (0, padded - b2.shape[1]))
    return mod.sddmm(csr.indptr, _native_index(csr), a2, b2, heads)


# --------------------------------------------------------------------------- edge reductions
#: the dtypes the native edge reductions run in
_EDGE_DTYPES = (torch.float32, torch.float64)


def native_edge_ops(t: torch.Tensor) -> bool:
    """Whether the native edge ops (:func:`gather_rows`, :func:`segment_sum`, :func:`scatter_sum`,
    :func:`edge_softmax_step`, :func:`gnncompile.kernels.dropout.keep_times`) serve ``t``: a float32 or
    float64 CPU tensor while the default backend there is ``native``. Elsewhere (CUDA, another
    backend chosen, the extension unavailable) :mod:`gnncompile.frontend.ops` runs their torch
    formulations, which compute the same values with temporaries these do not need."""
    return t.device.type == "cpu" and t.dtype in _EDGE_DTYPES and default_backend(t.device) == "native"


def _edge_rows(csr: CSR, t: torch.Tensor, op: str, loops: bool = False) -> torch.Tensor:
    rows = csr.nnz + (csr.num_rows if loops else 0)
    if t.dim() == 0 or t.shape[0] != rows:
        raise KernelError(f"{op}: expected an edge tensor of {rows} rows (edges{' + self loops' if loops else ''}), "
                          f"got shape {list(t.shape)}")
    if t.dtype not in _EDGE_DTYPES:
        raise KernelError(f"{op}: runs on float32/float64 tensors, got {t.dtype}")
    _require_cpu("native", t)
    return t.contiguous()


def gather_rows(t: torch.Tensor, index: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``t[index]`` (rows of ``t`` by a 1-d int32/int64 index), natively: the rows prefetched ahead
    of their copy, which a gather at random (an edge permutation, the edges' sources) is bound by;
    int32 indices are read as they are (no int64 copy). Where :func:`native_edge_ops` does not hold
    for ``t``, ``index_select``. With ``out`` (contiguous, ``t``'s dtype and row shape) the rows
    fill its first ``len(index)`` rows and ``out`` is returned."""
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
        raise KernelError(f"gather_rows: index must be a 1-d int32/int64 tensor, got {index.dtype} {list(index.shape)}")
    if out is not None and (not out.is_contiguous() or out.dtype != t.dtype or out.shape[1:] != t.shape[1:]
                            or out.shape[0] < index.numel()):
        raise KernelError(f"gather_rows: out must be a contiguous {t.dtype} tensor of rows {list(t.shape[1:])} "
                          f"and at least {index.numel()} rows, got {out.dtype} {list(out.shape)}")
    if not native_edge_ops(t) or index.device != t.device:
        idx = index.long() if t.device.type == "cpu" else index
        if out is None:
            return t.index_select(0, idx)
        torch.index_select(t, 0, idx, out=out[: index.numel()])
        return out
    return _load_native().gather_rows(t.contiguous(), index.contiguous(), out)


def segment_sum(csr: CSR, t: torch.Tensor) -> torch.Tensor:
    """``out[r] = sum_{e in row r} t[e]``: an edge tensor ``[E, ...]`` in CSR order summed per row
    (``[num_rows, ...]``, 0 for an empty row), natively: rows in parallel, each summed in edge order."""
    return _load_native().segment_sum(csr.indptr, _edge_rows(csr, t, "segment_sum"))


def scatter_sum(csr: CSR, t: torch.Tensor) -> torch.Tensor:
    """``out[u] = sum_{e: col(e) = u} t[e]``: an edge tensor ``[E, ...]`` summed into its edges'
    columns (``[num_cols, ...]``), natively: each thread owns a range of columns (those of the
    transposed product, :func:`_push_parts`) and adds its columns' edges in edge order."""
    t = _edge_rows(csr, t, "scatter_sum")
    return _load_native().scatter_sum(csr.indptr, _native_index(csr), t, csr.num_cols,
                                      _push_parts(csr, torch.get_num_threads()))


def edge_softmax_step(csr: CSR, t: torch.Tensor, step: str, *, loops: bool = False,
                      grad: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One step of a softmax over each row's edges (rows of ``t``, ``[E (+ num_rows), ...]`` in CSR
    order; with ``loops`` row ``E + r`` is row ``r``'s self loop, reduced after its edges), natively:

    - ``"shift"``: a new tensor, ``t`` minus its rows' maxima (per column);
    - ``"normalize"``: ``t`` divided in place by its rows' sums, returned;
    - ``"backward"``: a new tensor, ``t * grad - t * rowsum(t * grad)`` (``t`` the softmax's output).

    The softmax is ``normalize(exp(shift(e)))``; the exponential is torch's (vectorized) ``exp_``."""
    if step not in ("shift", "normalize", "backward"):
        raise KernelError(f"edge_softmax_step: unknown step {step!r}; valid: 'shift', 'normalize', 'backward'")
    t = _edge_rows(csr, t, "edge_softmax_step", loops)
    if step == "backward":
        if grad is None or grad.shape != t.shape or grad.dtype != t.dtype:
            raise KernelError(f"edge_softmax_step: the backward step needs grad of shape {list(t.shape)} and dtype "
                              f"{t.dtype}")
        grad = _edge_rows(csr, grad, "edge_softmax_step", loops)
    elif grad is not None:
        raise KernelError(f"edge_softmax_step: grad is given to the backward step only, not {step!r}")
    return _load_native().edge_softmax_step(csr.indptr, t, grad, loops, step)


def _scores(csr: CSR, src: torch.Tensor, dst: torch.Tensor, op: str, loops: bool, own_offset: int,
            on_cuda: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``src``/``dst`` checked as per-vertex attention scores of ``csr``'s sources and rows (on the
    CPU; with ``on_cuda``, float32 CUDA tensors for the own CUDA kernels where they are on CUDA)."""
    if src.dtype not in _EDGE_DTYPES or src.dtype != dst.dtype or src.dim() == 0 or src.shape[1:] != dst.shape[1:]:
        raise KernelError(f"{op}: src and dst must be float32/float64 tensors of one dtype and row shape, got "
                          f"{src.dtype} {list(src.shape)} and {dst.dtype} {list(dst.shape)}")
    if src.shape[0] != csr.num_cols or dst.shape[0] != csr.num_rows:
        raise KernelError(f"{op}: expected {csr.num_cols} source rows and {csr.num_rows} destination rows, got "
                          f"{src.shape[0]} and {dst.shape[0]}")
    if loops and not 0 <= own_offset <= csr.num_cols - csr.num_rows:
        raise KernelError(f"{op}: the destinations' own rows [{own_offset}, {own_offset + csr.num_rows}) are not "
                          f"rows of src ({csr.num_cols})")
    if on_cuda and src.device.type == "cuda":
        if src.dtype != torch.float32 or dst.device != src.device:
            raise KernelError(f"{op}: the CUDA kernels take float32 scores on one device, got {src.dtype} on "
                              f"{src.device} and {dst.dtype} on {dst.device}")
    else:
        _require_cpu("native", src, dst)
    return src.contiguous(), dst.contiguous()


def fused_attention(t: torch.Tensor) -> bool:
    """Whether GAT's attention over score tensors like ``t`` (``[V, *heads]``) runs fused
    (:func:`attention_coefficients`, :func:`attention_backward`): natively on the CPU where
    :func:`native_edge_ops` holds, by gnncompile's CUDA kernels where the default backend of
    ``t``'s CUDA device is ``cupy``, ``t`` is float32 and its heads a power of two up to 32."""
    if native_edge_ops(t):
        return True
    return (t.device.type == "cuda" and t.dtype == torch.float32 and default_backend(t.device) == "cupy"
            and cuda.attention_group(math.prod(t.shape[1:]), 1.0) is not None)


def attention_fusable(t: torch.Tensor) -> bool:
    """Whether gnncompile's CUDA attention kernels may run GAT's attention over scores like ``t``
    under a default backend that does not mandate them: ``t`` float32 on a CUDA device, its heads a
    power of two up to 32, CuPy installed, and the backend the device's choice (``torch``), not one
    forced by :func:`set_default_backend` or ``GNNCOMPILE_BACKEND`` (a forced ``torch`` runs torch
    operations only). :func:`attention_measured` decides whether they do."""
    return (t.device.type == "cuda" and t.dtype == torch.float32 and not _forced_backend()
            and cuda.attention_group(math.prod(t.shape[1:]), 1.0) is not None and _cupy_importable())


@functools.lru_cache(maxsize=None)
def _cupy_importable() -> bool:
    """Whether CuPy imports here (asked once per process)."""
    try:
        _import_cupy()
    except KernelError:
        return False
    return True


def attention_measured(csr: CSR, t: torch.Tensor, unfused: Callable[[], torch.Tensor],
                       fused: Callable[[], torch.Tensor], key: str,
                       timer: Optional[Callable[[Callable[[], Any]], float]] = None) -> bool:
    """Whether the ``fused`` attention (the own CUDA kernels) beats the ``unfused`` formulation (the
    reference) on ``csr`` for scores like ``t``: each callable computes the coefficients and the
    scores' gradients; measured on first use (:func:`cuda.choose` on ``t``'s device: the faster
    correct one; ``timer``: CUDA events by default) and cached on ``csr`` under ``key`` (what else
    the result depends on: self loops, the own rows' offset)."""
    heads = math.prod(t.shape[1:])

    def decide() -> bool:
        with torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext():
            return cuda.choose("attention", f"{csr.num_rows}x{csr.num_cols}, {csr.nnz} edges, {heads} heads, {key}",
                               {"torch": unfused, "fused": fused}, "torch",
                               timer or (cuda.cuda_timer if t.device.type == "cuda" else cuda.wall_timer)) == "fused"

    return csr.cached(f"choice:attention:{t.device}:{t.dtype}:{heads}:{key}", decide)


def attention_coefficients(csr: CSR, src: torch.Tensor, dst: torch.Tensor, negative_slope: float, *,
                           loops: bool = False, own_offset: int = 0) -> torch.Tensor:
    """GAT's attention coefficients ``softmax_r(LeakyReLU(src[col[e]] + dst[r]))`` over each row's
    edges (and self loop), a new ``[E (+ num_rows), ...]`` tensor, fused: on the CPU
    :func:`attention_scores`, ``exp_`` and the softmax's normalize step (nothing else allocated);
    on CUDA (float32, see :func:`fused_attention`) one kernel launch that recomputes the
    pre-activations in each of its passes and writes only the result."""
    if src.device.type != "cuda":
        out = attention_scores(csr, src, dst, negative_slope, loops=loops, own_offset=own_offset).exp_()
        if out.numel():
            edge_softmax_step(csr, out, "normalize", loops=loops)
        return out
    src, dst = _scores(csr, src, dst, "attention_coefficients", loops, own_offset, on_cuda=True)
    _import_cupy()
    with torch.cuda.device(src.device):
        return cuda.run_attention(_device_csr(csr, src.device), src, dst, float(negative_slope), bool(loops),
                                  int(own_offset), _raw_runner())


def attention_scores(csr: CSR, src: torch.Tensor, dst: torch.Tensor, negative_slope: float, *,
                     loops: bool = False, own_offset: int = 0) -> torch.Tensor:
    """GAT's attention scores over each row's edges, shifted by their rows' maxima, natively:
    ``y[e] = LeakyReLU(src[col[e]] + dst[r])`` minus ``max`` of row ``r``'s ``y`` (per column), a new
    ``[E (+ num_rows), ...]`` tensor (with ``loops`` row ``E + r`` is ``r``'s self loop, whose source
    row is ``src[own_offset + r]``). ``exp_()`` and then ``edge_softmax_step(..., "normalize")``
    make the attention coefficients; nothing else is allocated. The same values as the unfused
    gathers, add, ``leaky_relu`` and ``edge_softmax_step(..., "shift")``."""
    src, dst = _scores(csr, src, dst, "attention_scores", loops, own_offset)
    return _load_native().attention_scores(csr.indptr, _native_index(csr), src, dst, float(negative_slope),
                                           bool(loops), int(own_offset))


def attention_backward(csr: CSR, src: torch.Tensor, dst: torch.Tensor, alpha: torch.Tensor, grad: torch.Tensor,
                       negative_slope: float, *, loops: bool = False, own_offset: int = 0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of :func:`attention_scores` followed by the softmax, natively: from the
    coefficients ``alpha`` and their gradient ``grad`` (``[E (+ num_rows), ...]``), the scores'
    gradient ``(alpha grad - alpha rowsum(alpha grad)) * LeakyReLU'(src[col] + dst[r])`` (a new edge
    tensor; the pre-activations are recomputed, not saved) and its per-row sums (``dst``'s
    gradient). ``src``'s gradient is the scores' gradient summed into columns (:func:`scatter_sum`)."""
    src, dst = _scores(csr, src, dst, "attention_backward", loops, own_offset, on_cuda=True)
    if src.device.type == "cuda":
        rows = csr.nnz + (csr.num_rows if loops else 0)
        if alpha.shape != (rows,) + src.shape[1:] or grad.shape != alpha.shape or grad.dtype != src.dtype \
                or alpha.dtype != src.dtype or alpha.device != src.device or grad.device != src.device:
            raise KernelError(f"attention_backward: alpha and grad must be {src.dtype} {[rows, *src.shape[1:]]} on "
                              f"{src.device}, got {alpha.dtype} {list(alpha.shape)} on {alpha.device} and {grad.dtype} "
                              f"{list(grad.shape)} on {grad.device}")
        _import_cupy()
        with torch.cuda.device(src.device):
            return cuda.run_attention_backward(_device_csr(csr, src.device), src, dst, alpha, grad,
                                               float(negative_slope), bool(loops), int(own_offset), _raw_runner())
    alpha = _edge_rows(csr, alpha, "attention_backward", loops)
    grad = _edge_rows(csr, grad, "attention_backward", loops)
    if grad.shape != alpha.shape or alpha.shape[1:] != dst.shape[1:] or grad.dtype != src.dtype or alpha.dtype != src.dtype:
        raise KernelError(f"attention_backward: alpha and grad must have the scores' dtype and row shape, got "
                          f"{alpha.dtype} {list(alpha.shape)} and {grad.dtype} {list(grad.shape)}")
    out, g_dst = _load_native().attention_backward(csr.indptr, _native_index(csr), src, dst, alpha, grad,
                                                   float(negative_slope), bool(loops), int(own_offset))
    return out, g_dst


# --------------------------------------------------------------------------- torch backend
def _torch_csr(csr: CSR, values: Optional[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if values is None:
        values = csr.cached(f"torch:ones:{dtype}:{device}", lambda: torch.ones(csr.nnz, dtype=dtype, device=device))
    indptr, indices = csr.matched(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        return torch.sparse_csr_tensor(indptr, indices, values, size=(csr.num_rows, csr.num_cols),
                                       device=device, check_invariants=False)


def _memo_for(cache: dict, key: str, tensors: tuple[Optional[torch.Tensor], ...], build: Callable[[], Any]) -> Any:
    """``build()`` of ``tensors``, kept in ``cache`` while they are the same objects, unchanged (their
    versions), as when it was built; the entry leaves ``cache`` when one of them is freed."""
    key = f"{key}:" + ":".join(str(id(t)) for t in tensors)
    stamp = tuple(None if t is None else t._version for t in tensors)
    hit = cache.get(key)
    if hit is not None and hit[0] == stamp and all(r is None or r() is t for r, t in zip(hit[1], tensors)):
        return hit[2]
    value = build()
    refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
    if hit is None:
        for t in tensors:
            if t is not None:
                weakref.finalize(t, cache.pop, key, None)
    cache[key] = (stamp, refs, value)
    return value


def _scale_products(csr: CSR, row_scale: Optional[torch.Tensor], col_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """``row_scale[r] * col_scale[col[e]]`` for every edge ``e`` of row ``r`` (a missing scale is 1), ``[E]``."""
    like = row_scale if row_scale is not None else col_scale
    indptr, indices = csr.on(like.device)
    if row_scale is None:
        return col_scale.index_select(0, indices)
    f = torch.repeat_interleave(row_scale, indptr[1:] - indptr[:-1], output_size=csr.nnz)
    return f.mul_(col_scale.index_select(0, indices)) if col_scale is not None else f


def _edge_factors(csr: CSR, row_scale: Optional[torch.Tensor], col_scale: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`_scale_products`, cached on ``csr`` per pair of scale tensors (a graph's normalization
    scales are fixed: one edge tensor per normalization and direction,
    ``cost_models.model.static_memory`` counts it off the CPU)."""
    like = row_scale if row_scale is not None else col_scale
    return _memo_for(csr.cache, f"edge_factors:{like.device}:{like.dtype}", (row_scale, col_scale),
                     lambda: _scale_products(csr, row_scale, col_scale))


def _loop_positions(csr: CSR, loop_at: tuple[int, int], n: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(indptr, edge_pos, loop_pos)`` of ``csr`` with ``n`` self-loop entries inserted at
    ``(r0 + i, c0 + i)``: the new offsets (int64) and the new positions of the edges and of the
    loops. A loop takes the slot after as many of its row's edges as have smaller columns (its
    column-ordered place when the row is sorted); the edges keep their order around it."""
    indptr, indices = csr.on(device)
    r0, c0 = loop_at
    deg = indptr[1:] - indptr[:-1]
    rows = torch.arange(csr.num_rows + 1, device=device)
    before = (rows - r0).clamp_(0, n)  # loops in the rows above each row
    row = torch.repeat_interleave(rows[:-1], deg, output_size=csr.nnz)
    i = row - r0
    looped_edge = (i >= 0) & (i < n)
    slot = torch.zeros(csr.num_rows, dtype=torch.int64, device=device).index_add_(
        0, row, (looped_edge & (indices < i + c0)).long())  # each loop's place among its row's edges
    edge = torch.arange(csr.nnz, device=device)
    after = looped_edge & (edge - indptr[row] >= slot[row])  # the edge comes after its row's loop
    edge_pos = edge.add_(before[row]).add_(after.long())
    new_indptr = indptr + before
    looped = torch.arange(r0, r0 + n, device=device)
    return new_indptr, edge_pos, new_indptr[looped] + slot[looped]


def _looped_csr(csr: CSR, loop_at: tuple[int, int], n: int, device: torch.device) -> CSR:
    """``csr`` with ``n`` self-loop entries at ``(r0 + i, c0 + i)`` (:func:`_loop_positions`), cached
    on ``csr`` per placement and device: a handle of one index dtype (int32 offsets beside int32
    indices where they fit), for the backends that read :meth:`CSR.matched`."""
    def build() -> CSR:
        new_indptr, edge_pos, loop_pos = _loop_positions(csr, loop_at, n, device)
        _, indices = csr.on(device)
        idx = torch.empty(csr.nnz + n, dtype=indices.dtype, device=device)
        idx[edge_pos] = indices
        idx[loop_pos] = torch.arange(loop_at[1], loop_at[1] + n, dtype=indices.dtype, device=device)
        if idx.dtype == torch.int32 and csr.nnz + n <= _INT32_MAX:
            new_indptr = new_indptr.to(torch.int32)
        else:
            idx = idx.to(torch.int64)
        return CSR(new_indptr, idx, csr.num_rows, csr.num_cols)
    return csr.cached(f"looped:{device}:{loop_at[0]}:{loop_at[1]}:{n}", build)


def _loop_folded_values(csr: CSR, values: Optional[torch.Tensor], row_scale: Optional[torch.Tensor],
                        col_scale: Optional[torch.Tensor], loop: torch.Tensor, loop_at: tuple[int, int]) -> torch.Tensor:
    """The entries of :func:`_looped_csr`: every edge's ``values[e] * row_scale[r] * col_scale[col[e]]``
    and every loop's factor, ``[E + n]``; cached on ``csr`` per tensors (fixed ones: a graph's
    normalization and self-loop terms), like :func:`_edge_factors`."""
    n = loop.shape[0]

    def build() -> torch.Tensor:
        _, edge_pos, loop_pos = _loop_positions(csr, loop_at, n, loop.device)
        ev = None if values is None else values.reshape(-1)
        if row_scale is not None or col_scale is not None:
            f = _scale_products(csr, row_scale, col_scale)
            ev = f if ev is None else f.mul_(ev)
        out = torch.empty(csr.nnz + n, dtype=loop.dtype, device=loop.device)
        out[edge_pos] = 1 if ev is None else ev
        out[loop_pos] = loop.reshape(-1)
        return out

    return _memo_for(csr.cache, f"looped_values:{loop.device}:{loop_at[0]}:{loop_at[1]}",
                     (values, row_scale, col_scale, loop), build)


def _foldable_loops(values: Optional[torch.Tensor], loop: Optional[torch.Tensor]) -> bool:
    """Whether a product's self loops join its matrix (:func:`_looped_csr`): fixed terms (no
    gradient flows to them: a graph's normalization, GCN's and GIN's loops) of a single-head
    product, one factor per loop."""
    return (loop is not None and not loop.requires_grad and loop.numel() == loop.shape[0]
            and (values is None or not values.requires_grad and values.numel() == values.shape[0]))


#: bytes of the temporary in which :func:`_add_scaled_rows` computes a block of its products: small
#: on a CPU; on a GPU each block costs two kernel launches
_ROW_BLOCK_BYTES = {"cpu": 1 << 20, "cuda": 64 << 20}


def _add_scaled_rows(out: torch.Tensor, factors: torch.Tensor, x: torch.Tensor) -> None:
    """``out += factors * x`` per row (``factors``: ``[N]`` or ``[N, H]``), a block of rows at a time:
    the same product, then sum, bit for bit, with a temporary of one block instead of ``out``'s size."""
    rows = out.shape[0]
    row_bytes = max(1, out[:1].numel() * out.element_size())
    step = max(1, _ROW_BLOCK_BYTES.get(out.device.type, 1 << 20) // row_bytes)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        f = factors[a:b]
        f = f.reshape(f.shape + (1,) * (x.dim() - f.dim()))
        out[a:b].add_(f * x[a:b])  # (not ``out[a:b] +=``: that also copies the block onto itself)


def _add_loop_terms(out: torch.Tensor, loop: torch.Tensor, x: torch.Tensor, loop_at: tuple[int, int],
                    transpose: bool) -> None:
    """A product's self-loop terms added into its output ``out`` (in place): ``loop[i] * x[c0 + i]``
    into ``out[r0 + i]``, transposed ``loop[i] * x[r0 + i]`` into ``out[c0 + i]`` (``(r0, c0) = loop_at``)."""
    r0, c0 = loop_at
    n = loop.shape[0]
    src, dst = (r0, c0) if transpose else (c0, r0)
    _add_scaled_rows(out[dst: dst + n], loop, x[src: src + n])


def _folded(fn: Callable[[CSR, Optional[torch.Tensor], torch.Tensor, bool], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A backend's SpMM (one that takes no scales) with the per-vertex scales folded into the edge
    values: ``values[e] * row_scale[r] * col_scale[col[e]]``, an edge tensor (without edge values,
    the cached :func:`_edge_factors` themselves), instead of scaling ``x`` before the product and
    the result after (two passes over vertex tensors and a temporary of ``x``'s size). The same
    values transposed give the transposed product. Fixed self-loop terms (:func:`_foldable_loops`)
    join the matrix, ``A + L`` with its entries folded the same way (:func:`_looped_csr`, one
    product instead of a product and two passes over vertex tensors); others are added after the
    product."""
    def spmm_scaled(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor,
                    row_scale: Optional[torch.Tensor] = None, col_scale: Optional[torch.Tensor] = None,
                    transpose: bool = False, loop: Optional[torch.Tensor] = None,
                    loop_at: tuple[int, int] = (0, 0)) -> torch.Tensor:
        if _foldable_loops(values, loop):
            folded = _loop_folded_values(csr, values, row_scale, col_scale, loop, loop_at)
            return fn(_looped_csr(csr, loop_at, loop.shape[0], x.device), folded, x, transpose)
        if row_scale is not None or col_scale is not None:
            f = _edge_factors(csr, row_scale, col_scale)
            values = f if values is None else values * f.reshape((-1,) + (1,) * (values.dim() - 1))
        out = fn(csr, values, x, transpose)
        if loop is not None:
            _add_loop_terms(out, loop, x, loop_at, transpose)
        return out
    return spmm_scaled


def _spmm_torch(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    x2, heads, tail = _split_heads(values, x)
    rows = csr.num_cols if transpose else csr.num_rows
    if heads == 1:
        a = _torch_csr(csr, None if values is None else values.reshape(-1), x.dtype, x.device)
        return _shaped(torch.sparse.mm(a.t() if transpose else a, x2), rows, tail)  # transposed: a CSC view
    # every head in one product, over the head-interleaved structure (x2 [N, H*C] viewed [N*H, C])
    inter, perm = _interleaved(csr, heads, x.device)
    a = _torch_csr(inter, values.reshape(-1).index_select(0, perm), x.dtype, x.device)
    xi = x2.view(x2.shape[0] * heads, x2.shape[1] // heads)
    return _shaped(torch.sparse.mm(a.t() if transpose else a, xi), rows, tail)


def _interleaved(csr: CSR, heads: int, device: torch.device) -> tuple[CSR, torch.Tensor]:
    """``csr``'s ``heads``-head product as one matrix, and where its entries come from.

    The matrix is ``[rows * H, cols * H]`` with an entry ``(r*H + h, c*H + h)`` for each edge
    ``(r, c)`` and head ``h`` (row ``r*H + h`` holds row ``r``'s edges in their order): with ``x``
    ``[cols, H, C]`` viewed as ``[cols * H, C]``, its product is the multi-head product viewed as
    ``[rows * H, C]``. ``perm`` (``[E * H]``) maps the matrix's entries, in order, to positions in a
    flattened ``[E, H]`` edge tensor. Index arrays int32 where they fit; built on ``device`` once
    per ``heads`` and cached on ``csr``."""
    def build() -> tuple[CSR, torch.Tensor]:
        indptr, indices = csr.on(device)
        indptr = indptr.long()
        deg = indptr[1:] - indptr[:-1]
        n = csr.nnz * heads
        idt = torch.int64 if max(n, csr.num_rows * heads, csr.num_cols * heads) > _INT32_MAX else torch.int32
        offsets = torch.zeros(csr.num_rows * heads + 1, dtype=torch.int64, device=device)
        torch.cumsum(deg.repeat_interleave(heads), 0, out=offsets[1:])
        # edge e of row r (first edge s, degree d) goes, for head h, to entry H*s + h*d + (e - s):
        # filled a head at a time (temporaries of E entries, not E * H)
        edge = torch.arange(csr.nnz, device=device)
        base = torch.repeat_interleave(indptr[:-1], deg, output_size=csr.nnz).mul_(heads - 1).add_(edge)
        degree = torch.repeat_interleave(deg, deg, output_size=csr.nnz)
        col0, edge0 = indices.long() * heads, edge.mul_(heads)
        cols = torch.empty(n, dtype=idt, device=device)
        perm = torch.empty(n, dtype=idt, device=device)
        for h in range(heads):
            at = base + degree * h
            cols[at] = (col0 + h).to(idt)
            perm[at] = (edge0 + h).to(idt)
        return CSR(offsets.to(idt), cols, csr.num_rows * heads, csr.num_cols * heads), perm
    return csr.cached(f"interleaved:{heads}:{device}", build)


#: entries per ``sampled_addmm`` call of :func:`_sddmm_sampled` (its temporaries, about 24 bytes per
#: entry, stay under ~100 MB whatever the graph)
_SAMPLED_BLOCK = 1 << 22


def _sddmm_sampled(csr: CSR, a: torch.Tensor, b: torch.Tensor, heads: int) -> torch.Tensor:
    """SDDMM by ``torch.sparse.sampled_addmm`` (cuSPARSE's SDDMM on CUDA) over ``csr``, or for
    several heads over its head-interleaved structure (:func:`_interleaved`): each entry reads its
    two rows, without per-edge copies of them. In row blocks of at most :data:`_SAMPLED_BLOCK`
    entries (each call's index and value temporaries bounded; the blocks' bounds are found once
    per structure). ``[E, heads]``."""
    width = math.prod(a.shape[1:]) // heads
    dev = a.device
    out = torch.empty(csr.nnz, heads, dtype=a.dtype, device=dev)
    if csr.nnz == 0 or width == 0:
        return out.zero_()
    structure, perm = (csr, None) if heads == 1 else _interleaved(csr, heads, dev)
    blocks = _row_blocks(structure, _SAMPLED_BLOCK)
    if any(e1 - e0 > (r1 - r0) * structure.num_cols for r0, r1, e0, e1 in blocks):
        # more entries than a dense block has (repeated columns): torch's sampled_addmm then fails
        return _sddmm_gather(csr, a, b, heads)
    indptr, indices = structure.matched(dev)
    a2 = a.detach().reshape(structure.num_rows, width).contiguous()   # cuSPARSE: row-major operands
    b2t = b.detach().reshape(structure.num_cols, width).contiguous().t()
    flat = out.view(-1)
    zero = a.new_zeros(())  # the pattern's values are ignored (beta=0): one zero, expanded
    for r0, r1, e0, e1 in blocks:
        crow = indptr[r0:r1 + 1] if e0 == 0 else indptr[r0:r1 + 1] - e0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
            pattern = torch.sparse_csr_tensor(crow, indices[e0:e1], zero.expand(e1 - e0),
                                              size=(r1 - r0, structure.num_cols), device=dev, check_invariants=False)
            w = torch.sparse.sampled_addmm(pattern, a2[r0:r1], b2t, beta=0.0).values()
        if perm is None:
            flat[e0:e1] = w
        else:
            flat.index_put_((perm[e0:e1],), w)
    return out


def _row_blocks(csr: CSR, entries: int) -> list[tuple[int, int, int, int]]:
    """``(first row, end row, first entry, end entry)`` of consecutive row blocks of ``csr`` with at
    most ``entries`` entries each (a longer row alone); one block, read from no array, when the
    whole structure fits. Cached on ``csr``."""
    if csr.nnz <= entries:
        return [(0, csr.num_rows, 0, csr.nnz)]

    def build() -> list[tuple[int, int, int, int]]:
        ip = csr.indptr.cpu().long()
        out, r0 = [], 0
        while r0 < csr.num_rows:
            e0 = int(ip[r0])
            r1 = int(torch.searchsorted(ip, e0 + entries, right=True)) - 1
            r1 = min(csr.num_rows, max(r1, r0 + 1))
            out.append((r0, r1, e0, int(ip[r1])))
            r0 = r1
        return out
    return csr.cached(f"row-blocks:{entries}", build)


def _sddmm_torch(csr: CSR, a: torch.Tensor, b: torch.Tensor, heads: int) -> torch.Tensor:
    """The ``torch`` backend's SDDMM: :func:`_sddmm_sampled` on the CPU (float32, float64; other
    dtypes and devices gather); on CUDA, where cuSPARSE's SDDMM has not been measured against
    gathering, the faster correct one of the two (:func:`cuda.choose`, once per structure,
    device, dtype and shape, recorded in :func:`cuda.choices`)."""
    if a.device.type == "cuda" and csr.nnz and a.numel():
        with torch.cuda.device(a.device):   # (the timer's events on a's device)
            return _sddmm_measured(csr, a, b, heads, cuda.cuda_timer)
    if a.device.type != "cpu" or a.dtype not in (torch.float32, torch.float64):
        return _sddmm_gather(csr, a, b, heads)   # (torch's CPU sampled_addmm: float32 and float64 only)
    return _sddmm_sampled(csr, a, b, heads)


def _sddmm_measured(csr: CSR, a: torch.Tensor, b: torch.Tensor, heads: int,
                    timer: Callable[[Callable[[], Any]], float]) -> torch.Tensor:
    """SDDMM by the faster correct one of :func:`_sddmm_sampled` and :func:`_sddmm_gather` (the
    reference), chosen once per structure, device, dtype and shape; ``timer`` times a call."""
    width = math.prod(a.shape[1:])

    def decide() -> bool:
        return cuda.choose("sddmm", f"{_shape_label(csr, width, heads)}, {str(a.dtype).removeprefix('torch.')}", {
            "gather": lambda: _sddmm_gather(csr, a, b, heads),
            "sampled_addmm": lambda: _sddmm_sampled(csr, a, b, heads)}, "gather", timer) == "sampled_addmm"

    sampled = csr.cached(f"choice:sddmm-torch:{a.device}:{a.dtype}:{width}:{heads}", decide)
    return (_sddmm_sampled if sampled else _sddmm_gather)(csr, a, b, heads)


def _sddmm_gather(csr: CSR, a: torch.Tensor, b: torch.Tensor, heads: int) -> torch.Tensor:
    """Reference SDDMM by gathering both endpoints, in edge blocks to bound memory (any device).
    Each edge's row is computed per call (an edge tensor of the indices' dtype, not kept)."""
    width = math.prod(a.shape[1:]) // heads
    a3 = a.reshape(a.shape[0], heads, width)
    b3 = b.reshape(b.shape[0], heads, width)
    dev = a.device
    indptr, indices = csr.on(dev)
    rows = torch.repeat_interleave(torch.arange(csr.num_rows, device=dev, dtype=indices.dtype),
                                   indptr[1:] - indptr[:-1], output_size=csr.nnz)
    out = torch.empty(csr.nnz, heads, dtype=a.dtype, device=dev)
    block = max(1, (1 << 24) // max(1, a3.shape[1] * a3.shape[2]))
    for s in range(0, csr.nnz, block):
        e = slice(s, min(csr.nnz, s + block))
        out[e] = (a3[rows[e]] * b3[indices[e]]).sum(-1)
    return out


# --------------------------------------------------------------------------- scipy backend
def _spmm_scipy(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    import numpy as np
    import scipy.sparse as sp

    _require_cpu("scipy", x, csr.indptr)
    x2, heads, tail = _split_heads(values, x)
    ip_t, ix_t = csr.matched(torch.device("cpu"))
    ip, ix = ip_t.numpy(), ix_t.numpy()
    xn = x2.detach().numpy()

    def mat(v: Optional[torch.Tensor]):
        data = np.ones(csr.nnz, dtype=xn.dtype) if v is None else v.detach().contiguous().numpy()
        m = sp.csr_matrix((data, ix, ip), shape=(csr.num_rows, csr.num_cols))
        return m.T if transpose else m  # transposed: a CSC view (scipy's product scatters; no copy)

    if heads == 1:
        out = mat(None if values is None else values.reshape(-1)) @ xn
    else:
        c = xn.shape[1] // heads
        out = np.concatenate([mat(values[:, h]) @ xn[:, h * c:(h + 1) * c] for h in range(heads)], axis=1)
    rows = csr.num_cols if transpose else csr.num_rows
    return _shaped(torch.from_numpy(np.ascontiguousarray(out, dtype=xn.dtype)), rows, tail)


# --------------------------------------------------------------------------- cupy backend
# cudaDataType_t values (CUDA's library_types.h) of the value types the kernels take.
_CUDA_DATA_TYPE = {torch.float32: 0, torch.float64: 1}  # CUDA_R_32F, CUDA_R_64F
_INT32_MAX = 2**31 - 1
# cusparseSpMMAlg_t's CUSPARSE_SPMM_CSR_ALG2 (cusparse.h, CUDA 11 to 13): the CSR algorithm cuSPARSE's
# SpMM documentation names as the one intended for row-major dense operands, which ours are. CuPy's
# bindings export only the pre-CUDA-11 names of this enum (CUSPARSE_MM_ALG_DEFAULT,
# CUSPARSE_CSRMM_ALG1), so the value is spelled here.
_SPMM_CSR_ALG2 = 6
_SPMM_ALG_DEFAULT = 0  # CUSPARSE_SPMM_ALG_DEFAULT


def _import_cupy() -> tuple[Any, Any]:
    """``(cupy, cuSPARSE bindings)``, or a :class:`KernelError` saying how to install them."""
    try:
        import cupy
        from cupy_backends.cuda.libs import cusparse
    except ImportError as exc:
        raise KernelError("cupy backend: CuPy is not installed; install the CuPy build matching your CUDA "
                          "(pip install 'gnncompile[gpu-cuda12]' or 'gnncompile[gpu-cuda13]')") from exc
    return cupy, cusparse


class _CusparseCSR:
    """A cuSPARSE CSR descriptor over one :class:`CSR` on one CUDA device, for one value dtype.

    Built once (the structure's index arrays are copied to the device, as int32 when every index
    fits, and the descriptor points at them); a product sets only the edge-value pointer, for its
    duration. Between products the descriptor points at ``ones``, the values of products without
    edge values. One descriptor serves every call in order, so calls must not overlap in threads.
    """

    def __init__(self, cusparse: Any, csr: CSR, device: torch.device, dtype: torch.dtype) -> None:
        self._cusparse = cusparse
        self.desc = 0
        small = max(csr.nnz, csr.num_cols) <= _INT32_MAX
        index_dtype = torch.int32 if small else torch.int64
        index_type = cusparse.CUSPARSE_INDEX_32I if small else cusparse.CUSPARSE_INDEX_64I
        indptr, indices = csr.on(device)
        self.indptr = _aligned(indptr.to(index_dtype))
        self.indices = _aligned(indices.to(index_dtype))
        self.ones = torch.ones(csr.nnz, dtype=dtype, device=device)
        self.desc = cusparse.createCsr(
            csr.num_rows, csr.num_cols, csr.nnz, self.indptr.data_ptr(), self.indices.data_ptr(),
            self.ones.data_ptr(), index_type, index_type, cusparse.CUSPARSE_INDEX_BASE_ZERO,
            _CUDA_DATA_TYPE[dtype])

    def __del__(self) -> None:
        desc, self.desc = getattr(self, "desc", 0), 0
        if desc:
            try:
                self._cusparse.destroySpMat(desc)
            except Exception:  # interpreter shutdown: the CUDA context may already be gone
                pass


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) itself when its data is 16-byte aligned, else an aligned copy.

    cuSPARSE documents alignment to the element size (``cusparseCreateDnMat``), which every torch
    tensor has; its kernels may also read wider words, so operands keep the 16-byte alignment of
    torch's own allocations, and a view at an odd offset (rows of a larger tensor) is copied.
    """
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _cusparse_spmm(cusparse: Any, handle: int, mat: _CusparseCSR, values: torch.Tensor, b: torch.Tensor,
                   c: torch.Tensor, transpose: bool = False) -> None:
    """``c = op(A_values) @ b`` with row-major ``b`` ``[K, n]`` and ``c`` ``[M, n]`` (contiguous,
    aligned); ``transpose``: ``op(A) = A^T`` read from the same CSR (cuSPARSE chooses the algorithm;
    it accumulates with atomics, so results may differ between runs in the last bits)."""
    dt = _CUDA_DATA_TYPE[b.dtype]
    np_dtype = np.float32 if b.dtype == torch.float32 else np.float64
    # host scalars: the handle's pointer mode is cuSPARSE's default, CUSPARSE_POINTER_MODE_HOST (CuPy never
    # changes it), and cuSPARSE reads host scalars before the call returns
    alpha, beta = np.ones((), dtype=np_dtype), np.zeros((), dtype=np_dtype)
    op = cusparse.CUSPARSE_OPERATION_NON_TRANSPOSE
    op_a = cusparse.CUSPARSE_OPERATION_TRANSPOSE if transpose else op
    # CSR_ALG2 serves op(A) = A only; the transposed product takes cuSPARSE's default algorithm
    alg = _SPMM_ALG_DEFAULT if transpose else _SPMM_CSR_ALG2
    cusparse.spMatSetValues(mat.desc, values.data_ptr())
    k, n = b.shape
    desc_b = cusparse.createDnMat(k, n, n, b.data_ptr(), dt, cusparse.CUSPARSE_ORDER_ROW)
    try:
        desc_c = cusparse.createDnMat(c.shape[0], n, n, c.data_ptr(), dt, cusparse.CUSPARSE_ORDER_ROW)
        try:
            size = cusparse.spMM_bufferSize(handle, op_a, op, alpha.ctypes.data, mat.desc, desc_b,
                                            beta.ctypes.data, desc_c, dt, alg)
            # the workspace comes from torch's allocator on the same stream: reused only after this product
            work = torch.empty(max(int(size), 1), dtype=torch.uint8, device=c.device)
            cusparse.spMM(handle, op_a, op, alpha.ctypes.data, mat.desc, desc_b, beta.ctypes.data, desc_c, dt, alg,
                          work.data_ptr())
        finally:
            cusparse.destroyDnMat(desc_c)
    finally:
        cusparse.destroyDnMat(desc_b)
        cusparse.spMatSetValues(mat.desc, mat.ones.data_ptr())


def _spmm_cupy(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    if x.device.type != "cuda":
        raise KernelError(f"cupy backend: tensors must be on a CUDA device, got {x.device}")
    if x.dtype not in _CUDA_DATA_TYPE:
        raise KernelError(f"cupy backend: supports float32 and float64, got {x.dtype}")
    cupy, cusparse = _import_cupy()
    dev = x.device
    # Kernels take raw device pointers: nothing is exported, so tensors that require grad need no
    # detach, and no copy is made; outputs are torch allocations (zero-filled: rows without edges).
    x2, heads, tail = _split_heads(values, x.detach())
    width = x2.shape[1]
    rows = csr.num_cols if transpose else csr.num_rows
    out = torch.zeros((rows, width), dtype=x.dtype, device=dev)
    if csr.nnz == 0 or rows == 0 or width == 0:
        return _shaped(out, rows, tail)
    mat = csr.cached(f"cusparse:{dev}:{x.dtype}", lambda: _CusparseCSR(cusparse, csr, dev, x.dtype))
    vals = None if values is None else values.detach()
    stream = torch.cuda.current_stream(dev)
    with cupy.cuda.Device(dev.index), cupy.cuda.ExternalStream(stream.cuda_stream, dev.index):
        # CuPy's spMM binds its shared handle to CuPy's current stream (torch's, entered above) before
        # launching; binding it here too keeps the product on torch's stream whatever the CuPy version
        handle = cupy.cuda.device.get_cusparse_handle()
        cusparse.setStream(handle, stream.cuda_stream)
        if heads == 1:
            v = mat.ones if vals is None else _aligned(vals.reshape(-1))
            _cusparse_spmm(cusparse, handle, mat, v, _aligned(x2), out, transpose)
        else:
            c = width // heads
            for h in range(heads):
                # one product per head: its weights and its column block of x, copied contiguous
                out_h = torch.zeros((rows, c), dtype=x.dtype, device=dev)
                _cusparse_spmm(cusparse, handle, mat, _aligned(vals[:, h]), _aligned(x2[:, h * c:(h + 1) * c]),
                               out_h, transpose)
                out[:, h * c:(h + 1) * c] = out_h
    return _shaped(out, rows, tail)


# --------------------------------------------------------------------------- cupy backend: own kernels
_cupy_runner: Optional[cuda.CupyRunner] = None


def _raw_runner() -> cuda.CupyRunner:
    global _cupy_runner
    if _cupy_runner is None:
        _cupy_runner = cuda.CupyRunner()
    return _cupy_runner


def _device_csr(csr: CSR, device: torch.device) -> cuda.DeviceCSR:
    return csr.cached(f"raw:{device}", lambda: cuda.DeviceCSR.build(*csr.on(device), csr.num_rows, csr.num_cols))


def _shape_label(csr: CSR, width: int, heads: int) -> str:
    return f"{csr.num_rows}x{csr.num_cols}, {csr.nnz} edges, width {width}" + (f", {heads} heads" if heads > 1 else "")


def _spmm_chosen(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor, row_scale: Optional[torch.Tensor],
                 col_scale: Optional[torch.Tensor], transpose: bool, *, baseline: Callable[..., torch.Tensor],
                 run: cuda.Runner, timer: Callable[[Callable[[], Any]], float]) -> torch.Tensor:
    """A float32 product by the fastest correct one of ``baseline`` (a backend's scaled SpMM) and
    the configs of the own kernels (:func:`cuda.spmm_configs`), chosen once per structure, device
    and shape (:func:`cuda.choose`, cached on ``csr``); ``run`` executes launches, ``timer`` times."""
    x2, heads, tail = _split_heads(values, x.detach())
    vals = None if values is None else values.detach().reshape(csr.nnz, heads) if heads > 1 else values.detach().reshape(-1)
    dcsr = _device_csr(csr, x.device)
    width = x2.shape[1]
    rows = csr.num_cols if transpose else csr.num_rows

    def own(cfg: cuda.KernelConfig) -> torch.Tensor:
        xa = _aligned(x2) if cfg.vec > 1 else x2   # (float2 and float4 loads: 8- and 16-byte aligned rows)
        return cuda.run_spmm(dcsr, vals, xa, row_scale, col_scale, transpose, cfg, run)

    def decide() -> Optional[cuda.KernelConfig]:
        configs = {str(c): c for c in cuda.spmm_configs(width, width // heads, x2.data_ptr() % 16 == 0,
                                                        dcsr.max_degree, csr.nnz / max(1, csr.num_rows))}
        candidates: dict[str, Callable[[], torch.Tensor]] = {
            "cuSPARSE": lambda: _as_rows(baseline(csr, values, x, row_scale, col_scale, transpose))}
        candidates.update({name: functools.partial(own, c) for name, c in configs.items()})
        chosen = cuda.choose("spmm^T" if transpose else "spmm", _shape_label(csr, width, heads), candidates,
                             "cuSPARSE", timer)
        return configs.get(chosen)

    key = (f"choice:spmm:{x.device}:{int(transpose)}:{width}:{heads}:{values is None}:{row_scale is None}:"
           f"{col_scale is None}")
    cfg = csr.cached(key, decide)
    if cfg is None:
        return baseline(csr, values, x, row_scale, col_scale, transpose)
    return _shaped(own(cfg), rows, tail)


def _sddmm_chosen(csr: CSR, a: torch.Tensor, b: torch.Tensor, heads: int, *, baseline: Callable[..., torch.Tensor],
                  run: cuda.Runner, timer: Callable[[Callable[[], Any]], float]) -> torch.Tensor:
    """A float32 SDDMM by the fastest correct one of ``baseline`` and the own kernels' configs
    (chosen once per structure, device and shape, as :func:`_spmm_chosen`)."""
    a2, b2 = _as_rows(a.detach()).contiguous(), _as_rows(b.detach()).contiguous()
    dcsr = _device_csr(csr, a.device)
    width = a2.shape[1]

    def own(cfg: cuda.KernelConfig) -> torch.Tensor:
        if cfg.vec > 1:   # (float2 and float4 loads: 8- and 16-byte aligned rows)
            return cuda.run_sddmm(dcsr, _aligned(a2), _aligned(b2), heads, cfg, run)
        return cuda.run_sddmm(dcsr, a2, b2, heads, cfg, run)

    def decide() -> Optional[cuda.KernelConfig]:
        aligned = a2.data_ptr() % 16 == 0 and b2.data_ptr() % 16 == 0
        configs = {str(c): c for c in cuda.sddmm_configs(width, width // heads, aligned, dcsr.max_degree,
                                                         csr.nnz / max(1, csr.num_rows))}
        candidates: dict[str, Callable[[], torch.Tensor]] = {"gather": lambda: baseline(csr, a, b, heads)}
        candidates.update({name: functools.partial(own, c) for name, c in configs.items()})
        return configs.get(cuda.choose("sddmm", _shape_label(csr, width, heads), candidates, "gather", timer))

    cfg = csr.cached(f"choice:sddmm:{a.device}:{width}:{heads}", decide)
    return baseline(csr, a, b, heads) if cfg is None else own(cfg)


def _spmm_cupy_backend(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor,
                       row_scale: Optional[torch.Tensor] = None, col_scale: Optional[torch.Tensor] = None,
                       transpose: bool = False, loop: Optional[torch.Tensor] = None,
                       loop_at: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """The ``cupy`` backend's SpMM: float32 by the fastest correct of cuSPARSE and the own
    kernels (per shape), float64 by cuSPARSE; self-loop terms added after the product."""
    baseline = _folded(_spmm_cupy)
    if x.dtype != torch.float32 or x.device.type != "cuda" or csr.nnz == 0 or x.numel() == 0:
        out = baseline(csr, values, x, row_scale, col_scale, transpose)
    else:
        _import_cupy()
        with torch.cuda.device(x.device):  # the runner launches on the current device's current stream
            out = _spmm_chosen(csr, values, x, row_scale, col_scale, transpose, baseline=baseline,
                               run=_raw_runner(), timer=cuda.cuda_timer)
    if loop is not None:
        _add_loop_terms(out, loop, x, loop_at, transpose)
    return out


def _sddmm_cupy_backend(csr: CSR, a: torch.Tensor, b: torch.Tensor, heads: int) -> torch.Tensor:
    """The ``cupy`` backend's SDDMM: float32 by the fastest correct of the gathering reference and
    the own kernels (per shape), otherwise the reference."""
    if a.dtype != torch.float32 or a.device.type != "cuda" or csr.nnz == 0 or a.numel() == 0:
        return _sddmm_gather(csr, a, b, heads)
    _import_cupy()
    with torch.cuda.device(a.device):
        return _sddmm_chosen(csr, a, b, heads, baseline=_sddmm_gather, run=_raw_runner(), timer=cuda.cuda_timer)


# --------------------------------------------------------------------------- dispatch
BACKENDS: dict[str, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
    "native": (_spmm_native, _sddmm_native),  # applies the scales inside the product
    "torch": (_folded(_spmm_torch), _sddmm_torch),
    "scipy": (_folded(_spmm_scipy), _sddmm_gather),
    "cupy": (_spmm_cupy_backend, _sddmm_cupy_backend),
}
#: the backend :func:`set_default_backend` forces (``None``: none)
_default_override: Optional[str] = None
_warned_fallback = False


def _validate_name(name: str) -> str:
    if name not in BACKENDS:
        raise KernelError(f"unknown kernel backend {name!r}; valid: {', '.join(BACKENDS)}")
    return name


def set_default_backend(name: Optional[str]) -> None:
    """Force a backend for every call that does not name one (``None``: back to the environment
    variable ``GNNCOMPILE_BACKEND`` where it is set, else the choice by device)."""
    global _default_override
    _default_override = None if name is None else _validate_name(name)


def available_backends(device: str | torch.device = "cpu") -> list[str]:
    """The backends that can run on ``device`` in this environment."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return ["cupy", "torch"] if _cupy_importable() else ["torch"]
    names = ["torch", "scipy"]
    try:
        _load_native()
        names.insert(0, "native")
    except KernelError:
        pass
    return names


def _forced_backend() -> Optional[str]:
    """The backend :func:`set_default_backend` or ``GNNCOMPILE_BACKEND`` forces, if any."""
    return _default_override or os.environ.get("GNNCOMPILE_BACKEND") or None


def default_backend(device: str | torch.device = "cpu") -> str:
    """The backend used for tensors on ``device`` when a call names none: the one
    :func:`set_default_backend` forces, else ``GNNCOMPILE_BACKEND`` as it is now (read at each call:
    a rank forked from a server started before the variable was set sees it too), else by device."""
    global _warned_fallback
    forced = _forced_backend()
    if forced:
        return _validate_name(forced)
    dev = torch.device(device)
    if dev.type == "cuda":
        # torch's cuSPARSE call: the fastest backend measured on CUDA (benchmarks/RESULTS.md,
        # issue 17's table); ``cupy`` stays opt-in until it is measured faster on a GPU
        return "torch"
    try:
        _load_native()
        return "native"
    except KernelError as exc:
        if not _warned_fallback:
            warnings.warn(f"{exc}; using the 'torch' backend (slower SpMM)", RuntimeWarning, stacklevel=3)
            _warned_fallback = True
        return "torch"


def spmm(csr: CSR, values: Optional[torch.Tensor], x: torch.Tensor, backend: Optional[str] = None, *,
         row_scale: Optional[torch.Tensor] = None, col_scale: Optional[torch.Tensor] = None,
         transpose: bool = False, loop: Optional[torch.Tensor] = None,
         loop_at: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """``out[r] = row_scale[r] * sum_{e in row r} values[e] * col_scale[col[e]] * x[col[e]]``;
    ``values=None`` means all ones, a missing scale means 1.

    ``x`` is ``[num_cols, ...]``; with ``values`` of shape ``[E, H]`` (H > 1) ``x`` must be
    ``[num_cols, H, C]`` and head ``h`` is weighted by ``values[:, h]``. The scales are 1-d, of
    ``x``'s dtype and device. Returns ``[num_rows, ...]``. The ``native`` backend and the own CUDA
    kernels of ``cupy`` apply the scales inside the product; the others fold them into the edge
    values (an edge tensor; without edge values, one cached per graph and pair of scales).

    ``transpose=True`` computes the transposed product ``(diag(row_scale) A diag(col_scale))^T x``
    from the same structure, without a transposed copy: ``x`` is ``[num_rows, ...]`` and the result
    ``[num_cols, ...]``. ``native`` scatters into output parts owned by one thread each
    (deterministic, the summation order of a pull over the stably transposed CSR); ``scipy`` and
    ``torch`` multiply by a CSC view of the arrays (torch converts it per call on CPU); ``cupy``
    asks cuSPARSE for ``op(A) = A^T``. Not differentiable by itself: :mod:`gnncompile.ops` wraps it.

    ``loop`` (``[n]``, or ``[n, H]`` with ``x`` ``[N, H, C]``; x's dtype and device): self-loop
    factors, the matrix's entries at ``(r0 + i, c0 + i)`` (``loop_at = (r0, c0)``) beside its edges,
    not scaled by the scales: ``out[r0 + i] += loop[i] * x[c0 + i]`` (transposed:
    ``out[c0 + i] += loop[i] * x[r0 + i]``). ``native`` adds them as it stores each output row;
    ``torch`` and ``scipy`` multiply by ``A + L`` when the terms are fixed (no gradient: folded once,
    :func:`_looped_csr`), else, like ``cupy``, add them after the product.
    """
    _check(csr, values, x, row_scale, col_scale, transpose, loop, loop_at)
    name = _validate_name(backend) if backend else default_backend(x.device)
    if row_scale is None and col_scale is None and not transpose and loop is None:
        return BACKENDS[name][0](csr, values, x)
    return BACKENDS[name][0](csr, values, x, row_scale, col_scale, transpose, loop, loop_at)


def sddmm(csr: CSR, a: torch.Tensor, b: torch.Tensor, heads: int = 1, backend: Optional[str] = None) -> torch.Tensor:
    """``w[e, h] = <a[row(e), h], b[col(e), h]>``: returns ``[E, heads]``.

    ``a`` is ``[num_rows, ...]`` and ``b`` ``[num_cols, ...]`` with equal trailing size, divisible
    by ``heads``.
    """
    if a.shape[0] != csr.num_rows or b.shape[0] != csr.num_cols:
        raise KernelError(
            f"sddmm: a has {a.shape[0]} rows (need {csr.num_rows}), b has {b.shape[0]} (need {csr.num_cols})"
        )
    width_a, width_b = math.prod(a.shape[1:]), math.prod(b.shape[1:])
    if heads < 1 or width_a != width_b or width_a % heads:
        raise KernelError(
            f"sddmm: a and b need equal feature sizes divisible by heads={heads}; "
            f"got {list(a.shape)} and {list(b.shape)}"
        )
    if a.dtype != b.dtype:
        raise KernelError(f"sddmm: a dtype {a.dtype} differs from b dtype {b.dtype}")
    if a.device != b.device:
        raise KernelError(f"sddmm: a is on {a.device} but b is on {b.device}")
    name = _validate_name(backend) if backend else default_backend(a.device)
    return BACKENDS[name][1](csr, a, b, heads)
