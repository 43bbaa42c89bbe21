"""Graph primitives: the P and E operators every gnncompile layer is written with.

| op | kind | rows in -> out | computes |
|---|---|---|---|
| ``propagate(g, x, norm, edge_weight)`` | P | V -> V | ``out[v] = sum_{u->v} c_uv * x[u]`` |
| ``gather_src(g, x)`` | E | V -> E | ``out[e] = x[src(e)]`` |
| ``gather_dst(g, x)`` | E | V -> E | ``out[e] = x[dst(e)]`` |
| ``edge_softmax(g, e)`` | E | E -> E | softmax of ``e`` over the in-edges of each destination |
| ``edge_attention(g, s, t)`` | E | V -> E | ``edge_softmax(leaky_relu(s[src(e)] + t[dst(e)]))``, fused (GAT) |
| ``aggregate(g, msg, reduce)`` | E | E -> V | ``out[v] = reduce_{e into v} msg[e]`` |
| ``dst_rows(g, x)`` | E | V -> V | the destinations' own rows of a source-side ``x`` (a block's first rows) |

Each is a plain function usable eagerly on tensors, differentiable (hand-written backward for
``propagate`` and ``edge_softmax``; no dense adjacency is ever built) and a **torch.fx leaf**: when any argument is an fx ``Proxy`` the call is
recorded as one ``call_function`` node whatever way the user imported the function, so the tracer
sees exactly one node per primitive.

Edge tensors (``[E, ...]``) are aligned with the graph's edge order (in-edge CSR by destination).

Backward products
-----------------
The gradient of a propagation is the transposed product ``A^T g``. A graph's *backward product*
(:func:`set_backward_product`) says how it is computed: ``"transposed"`` (the default) pulls over
a transposed CSR built once and cached on the graph (the graph itself when it is symmetric);
``"push"`` scatters from the forward CSR (``kernels.spmm(..., transpose=True)``), so a directed
graph holds no transposed copy and no edge permutation, for a slower backward product. Both are
exact; on the ``native`` backend they give the same floating-point results.

Implicit self loops
-------------------
Every primitive takes ``add_self_loops``. When true it behaves as if each vertex ``v`` had one
extra edge ``v -> v`` of weight 1, without building a new graph: the edge space becomes
``E' = E + N`` rows, the self loop of ``v`` at row ``E + v``. This is the renormalization trick of
GCN (``A + I``) and GAT's self attention, as PyG's layers do by default, at the cost of one
vertex-wise term instead of a rebuilt CSR (the graph, its partitions and caches stay the same).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional, TypeVar

import torch
import torch.fx

from ..errors import GraphError, KernelError
from ..graph.core import _INT32_MAX, Graph
from .. import kernels
from ..kernels import CSR
from ..kernels.dropout import dropout_mask, keep_times

__all__ = [
    "propagate",
    "gather_src",
    "gather_dst",
    "edge_softmax",
    "edge_attention",
    "aggregate",
    "dst_rows",
    "SOURCE_ARGS",
    "call_arguments",
    "propagation_calls",
    "PRIMITIVES",
    "NORMS",
    "REDUCES",
    "is_primitive",
    "BACKWARD_PRODUCTS",
    "set_backward_product",
    "backward_product",
    "prepare_graph",
]

NORMS = ("gcn", "mean", "sum", "none")
#: how the backward of a propagation computes ``A^T g`` (see the module docstring)
BACKWARD_PRODUCTS = ("transposed", "push")
REDUCES = ("sum", "mean", "max")

F = TypeVar("F", bound=Callable[..., Any])
PRIMITIVES: dict[str, Callable[..., Any]] = {}


def _has_proxy(args: tuple, kwargs: dict) -> Optional[torch.fx.Proxy]:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.fx.Proxy):
            return a
    return None


#: torch's context that suspends the innermost torch function mode (private API; without it the
#: primitives simply run under :class:`plan_dropout_draws`, slower on the host)
_pop_function_mode = getattr(torch.overrides, "_pop_mode_temporarily", None)
_current_function_mode = getattr(torch.overrides, "_get_current_function_mode", lambda: None)


def fx_leaf(kind: str) -> Callable[[F], F]:
    """Register ``fn`` as a primitive of ``kind`` ("P" or "E") and make it an fx leaf."""

    def deco(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            proxy = _has_proxy(args, kwargs)
            if proxy is not None:
                return proxy.tracer.create_proxy("call_function", wrapper, args, kwargs)
            if _pop_function_mode is not None and plan_dropout_draws.innermost():
                with _pop_function_mode():  # (no dropout inside a primitive)
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)

        wrapper.__gnncompile_kind__ = kind  # type: ignore[attr-defined]
        PRIMITIVES[fn.__name__] = wrapper
        return wrapper  # type: ignore[return-value]

    return deco


#: Filled below: primitive -> the parameter it reads on the *source* side of edges (row ``u`` of
#: an edge ``u -> v``); every other vertex input of a primitive is read on the destination side.
SOURCE_ARGS: dict[Callable[..., Any], str] = {}


@functools.lru_cache(maxsize=512)
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


def call_arguments(node: torch.fx.Node) -> dict[str, Any]:
    """The arguments of a ``call_function`` node by parameter name, defaults applied."""
    bound = _signature(node.target).bind(*node.args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def propagation_calls(*graphs: torch.fx.Graph) -> Iterator[tuple[torch.fx.Node, dict[str, Any]]]:
    """Every ``propagate`` / ``masked_propagate`` node of ``graphs`` with its arguments."""
    for graph in graphs:
        for n in graph.nodes:
            if n.op == "call_function" and n.target in (propagate, masked_propagate):
                yield n, call_arguments(n)


def is_primitive(target: Any) -> bool:
    """Whether an fx node target is one of the graph primitives."""
    return getattr(target, "__gnncompile_kind__", None) is not None


# --------------------------------------------------------------------------- CSR handles
def _csr(g: Graph) -> CSR:
    return g.cached("csr", lambda: CSR(g.indptr, g.indices, g.num_nodes, g.num_src))


def _csr_t(g: Graph, with_perm: bool) -> tuple[CSR, Optional[torch.Tensor]]:
    """Transposed CSR (rows = sources) and, ``with_perm``, the permutation from transposed position
    to edge id (built only for products with edge values). A symmetric graph's transpose is its own
    handle: one structure serves forward and backward."""
    def build() -> CSR:
        indptr_t, indices_t = g.transpose_structure()
        if indptr_t is g.indptr and indices_t is g.indices:
            return _csr(g)
        return CSR(indptr_t, indices_t, g.num_src, g.num_nodes)
    return g.cached("csr_t", build), g.transpose()[2] if with_perm else None


def set_backward_product(g: Graph, mode: str) -> None:
    """Choose how propagations over ``g`` compute their backward product: ``"transposed"`` or
    ``"push"`` (see the module docstring). Choosing ``"push"`` drops a transposed structure already
    cached on ``g`` (unless it is ``g``'s own, symmetric one)."""
    if mode not in BACKWARD_PRODUCTS:
        raise KernelError(f"unknown backward product {mode!r}; valid: {', '.join(map(repr, BACKWARD_PRODUCTS))}")
    g.set_derived("backward_product", mode)
    if mode == "push":
        g.drop_derived("csr_t", "transpose", "transpose_structure")


def backward_product(g: Graph) -> str:
    """The backward product chosen for ``g`` (:func:`set_backward_product`; default ``"transposed"``)."""
    return g.cached("backward_product", lambda: "transposed")


def _pushes(g: Graph, values: bool) -> bool:
    """Whether a backward product over ``g`` (with edge ``values`` or not) scatters: chosen so,
    unless ``g`` is its own transpose and the product has no edge values (the forward structure
    then serves the pull at no cost; with edge values the pull would need an edge permutation)."""
    if backward_product(g) != "push":
        return False
    return values or not (g.num_src == g.num_nodes and g.is_symmetric())


def _check_graph(g: Any, op: str) -> Graph:
    if not isinstance(g, Graph):
        raise GraphError(f"{op}: expected a gnncompile.Graph as first argument, got {type(g).__name__}")
    return g


def _check_rows(t: torch.Tensor, n: int, op: str, what: str, space: str, g: Optional[Graph] = None) -> None:
    """``t`` is a tensor of ``n`` rows (and, given ``g``, on the graph's device)."""
    if not isinstance(t, torch.Tensor):
        raise KernelError(f"{op}: {what} must be a tensor, got {type(t).__name__}")
    if t.dim() == 0 or t.shape[0] != n:
        raise KernelError(f"{op}: {what} must have {n} rows (one per {space}), got shape {list(t.shape)}")
    if g is not None and t.device != g.device:
        raise KernelError(f"{op}: {what} is on {t.device} but the graph is on {g.device}; move the graph with "
                          f"graph.to({str(t.device)!r}) (it moves the structure, features and cached indices)")


# --------------------------------------------------------------------------- propagate (P)
def _scale_rows(t: torch.Tensor, s: Optional[torch.Tensor]) -> torch.Tensor:
    return t if s is None else t * s.reshape((-1,) + (1,) * (t.dim() - 1))


def _values_grad(g: Graph, values: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor, row: Optional[torch.Tensor],
                 col: Optional[torch.Tensor], backend: Optional[str]) -> torch.Tensor:
    """Gradient of ``row[v] * values[e] * col[u] * x[u]`` summed into ``out[v]`` w.r.t. ``values``."""
    heads = values.shape[1] if values.dim() == 2 else 1
    gv = kernels.sddmm(_csr(g), _scale_rows(grad_out, row), _scale_rows(x, col), heads, backend)
    return gv.reshape(values.shape)


class _SpMM(torch.autograd.Function):
    """``out = diag(row) A_c diag(col) x + loop * x_own`` with edge values ``c``, fixed per-vertex
    scales ``row`` / ``col`` (the normalization) and optional self-loop factors ``loop`` (times the
    destinations' own rows of ``x``, added into the output); gradients for ``x``, ``c`` and ``loop``.
    The self-loop terms go to :func:`gnncompile.kernels.spmm` with the product (``loop=``), forward
    and into the own rows of ``x``'s gradient: the native kernels add them as they store each row."""

    @staticmethod
    def forward(ctx: Any, g: Graph, values: Optional[torch.Tensor], x: torch.Tensor, backend: Optional[str],
                row: Optional[torch.Tensor], col: Optional[torch.Tensor],
                loop: Optional[torch.Tensor] = None) -> torch.Tensor:
        ctx.g, ctx.backend = g, backend
        # x only serves the gradients of trainable edge values or self-loop factors (GAT): a
        # propagation with fixed coefficients keeps nothing of its input for backward
        keep_x = values is not None and ctx.needs_input_grad[1] or loop is not None and ctx.needs_input_grad[6]
        # fixed terms (the normalization's scales, fixed loops) are kept as themselves: the kernels
        # cache what they derive from them per tensor identity (unpacked saved tensors are new objects)
        ctx.row, ctx.col = row, col
        ctx.loop = loop if loop is not None and not loop.requires_grad else None
        ctx.save_for_backward(values, x if keep_x else None, loop if ctx.loop is None else None)
        return kernels.spmm(_csr(g), values, x, backend, row_scale=row, col_scale=col, loop=loop,
                            loop_at=(0, _own_offset(g)))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        values, x, loop = ctx.saved_tensors
        row, col = ctx.row, ctx.col
        loop = ctx.loop if ctx.loop is not None else loop
        g: Graph = ctx.g
        grad_values = grad_x = grad_loop = None
        grad_out = grad_out.contiguous()
        off = _own_offset(g)  # (the self loops' term into the own rows of x's gradient, in the same product)
        if ctx.needs_input_grad[2] and _pushes(g, values is not None):
            grad_x = kernels.spmm(_csr(g), values, grad_out, ctx.backend, row_scale=row, col_scale=col, transpose=True,
                                  loop=loop, loop_at=(0, off))
        elif ctx.needs_input_grad[2]:
            csr_t, perm = _csr_t(g, values is not None)
            vt = None if values is None else kernels.gather_rows(values, perm)
            grad_x = kernels.spmm(csr_t, vt, grad_out, ctx.backend, row_scale=col, col_scale=row, loop=loop,
                                  loop_at=(off, 0))
            del vt  # the permuted values (an edge tensor) are not held while their gradient is made
        if values is not None and ctx.needs_input_grad[1]:
            grad_values = _values_grad(g, values, grad_out, x, row, col, ctx.backend)
        if loop is not None and ctx.needs_input_grad[6]:
            prod = grad_out * _own_rows(g, x)
            grad_loop = prod.sum(dim=tuple(range(loop.dim(), prod.dim()))) if prod.dim() > loop.dim() else prod
        return None, grad_values, grad_x, None, None, None, grad_loop


Terms = tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]


def _stored_terms(g: Graph, norm: str, self_loops: bool, dtype: torch.dtype) -> Terms:
    """``(values, row, col, loop)`` of a propagation with the graph's own normalization, in
    ``dtype`` and cached on the graph: the stored edge weights (``None`` when unweighted; ignored
    by ``norm="none"``) and the per-vertex scales of :meth:`Graph.norm_scales`."""
    def build() -> Terms:
        if norm == "none":
            loop = torch.ones(g.num_nodes, dtype=dtype, device=g.device) if self_loops else None
            return None, None, None, loop
        sc = g.norm_scales(norm, self_loops)
        w = g.edge_weight

        def cast(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return None if t is None else t.to(device=g.device, dtype=dtype)
        return cast(w), cast(sc.row), cast(sc.col), cast(sc.loop)
    return g.cached(f"terms:{norm}:{int(self_loops)}:{dtype}", build)


def _propagation_terms(g: Graph, norm: str, edge_weight: Optional[torch.Tensor], self_loops: bool,
                       dtype: torch.dtype) -> Terms:
    """``(values, row, col, loop)``: edge values, per-vertex scales and self-loop factors of a
    propagation (see :func:`propagate`); with ``edge_weight`` given, normalized differentiably per
    edge (PyG ``gcn_norm`` semantics) and no scales."""
    if norm not in NORMS:
        raise KernelError(f"propagate: unknown norm {norm!r}; valid: {', '.join(repr(n) for n in NORMS)}")
    if edge_weight is None:
        return _stored_terms(g, norm, self_loops, dtype)
    if self_loops:
        values, loop = _loop_norm(g, norm, edge_weight)
        return values, None, None, loop
    w = edge_weight
    if norm in ("sum", "none"):
        return w, None, None, None
    if w.dim() != 1:
        raise KernelError(f"propagate: norm={norm!r} needs 1-d edge weights, got shape {list(w.shape)}")
    return _normalize(g, norm, w, None)[0], None, None, None


def _normalize(g: Graph, norm: str, we: torch.Tensor,
               wl: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """gcn/mean-normalize edge weights ``we`` (and self-loop weights ``wl``, if any); differentiable.

    Degrees are weighted and include the self loops; zero-degree vertices get zero coefficients.
    """
    if norm == "gcn" and g.num_src != g.num_nodes:
        raise KernelError(
            "propagate: norm='gcn' of computed edge weights needs the weighted out-degree of every source, "
            "which a rank's local graph (with halo sources) does not hold; normalize the weights before "
            "partitioning or use norm='mean'/'sum'")
    zeros = torch.zeros(g.num_nodes, dtype=we.dtype, device=we.device)
    dst = _rows_index(g.dst)
    deg_in = zeros.index_add(0, dst, we)
    if wl is not None:
        deg_in = deg_in + wl
    if norm == "mean":
        inv = torch.where(deg_in > 0, 1.0 / deg_in.clamp_min(1e-30), torch.zeros_like(deg_in))
        return we * inv[dst], None if wl is None else wl * inv
    src = _rows_index(g.indices)
    deg_out = zeros.index_add(0, src, we)
    if wl is not None:
        deg_out = deg_out + wl
    inv_in = torch.where(deg_in > 0, deg_in.clamp_min(1e-30).rsqrt(), torch.zeros_like(deg_in))
    inv_out = torch.where(deg_out > 0, deg_out.clamp_min(1e-30).rsqrt(), torch.zeros_like(deg_out))
    return inv_in[dst] * we * inv_out[src], None if wl is None else inv_in * wl * inv_out


@fx_leaf("P")
def propagate(g: Graph, x: torch.Tensor, norm: str = "gcn", edge_weight: Optional[torch.Tensor] = None,
              add_self_loops: bool = False, backend: Optional[str] = None) -> torch.Tensor:
    """Graph propagation (P op): ``out[v] = sum_{e = u->v} c_e * x[u]``.

    Parameters
    ----------
    g:
        The graph.
    x:
        ``[N, ...]`` vertex features. With multi-head ``edge_weight`` of shape ``[E, H]``,
        ``x`` must be ``[N, H, C]`` and head ``h`` uses ``edge_weight[:, h]``.
    norm:
        ``"gcn"``: ``c_e = w_e / sqrt(deg_in(v) deg_out(u))``; ``"mean"``: ``w_e / deg_in(v)``;
        ``"sum"``: ``w_e``; ``"none"``: the ``edge_weight`` argument alone (the graph's stored
        weights are ignored), for attention coefficients. Degrees are weighted; zero-degree
        vertices get zero coefficients.
    edge_weight:
        Optional ``[E]`` or ``[E, H]`` weights aligned with the graph's edges, replacing the
        graph's stored weights; differentiable (the backward is an SDDMM). With
        ``add_self_loops`` it has ``E + N`` rows (self-loop weights last).
    add_self_loops:
        Propagate over ``A + I`` (see the module docstring); degrees include the self loop.
    backend:
        Kernel backend override (see :mod:`gnncompile.kernels`).
    """
    g = _check_graph(g, "propagate")
    _check_rows(x, g.num_src, "propagate", "x", "vertex", g)
    if x.layout != torch.strided:
        raise KernelError(f"propagate: x must be a dense tensor, got layout {x.layout}; apply a Linear first "
                          "(it accepts sparse features) or densify with graph.dense_features()")
    if not x.is_floating_point():
        raise KernelError(f"propagate: x must be floating point, got {x.dtype}")
    if edge_weight is not None:
        _check_rows(edge_weight, _edge_rows(g, add_self_loops), "propagate", "edge_weight", "edge", g)
        if edge_weight.dtype != x.dtype:
            edge_weight = edge_weight.to(x.dtype)
    values, row, col, loop = _propagation_terms(g, norm, edge_weight, add_self_loops, x.dtype)
    return _SpMM.apply(g, values, x, backend, row, col, loop)


def _own_offset(g: Graph) -> int:
    """The first row of the destinations themselves among ``g``'s sources (see :func:`_own_rows`)."""
    return 0 if g.num_src == g.num_nodes else getattr(g, "own_offset", 0)


def _destination_rows(g: Graph, x: Any) -> Any:
    """``x``'s destination rows where it has one row per source of a graph with more sources than
    destinations (a view of the destinations' own rows), else ``x`` itself (checked by the caller)."""
    if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == g.num_src != g.num_nodes:
        return _own_rows(g, x)
    return x


def _own_rows(g: Graph, x: torch.Tensor) -> torch.Tensor:
    """The rows of source-side ``x`` that are the destinations themselves (their self loops)."""
    off = _own_offset(g)
    return x if g.num_src == g.num_nodes else x[off: off + g.num_nodes]


def _rows_index(idx: torch.Tensor) -> torch.Tensor:
    """``idx`` as a row index for ``index_select``/``index_add``: int64 on the CPU, where torch's
    kernels take a slow path for int32 (a graph's compact indices): on 530k edges x 4 heads,
    ``index_select`` 4.0 ms and its backward's ``index_add_`` 29 ms with int32, 1.2 and 3.1 ms
    with the int64 copy made here (a temporary of 8 bytes per edge)."""
    return idx.long() if idx.device.type == "cpu" and idx.dtype != torch.int64 else idx


def _gather(g: Graph, x: torch.Tensor, dst: bool, loops: bool = False) -> torch.Tensor:
    """``x[dst(e)]`` (``dst``) or ``x[src(e)]`` for every edge and, with ``loops``, the destinations'
    own rows after them (``[E + N, ...]``, written in place of a concatenation); not differentiable."""
    index = g.dst if dst else g.indices
    if not loops:
        return kernels.gather_rows(x, index)
    e = g.num_edges
    out = kernels.gather_rows(x, index, x.new_empty((e + g.num_nodes,) + tuple(x.shape[1:])))
    out[e:] = x if dst else _own_rows(g, x)
    return out


class _GatherRows(torch.autograd.Function):
    """``x[src(e)]`` (or ``x[dst(e)]`` with ``dst``) for every edge and, with ``loops``, the
    destinations' own rows after them (``[E + N, ...]``, made in place of a concatenation), saving
    nothing per edge: the backward reads the graph's own structure (a segment sum over the
    destinations' CSR rows; a sum into the sources), where ``index_select``'s autograd would save
    its index (an int64 copy of a compact graph's: 8 bytes per edge per gather until the backward)."""

    @staticmethod
    def forward(ctx: Any, g: Graph, x: torch.Tensor, dst: bool, loops: bool = False) -> torch.Tensor:
        ctx.g, ctx.dst, ctx.rows, ctx.loops = g, dst, x.shape[0], loops
        return _gather(g, x, dst, loops)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        g: Graph = ctx.g
        e = g.num_edges
        edges = grad[:e] if ctx.loops else grad
        if ctx.dst:  # the edges are in CSR order: each destination's are one segment
            out = _segment_sum(g, edges)
        else:
            out = _EdgeSums.apply(g, edges, False, ctx.rows)
        if ctx.loops:
            own = out if ctx.dst else _own_rows(g, out)
            own += grad[e:]
        return None, out, None, None


class _EdgeSums(torch.autograd.Function):
    """An edge tensor ``[E, ...]`` summed per destination (``dst``: its CSR rows) or per source, the
    adjoint of :class:`_GatherRows` (whose gather is this one's backward): natively on the CPU
    (:func:`gnncompile.kernels.native_edge_ops`), else ``segment_reduce`` / ``index_add_``."""

    @staticmethod
    def sums(g: Graph, t: torch.Tensor, dst: bool, rows: int) -> torch.Tensor:
        """The forward's sums (not differentiable)."""
        if kernels.native_edge_ops(t):
            return kernels.segment_sum(_csr(g), t) if dst else kernels.scatter_sum(_csr(g), t)
        if dst:
            return torch.segment_reduce(t, "sum", offsets=g.indptr, axis=0)
        out = torch.zeros((rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        return out.index_add_(0, _rows_index(g.indices), t)

    @staticmethod
    def forward(ctx: Any, g: Graph, t: torch.Tensor, dst: bool, rows: int) -> torch.Tensor:
        ctx.g, ctx.dst = g, dst
        return _EdgeSums.sums(g, t, dst, rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return None, _GatherRows.apply(ctx.g, grad, ctx.dst), None, None


def _segment_sum(g: Graph, t: torch.Tensor) -> torch.Tensor:
    """Per-destination sums of an edge tensor ``[E, ...]`` (CSR order); 0 for no in-edges; differentiable."""
    return _EdgeSums.apply(g, t, True, g.num_nodes)


def _edge_rows(g: Graph, add_self_loops: bool) -> int:
    return g.num_edges + g.num_nodes if add_self_loops else g.num_edges


def _loop_norm(g: Graph, norm: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split normalized ``[E + N, ...]`` weights into (edge part, self-loop part); differentiable.
    One ``split``: its backward concatenates the parts' gradients into one tensor, where two slices'
    would each fill a zero tensor of ``w``'s size and add them."""
    edges, loops = torch.split(w, [g.num_edges, w.shape[0] - g.num_edges])
    if norm in ("sum", "none"):
        return edges, loops
    if w.dim() != 1:
        raise KernelError(f"propagate: norm={norm!r} needs 1-d edge weights, got shape {list(w.shape)}")
    edge_coef, loop_coef = _normalize(g, norm, edges, loops)
    assert loop_coef is not None
    return edge_coef, loop_coef


# --------------------------------------------------------------------------- E ops
@fx_leaf("E")
def gather_src(g: Graph, x: torch.Tensor, add_self_loops: bool = False) -> torch.Tensor:
    """Vertex -> edge: ``out[e] = x[src(e)]`` (``[E, ...]``, or ``[E + N, ...]`` with self loops)."""
    g = _check_graph(g, "gather_src")
    _check_rows(x, g.num_src, "gather_src", "x", "vertex", g)
    return _GatherRows.apply(g, x, False, add_self_loops)


@fx_leaf("E")
def gather_dst(g: Graph, x: torch.Tensor, add_self_loops: bool = False) -> torch.Tensor:
    """Vertex -> edge: ``out[e] = x[dst(e)]`` (``[E, ...]``, or ``[E + N, ...]`` with self loops).

    ``x`` has a row per destination or, where ``g`` is a rank's or chunk's graph whose sources
    include its destinations (:class:`~gnncompile.graph.shard.LocalGraph`), a row per source: the
    destinations' own rows are then taken from it (as :func:`dst_rows` does).
    """
    g = _check_graph(g, "gather_dst")
    x = _destination_rows(g, x)
    _check_rows(x, g.num_nodes, "gather_dst", "x", "vertex", g)
    return _GatherRows.apply(g, x, True, add_self_loops)


@fx_leaf("E")
def dst_rows(g: Graph, x: torch.Tensor) -> torch.Tensor:
    """The rows of ``x`` that are ``g``'s destinations themselves (a view, no copy).

    ``x`` holds the rows of ``g``'s destinations (returned as is), of its sources (a rank's local
    graph: rows ``[own_offset, own_offset + num_nodes)``), or, for a block of a sampled mini-batch
    (``own_offset == 0``), of any vertex set whose first rows are the block's destinations (its
    sources, or an earlier layer's: ``x[:num_nodes]``). On a whole graph it is the identity. This
    is how a layer combines a source-side value with the destinations' (GraphSAGE's root term, a
    residual, GCNII's ``x0``) on blocks, as DGL's ``h[:block.num_dst_nodes()]`` does;
    :func:`gnncompile.frontend.blocks.bind_blocks` inserts it where a traced model needs it.
    """
    g = _check_graph(g, "dst_rows")
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        raise KernelError(f"dst_rows: x must be a tensor with a row dimension, got {type(x).__name__}")
    rows, n, off = x.shape[0], g.num_nodes, getattr(g, "own_offset", 0)
    if rows == n or rows == g.num_src:
        return _destination_rows(g, x)
    if off == 0 and rows > n:
        return x[:n]
    raise KernelError(f"dst_rows: x has {rows} rows; expected {n} (the destinations), {g.num_src} (the sources)"
                      + ("" if off else f" or more (a block's sources' first rows)"))


class _SegmentMax(torch.autograd.Function):
    """Max over each destination's in-edges; ties share the gradient equally (like ``amax``).

    ``torch.segment_reduce``'s own max backward gives every tied entry the full gradient when the
    incoming gradient is negative, so the backward is written here.
    """

    @staticmethod
    def forward(ctx: Any, g: Graph, t: torch.Tensor) -> torch.Tensor:
        out = torch.segment_reduce(t, "max", offsets=g.indptr, axis=0)
        deg = g.in_degree().reshape((-1,) + (1,) * (t.dim() - 1))
        out = torch.where(deg > 0, out, torch.zeros((), dtype=t.dtype, device=t.device))
        ctx.g = g
        ctx.save_for_backward(t, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        t, out = ctx.saved_tensors
        g: Graph = ctx.g
        hit = (t == _gather(g, out, True)).to(t.dtype)
        count = _segment_sum(g, hit).clamp_min(1)
        return None, hit * _gather(g, grad / count, True)


def _segment(g: Graph, t: torch.Tensor, reduce: str) -> torch.Tensor:
    """Reduce edge rows into destination rows; empty segments give 0."""
    if reduce == "max":
        return _SegmentMax.apply(g, t)
    out = _segment_sum(g, t)
    if reduce == "sum":
        return out
    deg = g.in_degree().reshape((-1,) + (1,) * (t.dim() - 1))
    return out / deg.clamp_min(1).to(t.dtype)


class _EdgeSoftmax(torch.autograd.Function):
    """Softmax over each destination's in-edges and, with ``loops``, its implicit self loop (row
    ``E + v`` of an ``[E + N, ...]`` input), in the edge layout itself (no reordering into a
    loop-augmented CSR). Saves its output only. With the native edge reductions
    (:func:`gnncompile.kernels.native_edge_ops`) forward and backward make their result and nothing
    else; the torch formulation holds one more tensor of the output's size each way (a
    per-destination term spread over the edges)."""

    @staticmethod
    def _reduce(g: Graph, t: torch.Tensor, how: str, loops: bool) -> torch.Tensor:
        """Per destination: ``how`` (max or sum) of its edges' rows and, with ``loops``, its loop's
        (the loop last, as in a loop-augmented CSR row)."""
        e = g.num_edges
        out = torch.segment_reduce(t[:e], how, offsets=g.indptr, axis=0)
        if loops:
            out = torch.maximum(out, t[e:]) if how == "max" else out.add_(t[e:])
        return out

    @staticmethod
    def forward(ctx: Any, g: Graph, e: torch.Tensor, loops: bool) -> torch.Tensor:
        ctx.g, ctx.loops = g, loops
        if e.shape[0] == 0:
            ctx.save_for_backward(e)
            return e.clone()
        with torch.no_grad():
            if kernels.native_edge_ops(e):  # the output is the only tensor made
                csr = _csr(g)
                s = kernels.edge_softmax_step(csr, kernels.edge_softmax_step(csr, e, "shift", loops=loops).exp_(),
                                              "normalize", loops=loops)
            else:
                s = _gather(g, _EdgeSoftmax._reduce(g, e, "max", loops), True, loops)
                torch.sub(e, s, out=s).exp_()
                s.div_(_gather(g, _EdgeSoftmax._reduce(g, s, "sum", loops), True, loops))
        ctx.save_for_backward(s)
        return s

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (s,) = ctx.saved_tensors
        g: Graph = ctx.g
        if s.shape[0] == 0:
            return None, grad, None
        if kernels.native_edge_ops(grad):
            return None, kernels.edge_softmax_step(_csr(g), s, "backward", loops=ctx.loops,
                                                   grad=grad.contiguous()), None
        sg = s * grad
        dot = _gather(g, _EdgeSoftmax._reduce(g, sg, "sum", ctx.loops), True, ctx.loops).mul_(s)
        return None, sg.sub_(dot), None


def _with_loops(g: Graph) -> Graph:
    """The graph with one self loop per vertex appended to each row (cached; structure only)."""
    def build() -> Graph:
        ar = torch.arange(g.num_nodes, device=g.device)
        counts = g.in_degree() + 1
        indptr = torch.zeros(g.num_nodes + 1, dtype=torch.int64, device=g.device)
        torch.cumsum(counts, 0, out=indptr[1:])
        # position of each original edge and of each self loop in the augmented row order
        pos_edge = torch.arange(g.num_edges, device=g.device) + g.dst
        pos_loop = indptr[1:] - 1
        indices = torch.empty(g.num_edges + g.num_nodes, dtype=g.indices.dtype, device=g.device)
        indices[pos_edge] = g.indices
        indices[pos_loop] = ar.to(g.indices.dtype)
        aug = Graph(indptr, indices, g.num_nodes, validate=False, name=g.name, compact_indices=True)
        order = torch.cat([pos_edge, pos_loop])  # E' layout -> augmented CSR order
        aug._cache["order"] = order.to(torch.int32) if order.numel() <= _INT32_MAX else order
        return aug
    return g.cached("with_loops", build)


def _loop_orders(g: Graph) -> tuple[Graph, torch.Tensor, torch.Tensor]:
    """The loop-augmented graph, the augmented CSR position of each E' entry (``order``) and its
    inverse (both cached)."""
    aug = _with_loops(g)
    order = aug._cache["order"]
    return aug, order, g.cached("with_loops_inv", lambda: torch.argsort(order).to(order.dtype))


def _to_csr_order(g: Graph, t: torch.Tensor) -> tuple[Graph, torch.Tensor]:
    """The loop-augmented graph and ``t`` (``[E + N, ...]``, edge layout) in its CSR order."""
    aug, _, inv = _loop_orders(g)
    return aug, t.index_select(0, _rows_index(inv))


@fx_leaf("E")
def edge_softmax(g: Graph, e: torch.Tensor, add_self_loops: bool = False) -> torch.Tensor:
    """Softmax of edge scores ``e`` (``[E]`` or ``[E, H]``) over the in-edges of each destination.

    With ``add_self_loops`` ``e`` has ``E + N`` rows and each vertex's self loop joins its softmax.
    """
    g = _check_graph(g, "edge_softmax")
    _check_rows(e, _edge_rows(g, add_self_loops), "edge_softmax", "e", "edge", g)
    return _EdgeSoftmax.apply(g, e, bool(add_self_loops))


class _EdgeAttention(torch.autograd.Function):
    """GAT's attention coefficients from per-vertex scores, fused: ``edge_softmax(LeakyReLU(
    src[src(e)] + dst[dst(e)]))`` (see :func:`edge_attention`). Saves the coefficients and the two
    score tensors (``[V, ...]``); the pre-activations are recomputed in the backward. Fused
    (:meth:`_fused`: the native CPU kernels, or the own CUDA kernels with the ``cupy`` backend or,
    with another, where measured faster) the forward allocates its result only and the backward one edge
    tensor (the scores' gradient); the torch formulation holds one more edge tensor each way. The forward's values are those of the unfused ops bit for bit, the gradients up
    to rounding (fused multiply-adds)."""

    @staticmethod
    def _preactivation(g: Graph, src: torch.Tensor, dst: torch.Tensor, loops: bool) -> torch.Tensor:
        x = _gather(g, src, False, loops)
        return x.add_(_gather(g, dst, True, loops))

    @staticmethod
    def _unfused(g: Graph, src: torch.Tensor, dst: torch.Tensor, slope: float, loops: bool) -> torch.Tensor:
        """The coefficients by torch operations (gathers, LeakyReLU, the softmax's segment reductions)."""
        s = torch.nn.functional.leaky_relu_(_EdgeAttention._preactivation(g, src, dst, loops), slope)
        if s.numel():
            m = _gather(g, _EdgeSoftmax._reduce(g, s, "max", loops), True, loops)
            torch.sub(s, m, out=m).exp_()
            s = m
            s.div_(_gather(g, _EdgeSoftmax._reduce(g, s, "sum", loops), True, loops))
        return s

    @staticmethod
    def _unfused_backward(g: Graph, src: torch.Tensor, dst: torch.Tensor, s: torch.Tensor, grad: torch.Tensor,
                          slope: float, loops: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The scores' gradients by torch operations: at most two edge tensors at a time (and a bool one)."""
        e = g.num_edges
        positive = _EdgeAttention._preactivation(g, src, dst, loops) > 0  # LeakyReLU's derivative, as torch's
        gs = s * grad
        dot = _gather(g, _EdgeSoftmax._reduce(g, gs, "sum", loops), True, loops).mul_(s)
        gs.sub_(dot)
        del dot
        gs.mul_(torch.where(positive, gs.new_tensor(1.0), gs.new_tensor(slope)))
        del positive
        g_dst = _EdgeSums.sums(g, gs[:e], True, dst.shape[0])
        if loops:
            g_dst += gs[e:]
        g_src = _EdgeSums.sums(g, gs[:e], False, src.shape[0])
        if loops:
            _own_rows(g, g_src).add_(gs[e:])
        return g_src, g_dst

    @staticmethod
    def _fused_backward(g: Graph, src: torch.Tensor, dst: torch.Tensor, s: torch.Tensor, grad: torch.Tensor,
                        slope: float, loops: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The scores' gradients by the fused kernels (:func:`kernels.attention_backward`)."""
        e = g.num_edges
        gs, g_dst = kernels.attention_backward(_csr(g), src, dst, s, grad.contiguous(), slope, loops=loops,
                                               own_offset=_own_offset(g))
        g_src = (kernels.scatter_sum(_csr(g), gs[:e]) if kernels.native_edge_ops(gs)
                 else _EdgeSums.sums(g, gs[:e], False, src.shape[0]))
        if loops:
            _own_rows(g, g_src).add_(gs[e:])
        return g_src, g_dst

    @staticmethod
    def _fused(g: Graph, src: torch.Tensor, dst: torch.Tensor, slope: float, loops: bool) -> bool:
        """Whether the fused kernels run: always where :func:`kernels.fused_attention` holds (native
        on the CPU, the ``cupy`` backend on CUDA); on CUDA with the default backend chosen by device
        (``torch``) where the own kernels can run and their forward and backward together were
        measured faster than the torch formulation's on this structure (:func:`kernels.attention_measured`)."""
        if kernels.fused_attention(src):
            return True
        if not kernels.attention_fusable(src) or src.shape[0] == 0 or g.num_edges == 0:
            return False
        off = _own_offset(g)

        @functools.lru_cache(maxsize=1)
        def upstream() -> torch.Tensor:   # the gradient both candidates' backward get (made only to measure)
            return torch.randn((g.num_edges + (g.num_nodes if loops else 0),) + tuple(src.shape[1:]),
                               generator=torch.Generator().manual_seed(0), dtype=src.dtype).to(src.device)

        def both(forward: Callable[..., torch.Tensor], backward: Callable[..., tuple]) -> Callable[[], torch.Tensor]:
            def run() -> torch.Tensor:   # the coefficients and the scores' gradients, as one tensor
                alpha = forward(g, src, dst, slope, loops)
                return torch.cat([alpha.reshape(-1), *(t.reshape(-1) for t in backward(g, src, dst, alpha, upstream(),
                                                                                       slope, loops))])
            return run

        fused = lambda g, src, dst, slope, loops: kernels.attention_coefficients(  # noqa: E731
            _csr(g), src, dst, slope, loops=loops, own_offset=off)
        return kernels.attention_measured(_csr(g), src, both(_EdgeAttention._unfused, _EdgeAttention._unfused_backward),
                                          both(fused, _EdgeAttention._fused_backward), f"loops {loops}, offset {off}")

    @staticmethod
    def forward(ctx: Any, g: Graph, src: torch.Tensor, dst: torch.Tensor, slope: float, loops: bool) -> torch.Tensor:
        ctx.g, ctx.slope, ctx.loops = g, slope, loops
        with torch.no_grad():
            ctx.fused = _EdgeAttention._fused(g, src, dst, slope, loops)
            if ctx.fused:
                s = kernels.attention_coefficients(_csr(g), src, dst, slope, loops=loops, own_offset=_own_offset(g))
            else:
                s = _EdgeAttention._unfused(g, src, dst, slope, loops)
        ctx.save_for_backward(src, dst, s)
        return s

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        src, dst, s = ctx.saved_tensors
        g: Graph = ctx.g
        if not (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):
            return None, None, None, None, None
        if s.numel() == 0:
            return None, torch.zeros_like(src), torch.zeros_like(dst), None, None
        backward = _EdgeAttention._fused_backward if ctx.fused else _EdgeAttention._unfused_backward
        g_src, g_dst = backward(g, src, dst, s, grad, ctx.slope, ctx.loops)
        return None, g_src, g_dst, None, None


@fx_leaf("E")
def edge_attention(g: Graph, src_scores: torch.Tensor, dst_scores: torch.Tensor, negative_slope: float = 0.2,
                   add_self_loops: bool = False) -> torch.Tensor:
    """Vertex scores -> attention coefficients: GAT's ``alpha``, fused.

    ``alpha = edge_softmax(g, leaky_relu(gather_src(g, src_scores) + gather_dst(g, dst_scores),
    negative_slope))`` (``[E]`` or ``[E, H]``; ``[E + N, ...]`` with ``add_self_loops``, a vertex's
    self loop attending to its own ``src_scores`` row): the same values (gradients up to rounding),
    without the per-edge gathers, sum and pre-activations. It saves ``alpha`` and the two score
    tensors; natively on the CPU the forward makes ``alpha`` alone and the backward one edge tensor
    (the torch formulation elsewhere holds one more each way). ``src_scores`` has a row per source
    vertex, ``dst_scores`` one per destination (or per source, as for :func:`gather_dst`), with
    the same trailing shape.
    """
    g = _check_graph(g, "edge_attention")
    dst_scores = _destination_rows(g, dst_scores)
    _check_rows(src_scores, g.num_src, "edge_attention", "src_scores", "vertex", g)
    _check_rows(dst_scores, g.num_nodes, "edge_attention", "dst_scores", "vertex", g)
    if src_scores.shape[1:] != dst_scores.shape[1:] or src_scores.dtype != dst_scores.dtype \
            or not src_scores.is_floating_point():
        raise KernelError(f"edge_attention: src_scores and dst_scores must be floating tensors of one dtype and row "
                          f"shape, got {src_scores.dtype} {list(src_scores.shape)} and {dst_scores.dtype} "
                          f"{list(dst_scores.shape)}")
    if src_scores.device != dst_scores.device:
        raise KernelError(f"edge_attention: src_scores on {src_scores.device} and dst_scores on {dst_scores.device}")
    return _EdgeAttention.apply(g, src_scores, dst_scores, float(negative_slope), bool(add_self_loops))


@fx_leaf("E")
def aggregate(g: Graph, msg: torch.Tensor, reduce: str = "sum", add_self_loops: bool = False) -> torch.Tensor:
    """Edge -> vertex: ``out[v] = reduce_{e into v} msg[e]`` with ``reduce`` in sum, mean, max.

    Vertices without in-edges get 0 for every reduction. With ``add_self_loops`` ``msg`` has
    ``E + N`` rows and row ``E + v`` joins vertex ``v``'s reduction.
    """
    g = _check_graph(g, "aggregate")
    if reduce not in REDUCES:
        raise KernelError(f"aggregate: unknown reduce {reduce!r}; valid: {', '.join(repr(r) for r in REDUCES)}")
    _check_rows(msg, _edge_rows(g, add_self_loops), "aggregate", "msg", "edge", g)
    if not add_self_loops:
        return _segment(g, msg, reduce)
    aug, m_csr = _to_csr_order(g, msg)
    return _segment(aug, m_csr, reduce)


# --------------------------------------------------------------------------- masked propagate (P, S-SpMM)
from ..kernels import masked as _masked_kernels  # noqa: E402  (appended section)

__all__ += ["masked_propagate", "dropout_noise", "dropout_rows", "plan_dropout_draws", "replay_dropout_outputs",
            "replay_pack", "replay_unpack", "drop_replay"]


#: Mask generators :func:`dropout_noise` can use (environment variable ``GNNCOMPILE_DROPOUT_MASKS``)
MASK_GENERATORS = ("philox", "torch")


def mask_generator() -> str:
    """The generator of dropout masks: ``philox`` (default; counter-based, any rows of a mask on
    their own) or ``torch`` (``bernoulli_`` on torch's generator: the masks ``F.dropout`` draws on a
    CPU, bit for bit, several times slower), from ``GNNCOMPILE_DROPOUT_MASKS`` (read at every draw,
    so launched ranks inherit it)."""
    name = os.environ.get("GNNCOMPILE_DROPOUT_MASKS") or "philox"
    if name not in MASK_GENERATORS:
        raise KernelError(f"GNNCOMPILE_DROPOUT_MASKS={name!r}: valid values are {', '.join(MASK_GENERATORS)}")
    return name


def draw_mask_seed() -> int:
    """The seed of the next dropout mask: one 63-bit draw from torch's CPU generator (so
    ``torch.manual_seed`` fixes every mask, on every device, and checkpointed replays, which restore
    the CPU RNG state, draw the same one)."""
    return int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))


def dropout_noise(x: torch.Tensor, p: float) -> torch.Tensor:
    """The dropout multiplier of every element of ``x``: 0 or ``1 / (1 - p)``, of ``x``'s shape, dtype
    and device (contiguous; depends only on those and the RNG state).

    Every mask gnncompile draws comes from here or from :func:`dropout_rows`: one seed from torch's
    CPU generator (:func:`draw_mask_seed`), then the counter-based mask of that seed
    (:func:`gnncompile.kernels.dropout.dropout_mask`): the same masks on every device and whatever
    the thread count, with ``F.dropout``'s distribution but not its draws (its CPU ``bernoulli_``
    draws 85 M numbers/s on one core; this, several times that, in parallel). Single-device
    training (:func:`gnncompile.train`, the reference step) draws ``F.dropout``'s masks here too
    (:class:`plan_dropout_draws`). With ``GNNCOMPILE_DROPOUT_MASKS=torch`` (:func:`mask_generator`)
    masks are ``F.dropout``'s CPU draws instead. A T op (one fx node when traced), used by
    :func:`gnncompile.passes.fuse_masked_propagate` to draw a dropout mask before the propagation
    that the mask will skip.
    """
    if isinstance(x, torch.fx.Proxy):
        return x.tracer.create_proxy("call_function", dropout_noise, (x, p), {})
    if not 0.0 <= p < 1.0:
        raise KernelError(f"dropout_noise: p must be in [0, 1), got {p}")
    if mask_generator() == "torch":
        return torch.empty(x.shape, dtype=x.dtype, device=x.device).bernoulli_(1.0 - p).div_(1.0 - p)
    shape = tuple(x.shape)
    rows, rest = (shape[0], shape[1:]) if shape else (1, ())
    return dropout_mask(draw_mask_seed(), float(p), rows, rest, dtype=x.dtype, device=x.device).reshape(shape)


def torch_dropout_arguments(args: tuple, kwargs: dict) -> Optional[dict[str, Any]]:
    """``torch.dropout(input, p, train)``'s arguments (what ``F.dropout`` calls) under ``F.dropout``'s
    names (``input``, ``p``, ``training``), or ``None`` for a call that does not give all three."""
    bound = dict(zip(("input", "p", "train"), args), **kwargs)
    if set(bound) != {"input", "p", "train"}:
        return None
    return {"input": bound["input"], "p": bound["p"], "training": bound["train"]}


class plan_dropout_draws(torch.overrides.TorchFunctionMode):
    """Context in which ``F.dropout`` (and so ``nn.Dropout``) draws its mask with :func:`dropout_noise`.

    Plans draw every mask with :func:`dropout_noise` or :func:`dropout_rows`, not with
    ``F.dropout``'s own RNG calls; the single-device reference (:func:`gnncompile.train`, the
    reference step of :mod:`gnncompile.testing`) runs its forward in this context, so for the same
    seed a plan's masks equal the reference's on every device. Only active dropout (``training``,
    ``0 < p < 1``, dense ``x``) is redirected. The graph primitives (:func:`fx_leaf`), which draw
    no dropout, run with this context suspended when it is the innermost torch function mode: a
    mode sees every torch call and attribute read (~230 in a GAT forward, most of them inside the
    primitives), which doubled a small graph's forward on the host.
    """

    _depth = threading.local()
    _handled = threading.local()

    @classmethod
    def replays_handled(cls) -> Any:
        """Context for the forward of a checkpoint that re-enters this redirection for its replay
        (:class:`~gnncompile.passes.recompute.Recompute`): its dropouts are not refused."""
        return _Counting(cls._handled)

    @classmethod
    def innermost(cls) -> bool:
        """Whether this thread's innermost torch function mode is a ``plan_dropout_draws`` context."""
        return getattr(cls._depth, "n", 0) > 0 and isinstance(_current_function_mode(), cls)

    @classmethod
    def active(cls) -> bool:
        """Whether this thread is inside a ``plan_dropout_draws`` context (a replay that autograd runs
        later, outside it, re-enters one: :class:`~gnncompile.passes.recompute.Recompute`)."""
        return getattr(cls._depth, "n", 0) > 0

    def __enter__(self) -> "plan_dropout_draws":
        type(self)._depth.n = getattr(type(self)._depth, "n", 0) + 1
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        type(self)._depth.n -= 1
        return super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        bound = None
        if func is torch.nn.functional.dropout:
            bound = dict(zip(("input", "p", "training", "inplace"), args), **kwargs)
        elif func is torch.dropout or func is torch.dropout_:  # (the tracer maps it to F.dropout)
            bound = torch_dropout_arguments(args, kwargs)
            if bound is not None:
                bound["inplace"] = func is torch.dropout_
        if bound is not None:
            x, p = bound["input"], bound.get("p", 0.5)
            if (bound.get("training", True) and 0.0 < p < 1.0 and isinstance(x, torch.Tensor)
                    and x.layout == torch.strided):
                if getattr(self._handled, "n", 0) == 0 and _in_checkpoint_forward():
                    raise KernelError(
                        "F.dropout inside torch.utils.checkpoint while gnncompile draws the dropout masks "
                        "(gnncompile.train, the reference step): the checkpoint replays its forward in backward "
                        "without this redirection and would draw other masks, so the gradients would be wrong. "
                        "Use gnncompile's recomputation (plan(..., recompute=True)) or, on a CPU, "
                        "GNNCOMPILE_DROPOUT_MASKS=torch")
                noise = dropout_noise(x, p)
                return x.mul_(noise) if bound.get("inplace", False) else x * noise
        return func(*args, **kwargs)


class _Counting:
    """Increments a thread-local counter while entered."""

    def __init__(self, local: threading.local) -> None:
        self.local = local

    def __enter__(self) -> None:
        self.local.n = getattr(self.local, "n", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        self.local.n -= 1


_CHECKPOINT_FILE = os.path.join("torch", "utils", "checkpoint.py")


def _in_checkpoint_forward() -> bool:
    """Whether this call runs inside ``torch.utils.checkpoint`` (a frame of its module on the stack):
    either variant replays the forward in backward, where torch function modes are not active."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_CHECKPOINT_FILE):
            return True
        frame = frame.f_back
    return False


class MaskDraw:
    """A dropout mask that is drawn (its seed taken from torch's generator) but not computed: the
    mask of a whole ``[num_rows, *row_shape]`` tensor, of which :meth:`times` computes only the
    rows a product needs (:func:`gnncompile.kernels.dropout.dropout_mask`). With the ``torch``
    generator (:func:`mask_generator`) the whole mask is drawn at once instead, as ``F.dropout``
    draws it, and kept."""

    __slots__ = ("seed", "p", "num_rows", "row_shape", "noise")

    def __init__(self, p: float, num_rows: int, row_shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        """``dtype`` and ``device``: the whole mask's, drawn now with the ``torch`` generator only (else
        each product's rows take ``x``'s)."""
        self.p, self.num_rows, self.row_shape = p, num_rows, row_shape
        self.noise: Optional[torch.Tensor] = None
        self.seed = 0
        if mask_generator() == "torch":
            template = torch.empty((), dtype=dtype, device=device).expand((num_rows,) + row_shape)
            self.noise = dropout_noise(template, p)
        else:
            self.seed = draw_mask_seed()

    def times(self, x: torch.Tensor, index: torch.Tensor, replay: bool = False) -> torch.Tensor:
        """``x`` (the rows ``index`` of the whole tensor) times those rows of the mask, ``x * noise``
        with ``noise`` 0 or ``1 / (1 - p)`` as :func:`dropout_noise` has it (the same numbers, and
        the gradient ``g * noise``), saving for backward only the bool ``keep`` of the rows (one byte
        per entry); ``noise`` is a temporary of the product, made again in backward. ``replay``: the
        output may be replayed (:func:`replay_dropout_outputs`) where ``x`` qualifies."""
        if self.noise is not None:
            return x * self.noise.index_select(0, index)
        keep = dropout_mask(self.seed, self.p, self.num_rows, self.row_shape, rows=index, dtype=torch.bool,
                            device=x.device)
        scale = 1.0 / (1.0 - self.p)
        out = _KeepTimes.apply(x, keep, scale)
        if replay and _replayable_source(x):
            _mark_replayable(out, _Replay(x, keep, scale, x._version, out._version))
        return out


class _Replay:
    """A dropout's output as its backward readers need it: its input ``x`` and kept mask, from which
    :func:`keep_times` computes the output again, bit for bit (:func:`replay_dropout_outputs`).
    ``x_version``/``out_version``: the tensors' versions when the dropout ran (an in-place change of
    either afterwards makes the replay wrong: it is then not packed, or refused when unpacked).
    ``view``: ``(size, stride, offset)`` where what was saved is a view of the output (a slice an
    op saved), ``None`` for the output itself; ``made``: ``[output, pending]``, shared by the packs
    of one output: the output replayed first is kept until every pack of it was unpacked (the
    views one backward node reads share one replay; later readers hold no more than keeping the
    output would have)."""

    __slots__ = ("x", "keep", "scale", "x_version", "out_version", "view", "made")

    def __init__(self, x: torch.Tensor, keep: torch.Tensor, scale: float, x_version: int, out_version: int,
                 view: Optional[tuple] = None, made: Optional[list] = None) -> None:
        self.x, self.keep, self.scale = x, keep, scale
        self.x_version, self.out_version, self.view = x_version, out_version, view
        self.made: list = made if made is not None else [None, 0]  # [replayed output, packs pending], shared

    def of_view(self, t: torch.Tensor) -> "_Replay":
        """The replay of ``t``, a view of this output."""
        return _Replay(self.x, self.keep, self.scale, self.x_version, self.out_version,
                       (tuple(t.size()), tuple(t.stride()), t.storage_offset()), self.made)

    def output(self) -> torch.Tensor:
        if self.x._version != self.x_version:
            raise KernelError("a dropout's input was modified in place after the dropout ran; its output, "
                              "needed for gradient computation, cannot be computed again (replay_dropout_outputs)")
        out, pending = self.made
        if out is None:
            with torch.no_grad():
                out = keep_times(self.x.detach(), self.keep, self.scale)
        # kept for the packs of this output not unpacked yet (one node's views share one replay)
        self.made[:] = [out, pending - 1] if pending > 1 else [None, 0]
        return out if self.view is None else out.as_strided(*self.view)


#: storage of a replayable dropout output -> (that output, weakly; its replay): the output or a view
#: of it that an op saves replays
_REPLAYABLE: dict[int, tuple["weakref.ref[torch.Tensor]", _Replay]] = {}


def _mark_replayable(out: torch.Tensor, info: _Replay) -> None:
    ptr = out.untyped_storage().data_ptr()
    ref = weakref.ref(out, lambda ref, ptr=ptr: _REPLAYABLE.pop(ptr, None)
                      if _REPLAYABLE.get(ptr, (None,))[0] is ref else None)
    _REPLAYABLE[ptr] = (ref, info)


def _replayable_source(x: torch.Tensor) -> bool:
    """Whether a replay of a dropout of ``x`` holds less than its output: ``x`` is a step input (a
    leaf needing no gradient: resident data; the replay then holds the mask, a quarter of the
    output's float32 bytes, which the dropout's backward would not), or needs a gradient (the
    dropout's backward holds the mask anyway) and owns all of its storage (no larger buffer kept)."""
    if x.layout != torch.strided or not x.is_floating_point():
        return False
    if x.is_leaf and not x.requires_grad:
        return True
    return x.requires_grad and x.is_contiguous() and x.storage_offset() == 0 and \
        x.untyped_storage().nbytes() == x.numel() * x.element_size()


def replay_pack(t: Any) -> Any:
    """What autograd saves for ``t`` under :func:`replay_dropout_outputs`: for the unchanged output of
    a replicated dropout (:meth:`MaskDraw.times`) or a view of it, a :class:`_Replay` of its input
    and mask (which the dropout's own backward holds anyway); anything else as it is."""
    if not _REPLAYABLE or not isinstance(t, torch.Tensor) or t.layout != torch.strided:
        return t
    ref, info = _REPLAYABLE.get(t.untyped_storage().data_ptr(), (None, None))
    base = ref() if ref is not None else None
    if base is None or t._version != info.out_version or info.x._version != info.x_version:
        return t
    if (t.size(), t.stride(), t.storage_offset()) != (base.size(), base.stride(), base.storage_offset()):
        info = info.of_view(t)
    info.made[1] += 1
    return info


def replay_unpack(p: Any) -> Any:
    """The inverse of :func:`replay_pack`: a :class:`_Replay`'s output computed again."""
    return p.output() if isinstance(p, _Replay) else p


def replay_dropout_outputs() -> Any:
    """Context in which a tensor autograd saves that is the output of a replicated dropout is kept as
    that dropout's input and bool mask and computed again when backward reads it (one
    :func:`keep_times` pass): a linear layer after ``dropout(relu(h))`` holds nothing beside what
    ``relu`` and the dropout save. Exact: the replayed output equals the forward's bit for bit.
    The executor runs every training forward in it (:mod:`gnncompile.runtime.executor`); inside a
    checkpointed segment the checkpoint's own hooks apply instead."""
    return torch.autograd.graph.saved_tensors_hooks(replay_pack, replay_unpack)


def drop_replay(t: Any) -> None:
    """Forget that ``t`` (or the tensor whose storage it shares) is a dropout's output (a stage output
    the executor keeps: a later stage that saves it must hold it, not its input)."""
    if _REPLAYABLE and isinstance(t, torch.Tensor) and t.layout == torch.strided:
        _REPLAYABLE.pop(t.untyped_storage().data_ptr(), None)


class _KeepTimes(torch.autograd.Function):
    """``x * where(keep, scale, 0)`` (the multiplier in ``x``'s dtype), saving ``keep`` (bool), not the
    multiplier: forward and backward compute what ``x * noise`` and its gradient ``g * noise`` do."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return keep_times(x, keep, scale)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None]:
        (keep,) = ctx.saved_tensors
        return keep_times(g, keep, ctx.scale), None, None


class MaskCache:
    """Dropout masks shared by the chunks of a training step (used by the executor for chunked plans,
    and where a rank runs some of a plan's dropouts).

    A chunked rank runs a stage once per chunk; :func:`dropout_rows` must then draw each op's mask of
    the whole tensor once (at the stage's first chunk, so masks are drawn in the single-device order)
    and compute each chunk's rows from it. While a cache is active (``with cache.stage(s):``), the
    k-th :func:`dropout_rows` call of stage ``s`` is keyed ``(s, k)``. A cached mask is a
    :class:`MaskDraw` (a seed): nothing of the size of the tensor is kept.
    """

    def __init__(self) -> None:
        self.masks: dict[tuple[Any, int], MaskDraw] = {}
        self._scope: Any = None
        self._count = 0

    def stage(self, scope: Any) -> "MaskCache":
        self._scope, self._count = scope, 0
        return self

    def __enter__(self) -> "MaskCache":
        global _MASKS
        _MASKS = self
        return self

    def __exit__(self, *exc: Any) -> None:
        global _MASKS
        _MASKS = None

    def keep(self, key: tuple[Any, int], draw: MaskDraw) -> MaskDraw:
        """Store ``draw`` as the mask of ``key``."""
        self.masks[key] = draw
        return draw

    def release(self, stage: Any) -> None:
        """Drop the masks of ``stage`` (after its last backward on this rank)."""
        for key in [key for key in self.masks if key[0] == stage]:
            del self.masks[key]

    def draw(self, p: float, num_rows: int, row_shape: tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> MaskDraw:
        """The mask of the current stage's next dropout: the cached one, else a new draw."""
        key = (self._scope, self._count)
        self._count += 1
        found = self.masks.get(key)
        return found if found is not None else self.keep(key, MaskDraw(p, num_rows, row_shape, dtype, device))


_MASKS: Optional[MaskCache] = None


def _row_draw(p: float, num_rows: int, row_shape: tuple[int, ...], dtype: torch.dtype,
              device: torch.device) -> MaskDraw:
    if _MASKS is not None:
        return _MASKS.draw(p, num_rows, row_shape, dtype, device)
    return MaskDraw(p, num_rows, row_shape, dtype, device)


def dropout_rows(x: torch.Tensor, p: float, index: torch.Tensor, num_rows: int, replay: bool = False) -> torch.Tensor:
    """Dropout of rows ``index`` of a ``[num_rows, ...]`` tensor, with the mask of the whole tensor.

    Draws the dropout mask of the full ``[num_rows, *x.shape[1:]]`` tensor as :func:`dropout_noise`
    would (one seed from torch's generator) and computes only its rows ``index``
    (:class:`MaskDraw`): a rank holding some rows of a tensor gets, for the same seed, the same
    masks as single-device training, in work and memory proportional to its rows. For a sparse CSR
    ``x`` the mask is over the stored values of the full matrix (``num_rows`` of them) and ``index``
    selects this matrix's values, as :func:`gnncompile.nn.functional.feature_dropout` draws it.
    ``p == 0`` (the input) and ``p == 1`` (zeros) draw nothing, like ``F.dropout``. Used by the
    ``data`` strategy and every strategy with ``dropout="replicated"``. ``replay``: an op that saves the (dense) output for backward keeps
    ``x`` and the mask instead, computing the output again when backward reads it, under
    :func:`replay_dropout_outputs` (set by :func:`gnncompile.passes.replicate_dropout_masks` where
    that holds less).
    """
    proxy = _has_proxy((x, index), {})
    if proxy is not None:  # one fx node (stage modules are re-traced when unpickled)
        kwargs = {"replay": True} if replay else {}
        return proxy.tracer.create_proxy("call_function", dropout_rows, (x, p, index, num_rows), kwargs)
    if p == 0.0:
        return x
    if p == 1.0:  # every element dropped, nothing drawn (as F.dropout)
        if x.layout == torch.sparse_csr:
            return torch.sparse_csr_tensor(x.crow_indices(), x.col_indices(), x.values() * 0.0, size=x.shape,
                                           device=x.device, check_invariants=False)
        return x * 0.0
    if index.device != x.device:
        raise KernelError(f"dropout_rows: index is on {index.device} but x is on {x.device}; move both to one device")
    if x.layout == torch.sparse_csr:
        values = x.values()
        draw = _row_draw(p, num_rows, (), values.dtype, values.device)
        return torch.sparse_csr_tensor(x.crow_indices(), x.col_indices(), draw.times(values, index),
                                       size=x.shape, device=x.device, check_invariants=False)
    return _row_draw(p, num_rows, tuple(x.shape[1:]), x.dtype, x.device).times(x, index, replay=replay)


def _nonzero_rows(t: torch.Tensor) -> torch.Tensor:
    """Bool ``[N]``: whether each row of ``t`` has an entry that is not 0 (NaN counts as nonzero)."""
    t = t.detach()
    if t.dim() == 1:
        return t != 0
    flat = t.reshape(t.shape[0], -1)
    if flat.shape[1] == 0:
        return torch.zeros(t.shape[0], dtype=torch.bool, device=t.device)
    # two reductions without a temporary of t's size (count_nonzero, (t != 0).any(1) and t.abs().amax(1)
    # are 5-10x slower on CPU); NaN propagates through amax, so a NaN row counts as nonzero
    return (flat.amax(dim=1) != 0) | (flat.amin(dim=1) != 0)


class _MaskedSpMM(torch.autograd.Function):
    """``out = A_c x`` on the rows in ``keep_rows`` only (zero elsewhere); gradients for ``x`` and ``c``.

    Backward: ``grad_x = A^T g`` reads only the rows of ``g`` that are kept and nonzero (outside
    ``keep_rows`` the output is constant, and zero rows contribute nothing); ``grad_c`` is the
    SDDMM of the same ``g``.
    """

    @staticmethod
    def forward(ctx: Any, g: Graph, values: Optional[torch.Tensor], x: torch.Tensor, keep_rows: torch.Tensor,
                backend: Optional[str], row: Optional[torch.Tensor], col: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.g, ctx.backend = g, backend
        ctx.all_kept = bool(keep_rows.all())
        ctx.save_for_backward(values, x if values is not None and ctx.needs_input_grad[1] else None, keep_rows,
                              row, col)
        return _masked_kernels.masked_spmm(_csr(g), values, x, keep_rows, backend, row_scale=row, col_scale=col)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        values, x, keep_rows, row, col = ctx.saved_tensors
        g: Graph = ctx.g
        grad_out = grad_out.contiguous()
        live = _nonzero_rows(grad_out)
        if not ctx.all_kept and bool((live & ~keep_rows).any()):
            # rows outside the mask are constant in the output: their incoming gradient is dropped
            grad_out = grad_out.masked_fill(~keep_rows.reshape((-1,) + (1,) * (grad_out.dim() - 1)), 0)
            live &= keep_rows
        grad_values = grad_x = None
        if ctx.needs_input_grad[2] and _pushes(g, values is not None):
            # rows outside ``live`` are zero in grad_out: the scatter adds nothing for them
            grad_x = kernels.spmm(_csr(g), values, grad_out, ctx.backend, row_scale=row, col_scale=col,
                                  transpose=True)
        elif ctx.needs_input_grad[2]:
            csr_t, perm = _csr_t(g, values is not None)
            vt = None if values is None else values[perm]
            grad_x = _masked_kernels.masked_spmm_t(csr_t, vt, grad_out, live, ctx.backend, row_scale=col,
                                                   col_scale=row)
        if values is not None and ctx.needs_input_grad[1]:
            grad_values = _values_grad(g, values, grad_out, x, row, col, ctx.backend)
        return None, grad_values, grad_x, None, None, None, None


@fx_leaf("P")
def masked_propagate(g: Graph, x: torch.Tensor, mask: Optional[torch.Tensor] = None, norm: str = "gcn",
                     edge_weight: Optional[torch.Tensor] = None, add_self_loops: bool = False,
                     backend: Optional[str] = None) -> torch.Tensor:
    """Row-masked propagation (P op; MixGCN's S-SpMM, Eq. 4): :func:`propagate` on the rows ``mask`` keeps.

    Row ``v`` of the result is ``propagate(g, x, norm, edge_weight, add_self_loops)[v]`` when
    ``mask[v]`` has a nonzero entry and 0 when it has none. The mask selects rows; it is not
    applied element-wise: multiply by it afterwards (``masked_propagate(g, x, m) * m`` is
    ``propagate(g, x) * m``, Eq. 4's ``(A H) ⊙ M``, which is what the dropout it comes from does).
    The forward product runs on the row-subset CSR of the kept rows and the backward transposed
    product reads only the rows of the incoming gradient that are kept and nonzero, which also
    skips the rows a ReLU after the propagation zeroed entirely. Kept rows equal
    :func:`propagate`'s bit for bit on the ``native`` backend.

    Parameters
    ----------
    g, x, norm, edge_weight, add_self_loops, backend:
        As for :func:`propagate`.
    mask:
        ``[N]`` or ``[N, ...]`` (any trailing shape, e.g. a dropout multiplier shaped like the
        output); a row is kept when any of its entries is nonzero. ``None`` keeps every row (the
        forward is :func:`propagate`'s; the backward still skips zero gradient rows). Not
        differentiated.
    """
    g = _check_graph(g, "masked_propagate")
    _check_rows(x, g.num_src, "masked_propagate", "x", "vertex", g)
    if not x.is_floating_point():
        raise KernelError(f"masked_propagate: x must be floating point, got {x.dtype}")
    if mask is None:
        keep_rows = torch.ones(g.num_nodes, dtype=torch.bool, device=x.device)
    else:
        _check_rows(mask, g.num_nodes, "masked_propagate", "mask", "vertex", g)
        keep_rows = _nonzero_rows(mask)
    if edge_weight is not None:
        _check_rows(edge_weight, _edge_rows(g, add_self_loops), "masked_propagate", "edge_weight", "edge", g)
        if edge_weight.dtype != x.dtype:
            edge_weight = edge_weight.to(x.dtype)
    values, row, col, loop = _propagation_terms(g, norm, edge_weight, add_self_loops, x.dtype)
    out = _MaskedSpMM.apply(g, values, x, keep_rows, backend, row, col)
    if loop is None:
        return out
    if mask is not None:  # the self-loop terms of dropped rows are zero too
        loop = torch.where(keep_rows.reshape(keep_rows.shape + (1,) * (loop.dim() - 1)), loop, 0)
    loop = loop.reshape(loop.shape + (1,) * (x.dim() - loop.dim()))
    return out + loop * _own_rows(g, x)


SOURCE_ARGS.update({propagate: "x", masked_propagate: "x", gather_src: "x", edge_attention: "src_scores"})


def prepare_graph(g: Graph, graphs: Iterable[torch.fx.Graph], dtype: torch.dtype,
                  backward: Optional[str] = None) -> None:
    """Build on ``g`` the derived structures that the primitives of the traced ``graphs`` read
    (kernel handles, the transposed structure and, for edge values, its permutation, the
    normalization terms in ``dtype``, edge destinations and the loop-augmented structure of edge
    ops), so a training step allocates only activations. Only what some primitive of ``graphs``
    uses is built (every structure the runtime holds is resident: :meth:`Graph.structure_bytes`).
    ``backward`` (one of :data:`BACKWARD_PRODUCTS`) sets the graph's backward product first; with
    ``"push"`` no transposed structure is built."""
    if backward is not None:
        set_backward_product(g, backward)
    calls = [(n, call_arguments(n)) for graph in graphs for n in graph.nodes
             if n.op == "call_function" and is_primitive(n.target)]
    props = [a for n, a in calls if n.target in (propagate, masked_propagate)]
    edge_ops = [a for n, a in calls if n.target in (gather_src, gather_dst, edge_softmax, edge_attention, aggregate)]
    if not props and not edge_ops:
        return
    with torch.no_grad():
        _csr(g)
        for a in props:
            if a["edge_weight"] is None and a["norm"] in NORMS:
                _stored_terms(g, a["norm"], bool(a["add_self_loops"]), dtype)
        values = g.edge_weight is not None or any(a["edge_weight"] is not None for a in props)
        if props and not _pushes(g, values):
            _csr_t(g, values)
        # each edge's destination: what gather_dst and the edge reductions index by (edge_attention's
        # native kernels walk the CSR rows instead)
        native = kernels.native_edge_ops(torch.empty(0, dtype=dtype, device=g.device))
        if any(n.target in (gather_dst, edge_softmax, aggregate) or (n.target is edge_attention and not native)
               for n, _ in calls):
            _ = g.dst
        if any(n.target is aggregate and a.get("add_self_loops") for n, a in calls):
            _ = _loop_orders(g)[0].dst
