"""`trace(model, graph_or_stats) -> TPGraph`: torch.fx tracing into the annotated T/P operator graph.

How it works
------------
1. **Symbolic tracing.** ``torch.fx`` traces ``model.forward(g, x)`` with the graph primitives of
   :mod:`gnncompile.ops` as leaves (one node each) and gnncompile layers traced *through*, so the
   operator graph shows every T, P and E op inside every layer. Standard ``torch.nn`` modules
   (Linear, norms, dropout, activations) stay single ``call_module`` nodes.
2. **Checks.** The graph input ``g`` may only be passed to primitives; raw sparse products and
   scatter/index-add ops are rejected with the primitive to use instead; data-dependent control
   flow is reported with the user's source line. All as :class:`~gnncompile.TraceError`.
3. **Annotation from sample graphs.** The traced module runs on four tiny random graphs of
   different (|V|, |E|). For every node the output shape, FLOPs, bytes read/written and the bytes
   autograd saves for backward (captured with ``torch.autograd.graph.saved_tensors_hooks`` and
   deduplicated by storage) are computed on each sample; since each of them is linear in |V| and
   |E| for GNNs, three samples determine it exactly as a :class:`~gnncompile.ir.symbolic.Lin` and
   the fourth checks it. Tracing for a billion-edge :class:`GraphStats` therefore costs the same
   as for Cora.

Cost formulas (per op, on the concrete sample shapes; ``s`` = element size in bytes)
------------------------------------------------------------------------------------
- GEMM (``Linear``, ``matmul``...): ``2 * rows * d_in * d_out`` FLOPs (+ ``rows * d_out`` bias);
  bytes = inputs + weight + output.
- P ``propagate`` over ``E'`` edges (``E' = E + V`` with implicit self loops) and width ``d``:
  NeutronTask Eq. 6 terms: ``2 * E' * d`` FLOPs and ``(E' * (1 + 2d) + V) * s`` bytes in all
  (read: ``(E' * (1 + d) + V) * s``; written: ``E' * d * s``, one accumulation per edge element).
- E ops: ``gather_*``: ``E' * d * s`` read and written (+ 8 bytes of index per edge);
  ``edge_softmax``: ``5`` FLOPs per element, 3 passes over the scores; ``edge_attention``: ``8``
  FLOPs per element (add, LeakyReLU, the softmax), the two scores gathered (``2 E' h s`` + 4 bytes
  of index per edge) and 3 passes over the coefficients; ``aggregate``: one FLOP per message
  element, the messages read and the vertex rows written.
- Norms: 5 FLOPs per element; every other op: one FLOP per output element, inputs read, output
  written.

Training and eval mode
----------------------
fx records ``self.training`` as a constant, so a trace holds one mode's behaviour of functional
code: ``F.dropout(x, p, self.training)`` (or ``training=self.training``, attention dropout on an
``[E, H]`` tensor, ``F.batch_norm(..., self.training)``) and ``if self.training:`` branches.
``trace(model, g)`` therefore traces the forward in both modes and compares the two graphs node
by node (:func:`mode_difference`). If they are equal, one graph serves both modes (``torch.nn``
leaves such as ``Dropout`` and ``BatchNorm1d`` read their own mode when they run); otherwise the
eval-mode graph is kept as ``tp.eval_graph`` and the TPGraph runs it in eval mode (see
:mod:`gnncompile.ir.tpgraph`). The returned graph starts in the model's modes (every submodule's),
and tracing never changes the model's modes. A model whose traced-through submodules are in a
mode other than the model's, in a way that changes the graph, cannot be represented by a
two-mode graph and is a :class:`~gnncompile.TraceError` naming the line. ``trace(..., training=b)``
traces one mode only (the planner's per-mode graphs; mode constants frozen).

Layers
------
A layer ends with a propagation: a P op, or an ``aggregate`` (the E -> V reduction that ends
message passing written with edge ops, e.g. GraphSAGE's max aggregation). The layer of such an
op is the number of layer-ending ops on the longest path up to and including it; the layer of
any other op is ``1 +`` the number on the longest path before it. A GCN layer is its T ops
followed by its P op; trailing T ops after the last propagation (an MLP head, GCN's last bias)
form layer ``L + 1``.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import inspect
import itertools
import linecache
import operator
import os
import re
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
import torch.fx
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves

from ..errors import TraceError
from ..graph.core import Graph, GraphStats
from ..ir.symbolic import Lin, solve_lin
from ..ir.tpgraph import TPGraph, TPInfo, ends_layer
from ..kernels import torch_threads
from .ops import PRIMITIVES, is_primitive, torch_dropout_arguments

__all__ = ["trace", "GNNTracer", "SAMPLE_SIZES", "ModeDifference", "mode_difference", "bound_arguments"]

# (|V|, |E|) of the sample graphs; generic sizes unlikely to equal a feature dimension.
SAMPLE_SIZES = ((23, 71), (37, 61), (29, 113), (41, 89))

_GEMM_MODULES = (torch.nn.Linear, torch.nn.Bilinear)
_NORM_MODULES = (torch.nn.LayerNorm, torch.nn.BatchNorm1d, torch.nn.GroupNorm, torch.nn.InstanceNorm1d)
_GEMM_FUNCS = {F.linear, torch.matmul, torch.mm, torch.addmm, torch.bmm, operator.matmul}
_NORM_FUNCS = {F.layer_norm, F.batch_norm, F.group_norm, F.normalize}

# Ops that do graph work behind the tracer's back: (what it is, the primitive to use instead).
_REJECTED_FUNCS: dict[Any, tuple[str, str]] = {
    torch.sparse.mm: ("a raw sparse matrix product", "gnncompile.ops.propagate"),
    torch.spmm: ("a raw sparse matrix product", "gnncompile.ops.propagate"),
    torch.sparse.addmm: ("a raw sparse matrix product", "gnncompile.ops.propagate"),
    torch.sparse_coo_tensor: ("building a sparse adjacency", "gnncompile.ops.propagate"),
    torch.sparse_csr_tensor: ("building a sparse adjacency", "gnncompile.ops.propagate"),
    torch.index_add: ("a scatter (index_add)", "gnncompile.ops.aggregate"),
    torch.scatter: ("a scatter", "gnncompile.ops.aggregate"),
    torch.scatter_add: ("a scatter", "gnncompile.ops.aggregate"),
    torch.scatter_reduce: ("a scatter", "gnncompile.ops.aggregate"),
    torch.segment_reduce: ("a segment reduction", "gnncompile.ops.aggregate"),
}
for _name in ("_sparse_mm",):
    if hasattr(torch._C._sparse, _name):  # what torch.sparse.mm traces to
        _REJECTED_FUNCS[getattr(torch._C._sparse, _name)] = ("a raw sparse matrix product", "gnncompile.ops.propagate")
_REJECTED_METHODS: dict[str, tuple[str, str]] = {
    "index_add_": ("a scatter (index_add_)", "gnncompile.ops.aggregate"),
    "index_add": ("a scatter (index_add)", "gnncompile.ops.aggregate"),
    "scatter_": ("a scatter", "gnncompile.ops.aggregate"),
    "scatter": ("a scatter", "gnncompile.ops.aggregate"),
    "scatter_add_": ("a scatter", "gnncompile.ops.aggregate"),
    "scatter_add": ("a scatter", "gnncompile.ops.aggregate"),
    "scatter_reduce_": ("a scatter", "gnncompile.ops.aggregate"),
    "scatter_reduce": ("a scatter", "gnncompile.ops.aggregate"),
    "index_put_": ("an indexed write", "gnncompile.ops.aggregate"),
    "to_sparse": ("building a sparse tensor", "gnncompile.ops.propagate"),
    "to_sparse_csr": ("building a sparse tensor", "gnncompile.ops.propagate"),
}


# Where frames are not the user's, by directory (not by a name that a checkout path may also
# contain, such as a clone in ~/src/gnncompile/): torch, and gnncompile's tracing machinery for
# the source line of a node (gnncompile's nn layers are reported: they hold the line), or all of
# gnncompile for errors raised while tracing.
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep
# PyTorch Geometric's frames are not the user's either (a PyG utility called from forward, traced
# by from_pyg): found without importing it.
_PYG_SPEC = importlib.util.find_spec("torch_geometric")
_PYG_DIRS = tuple(os.path.join(d, "") for d in (_PYG_SPEC.submodule_search_locations or [])) if _PYG_SPEC else ()
_TRACING_DIRS = (_TORCH_DIR, os.path.dirname(__file__) + os.sep, os.path.join(_PACKAGE_DIR, "ir") + os.sep) + _PYG_DIRS
_LIBRARY_DIRS = (_TORCH_DIR, _PACKAGE_DIR) + _PYG_DIRS


class _BufferProxy(torch.fx.Proxy):
    """A buffer read in forward: a graph input whose sizes, dtype and device are the buffer's (fixed
    for the model's life: ``load_state_dict`` keeps shapes), so they may steer Python code; its
    values may not (a plan would fix them at planning time), and reading one is a :class:`TraceError`
    naming the buffer."""

    def __init__(self, node: torch.fx.Node, tracer: torch.fx.proxy.TracerBase, name: str,
                 buffer: torch.Tensor) -> None:
        super().__init__(node, tracer)
        self.buffer, self.name = buffer, name

    @property
    def shape(self) -> torch.Size:
        return self.buffer.shape

    def size(self, dim: Optional[int] = None) -> Any:
        return self.buffer.size() if dim is None else self.buffer.size(dim)

    def dim(self) -> int:
        return self.buffer.dim()

    @property
    def ndim(self) -> int:
        return self.buffer.ndim

    def numel(self) -> int:
        return self.buffer.numel()

    def nelement(self) -> int:
        return self.buffer.nelement()

    def __len__(self) -> int:
        return len(self.buffer)

    @property
    def dtype(self) -> torch.dtype:
        return self.buffer.dtype

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    def _value_read(self, *_: Any) -> Any:
        raise TraceError(f"forward reads the value of the buffer {self.name!r} as a Python value (in control flow, "
                         f"int(), range() or .item()): a plan would fix it at planning time; make it a constructor "
                         f"attribute (a Python bool or int), or compute with tensor ops (torch.where)")

    __bool__ = __int__ = __index__ = __float__ = item = tolist = _value_read


class GNNTracer(torch.fx.Tracer):
    """fx tracer that records stack traces and traces through gnncompile layers.

    ``torch.nn`` modules are leaves (one node each); every other module, including gnncompile's
    layers and models, is traced through so its primitives appear in the graph.
    """

    #: a buffer read in forward is a graph input (``get_attr``), so each step reads its value then;
    #: else fx evaluates expressions of buffers alone once, at trace time, into constants
    proxy_buffer_attributes = True

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, torch.fx.Proxy]) -> Any:
        got = super().getattr(attr, attr_val, parameter_proxy_cache)
        if isinstance(got, torch.fx.Proxy) and isinstance(attr_val, torch.Tensor) \
                and not isinstance(attr_val, torch.nn.Parameter):
            return _BufferProxy(got.node, self, str(got.node.target), attr_val)
        return got

    def create_node(self, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = super().create_node(*args, **kwargs)
        if node.op in ("placeholder", "output"):
            # Created by fx around forward, not by a line of it: the nearest user frame would be
            # the caller of trace(), which would point error messages at the wrong line.
            return node
        # fx's record_stack_traces symbolizes a full traceback per node (~2 ms each); the user's
        # line is all an error message needs, and walking frames for it is cheap.
        frame = sys._getframe(1)
        while frame is not None:
            f = frame.f_code.co_filename
            if not (f.startswith(_TRACING_DIRS) or f.startswith("<")):
                code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
                node.stack_trace = f'File "{frame.f_code.co_filename}", line {frame.f_lineno}, in {frame.f_code.co_name}\n    {code}'
                break
            frame = frame.f_back
        return node

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        # torch.nn modules, and subclasses of nn.Linear (gnncompile.nn.Linear: sparse inputs)
        return (m.__module__.startswith("torch.nn") or isinstance(m, torch.nn.Linear)) and \
            not isinstance(m, torch.nn.Sequential)


# --------------------------------------------------------------------------- errors with context
def user_frame(tb: Any) -> str:
    """``file:line in fn: code`` of the innermost frame of the traceback that is user code (not
    torch, PyG or gnncompile), or ``""``."""
    best = ""
    for frame in traceback.extract_tb(tb):
        f = frame.filename
        if f.startswith(_LIBRARY_DIRS) or f.startswith("<"):
            continue
        line = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
        best = f"{frame.filename}:{frame.lineno} in {frame.name}: {line}"
    return best


_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)')


def node_source(node: torch.fx.Node) -> str:
    """``file:line in fn: code`` of the user line that created ``node`` (same form as
    :func:`user_frame`): the innermost frame of its recorded stack trace outside torch, PyG and
    gnncompile's tracing (fx's own ``record_stack_traces`` ends in fx's frames), or ``""``."""
    st = node.stack_trace or node.meta.get("stack_trace")
    if not st:
        return ""
    lines = [ln for ln in st.strip().splitlines() if ln.strip()]
    # fx stack traces end with: File "...", line N, in fn \n    code
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME_RE.search(lines[i])
        if m and not m["file"].startswith(_TRACING_DIRS):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{m['file']}:{m['line']} in {m['fn']}: {code}"
    return ""


def _trace_error(node: torch.fx.Node, what: str, fix: str) -> TraceError:
    src = node_source(node)
    where = f" at {src}" if src else ""
    return TraceError(f"node {node.name!r} ({node.op} {_target_name(node)}): {what}{where}; {fix}")


def _target_name(node: torch.fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    # __name__, not __qualname__: torch's functions have qualnames like
    # "_VariableFunctionsClass.sigmoid", which name nothing a user wrote.
    return getattr(t, "__name__", None) or getattr(t, "__qualname__", None) or repr(t)


# --------------------------------------------------------------------------- symbolic trace + checks
_GRAPH_FIX = ("pass the graph only to gnncompile.ops primitives (propagate, gather_src, gather_dst, "
              "edge_softmax, aggregate); precompute graph-derived tensors outside the model")
#: a torch tensor factory called on the line of a failed trace
_FACTORY_CALL = re.compile(r"\btorch\.(ones|zeros|empty|full|rand|randn|randint|arange|linspace|eye)\(")
#: a size read on the line of a failed trace
_SIZE_READ = re.compile(r"\.size\(|\.shape\b|\.dim\(|\.numel\(")
_DATA_DEPENDENT_FIX = ("data-dependent control flow: the model uses tensor values in Python (if, for, bool, "
                       "int), which a static operator graph cannot express; make control flow depend only on "
                       "constructor arguments, and use tensor ops such as torch.where for data-dependent choices")


def _forward_source(model: torch.nn.Module) -> str:
    """``file:line`` of the model's ``forward`` definition ('' when unknown)."""
    try:
        fn = inspect.unwrap(type(model).forward)
        return f"{inspect.getsourcefile(fn)}:{fn.__code__.co_firstlineno}"
    except (TypeError, OSError, AttributeError):
        return ""


def _check_signature(model: torch.nn.Module) -> None:
    """``forward`` must take exactly the graph and the features: ``forward(self, g, x)``."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: let fx report
        return
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(params) != 2 or any(p.kind not in positional for p in params):
        where = _forward_source(model)
        shown = ", ".join(str(p) for p in params)
        raise TraceError(
            f"{type(model).__name__}.forward({shown}){f' at {where}' if where else ''}: forward must take "
            "exactly (g, x), the graph and the node features; gnncompile models have the signature "
            "forward(self, g, x) (make other inputs constructor arguments or buffers)")


def _graph_misuse(node: torch.fx.Node, g_node: torch.fx.Node) -> Optional[str]:
    """What ``node`` does with the graph input, when that is anything but a primitive's first argument."""
    if node.op == "call_function" and is_primitive(node.target):
        if node.args and node.args[0] is g_node:
            if any(a is g_node for a in list(node.args[1:]) + list(node.kwargs.values())):
                return f"passes the graph input {_user_name(g_node)!r} as a tensor argument of {_target_name(node)}"
            return None
        first = node.args[0] if node.args else None
        shown = first.name if isinstance(first, torch.fx.Node) else repr(first)
        return (f"calls the primitive {_target_name(node)} with {shown!r} instead of the graph input "
                f"{_user_name(g_node)!r} as its first argument")
    if g_node not in node.all_input_nodes:
        return None
    if node.op == "call_function" and node.target is getattr and len(node.args) > 1:
        return f"reads the graph attribute {_user_name(g_node)}.{node.args[1]} inside forward"
    if node.op == "call_method" and node.args and node.args[0] is g_node:
        return f"calls {_user_name(g_node)}.{node.target}() inside forward"
    return (f"uses the graph input {_user_name(g_node)!r} (forward's first argument) outside a graph primitive "
            f"({node.op} {_target_name(node)})")


def _state_entries(model: torch.nn.Module) -> list[tuple[str, dict, dict]]:
    """Every module's ``(qualified name, buffer dict, a copy of it)`` (a view shares the model's dicts)."""
    return [(prefix, m._buffers, dict(m._buffers)) for prefix, m in model.named_modules()]


def _restore_buffers(state: list[tuple[str, dict, dict]]) -> list[str]:
    """Put every buffer dict back as it was (tracing a forward that assigns a buffer, ``self.b =
    self.b + 1``, stores a Proxy in the model's own dict; one that registers a buffer adds one);
    returns the qualified names of the buffers assigned or added."""
    changed = []
    for prefix, now, saved in state:
        changed += [f"{prefix}.{k}" if prefix else k for k in {**saved, **now}
                    if k not in saved or k not in now or now[k] is not saved[k]]
        now.clear()
        now.update(saved)
    return changed


def _symbolic_trace(model: torch.nn.Module) -> torch.fx.GraphModule:
    _check_signature(model)
    tracer = GNNTracer()
    state = _state_entries(model)
    try:
        graph = tracer.trace(model)
    except TraceError:
        raise
    except Exception as exc:
        raise _untraceable(model, tracer, exc) from exc
    finally:
        changed = _restore_buffers(state)
    if changed:
        # a plan runs forward per chunk and again when it recomputes: it cannot replay such updates
        raise TraceError(f"cannot trace {type(model).__name__}: forward assigns the buffer(s) {changed} "
                         f"(self.{changed[0].rsplit('.', 1)[-1]} = ... or +=, or register_buffer); a plan runs forward "
                         "once per chunk and again when it recomputes, so it cannot replay updates of the model's "
                         "state: update buffers outside forward (between steps), or keep them in a torch.nn module "
                         "(BatchNorm's statistics)")
    name = type(model).__name__
    graph = _canonical_inputs(graph)
    _out_of_place(graph, tracer.root)
    _canonical_dropouts(graph)
    gm = torch.fx.GraphModule(tracer.root, graph, name)
    return gm


def _untraceable(model: torch.nn.Module, tracer: torch.fx.Tracer, exc: Exception) -> TraceError:
    """The error of a trace that failed inside fx or user code (fx's own TraceError, or a Proxy
    misused by user code), with the likely cause and its fix."""
    # A graph attribute read is the usual cause of a failing trace (``range(g.num_nodes)``,
    # ``if g.num_nodes > k``): report it as such when the partial graph shows one.
    partial = getattr(tracer, "graph", None)
    if partial is not None:
        holders = [n for n in partial.nodes if n.op == "placeholder"]
        if holders:
            for node in partial.nodes:
                what = _graph_misuse(node, holders[0])
                if what is not None:
                    return _trace_error(node, what, _GRAPH_FIX)
    where = user_frame(exc.__traceback__)
    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    lowered = msg.lower()
    code = where.split(": ", 1)[1] if ": " in where else ""
    g_name = next(iter(inspect.signature(model.forward).parameters), "g")
    if f"{g_name}." in code:
        hint = f"; the line reads an attribute of the graph input {g_name!r}: {_GRAPH_FIX}"
    elif "item assignment" in lowered:
        hint = ("; item assignment (h[...] = v) changes a traced value in place, which the operator graph "
                "cannot express: compute the new value instead (torch.where, masked_fill, torch.cat of slices)")
    elif _FACTORY_CALL.search(code) and ("got (proxy" in lowered or "positional argument" in lowered):
        hint = ("; a torch factory (torch.ones, zeros, rand...) was given a size read from a tensor: make the "
                "tensor from one instead (h.new_ones(h.shape[0], 1), torch.ones_like(h[:, :1]))")
    elif "control flow" in lowered and _SIZE_READ.search(code):
        hint = ("; the line compares a size in Python: the features' width is a constant of the model, so take "
                "it from the constructor (in_channels), and make per-vertex choices with tensor ops "
                "(torch.where)")
    elif any(k in lowered for k in ("control flow", "iterate", "bool", "proxy", "interpreted as an integer")):
        hint = f"; {_DATA_DEPENDENT_FIX}"
    else:
        hint = ""
    return TraceError(f"cannot trace {type(model).__name__}: {msg}" + (f" at {where}" if where else "") + hint)


#: the names of forward's inputs in a traced graph, whatever the model calls them
INPUT_NAMES = ("g", "x")


def _canonical_inputs(graph: torch.fx.Graph) -> torch.fx.Graph:
    """``graph`` with its two inputs named :data:`INPUT_NAMES` (``forward(self, graph, feat)``,
    DGL's names, traces to the graph of ``forward(self, g, x)``; plans name their inputs so), the
    model's own names kept in their ``meta["user_name"]`` for messages. A graph with another
    number of inputs is returned as it is (:func:`_check` refuses it)."""
    holders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(holders) != len(INPUT_NAMES) or [p.name for p in holders] == list(INPUT_NAMES):
        return graph
    out = torch.fx.Graph(tracer_cls=getattr(graph, "_tracer_cls", None),
                         tracer_extras=getattr(graph, "_tracer_extras", None))
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for p, name in zip(holders, INPUT_NAMES):  # first: the names are theirs (a submodule x's call becomes x_1)
        env[p] = out.placeholder(name, default_value=p.args[0] if p.args else inspect.Signature.empty)
        env[p].meta = {**p.meta, "user_name": p.target}
    for n in graph.nodes:
        if n.op != "placeholder":
            env[n] = out.node_copy(n, lambda a: env[a])
    out._codegen = graph._codegen
    return out


#: ops whose result shares its input's storage (a view): an in-place change of either changes both
_VIEW_METHODS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "__getitem__", "narrow", "select", "transpose", "t", "permute",
    "squeeze", "unsqueeze", "expand", "expand_as", "flatten", "unflatten", "split", "chunk", "unbind", "diagonal",
    "as_strided", "detach", "contiguous", "movedim", "swapaxes", "T", "mT", "real", "imag"})
_VIEW_FUNCTIONS = frozenset({
    operator.getitem, torch.reshape, torch.flatten, torch.transpose, torch.narrow, torch.select, torch.squeeze,
    torch.unsqueeze, torch.split, torch.chunk, torch.unbind, torch.t, torch.permute, torch.movedim, torch.swapaxes,
    torch.detach, torch.diagonal})
#: Python's augmented assignments (in place for tensors) and their out-of-place operators
_AUGMENTED = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
              operator.itruediv: operator.truediv, operator.ifloordiv: operator.floordiv, operator.ipow: operator.pow}
#: in-place tensor methods whose namesake without ``_`` is not their out-of-place form
#: (``x.bernoulli_(p)`` draws with probability ``p``, ``x.bernoulli()`` with probabilities ``x``) or
#: that are not computations (``x.requires_grad_()``)
_NO_OUT_OF_PLACE = frozenset({"requires_grad_", "share_memory_", "retain_grad_", "bernoulli_", "resize_",
                              "as_strided_", "set_"})


def _canonical_dropouts(graph: torch.fx.Graph) -> None:
    """Rewrite ``torch.dropout(x, p, train)`` (what ``F.dropout`` calls) into ``F.dropout(x, p=p,
    training=train)``: the same function, in the form whose masks plans replicate."""
    for n in graph.nodes:
        bound = torch_dropout_arguments(n.args, n.kwargs) if n.op == "call_function" and n.target is torch.dropout \
            else None
        if bound is not None:  # (a call torch does not accept fails as written)
            n.target = F.dropout
            n.args, n.kwargs = (bound.pop("input"),), bound


def _is_view(node: torch.fx.Node) -> bool:
    return (node.op == "call_method" and node.target in _VIEW_METHODS) or \
        (node.op == "call_function" and node.target in _VIEW_FUNCTIONS)


def _state_names(module: torch.nn.Module) -> set[str]:
    """The qualified names of ``module``'s parameters and buffers (a ``get_attr`` of another name is
    a constant fx made of a tensor built in forward)."""
    return {n for n, _ in itertools.chain(module.named_parameters(), module.named_buffers())}


def _changed_attribute(node: torch.fx.Node, modules: dict[str, torch.nn.Module],
                       state: set[str]) -> Optional[torch.fx.Node]:
    """The ``get_attr`` node of a parameter or buffer (of the names ``state``) that ``node``
    changes in place, directly or through views, ``.data`` or ``detach()``, else None (a batch
    norm's running statistics, ``F.batch_norm`` as ``nn.BatchNorm``, are the op's own state: exact
    plans refuse their statistics over all vertices, relaxed ones record them)."""
    return _state_root(node.args[0] if _changes_first_argument(node, modules) and node.args else None, state)


def _changes_first_argument(node: torch.fx.Node, modules: dict[str, torch.nn.Module]) -> bool:
    """Whether ``node`` is an in-place op, changing its first argument: a tensor method ending in
    ``_``, an augmented assignment (``h += r``), a torch function ending in ``_``, a call with
    ``inplace=True``, or a module (of ``modules``) whose ``inplace`` is set."""
    if node.op == "call_method":
        return isinstance(node.target, str) and node.target.endswith("_") and not node.target.startswith("_") \
            and node.target not in ("requires_grad_", "share_memory_")
    if node.op == "call_function":
        return node.target in _AUGMENTED or node.kwargs.get("inplace") is True or (
            getattr(node.target, "__name__", "").endswith("_")
            and getattr(node.target, "__module__", None) in ("torch", "torch._C._VariableFunctions"))
    return node.op == "call_module" and getattr(modules.get(node.target), "inplace", False) is True


def _state_root(value: Any, state: set[str]) -> Optional[torch.fx.Node]:
    """The ``get_attr`` node of a parameter or buffer (of the names ``state``) whose storage
    ``value`` shares (itself, a view, its ``.data`` or ``detach()``), else None."""
    while isinstance(value, torch.fx.Node) and (
            _is_view(value) or (value.op == "call_method" and value.target == "detach")
            or (value.op == "call_function" and value.target is getattr and value.args[1:] == ("data",))):
        value = value.args[0] if value.args else None
    found = isinstance(value, torch.fx.Node) and value.op == "get_attr" and value.target in state
    return value if found else None


def _out_of_place(graph: torch.fx.Graph, root: torch.nn.Module) -> None:
    """Rewrite in-place ops on computed values into their out-of-place forms (``h.relu_()`` ->
    ``relu(h)``, ``h += r`` -> ``h + r``, ``F.relu(h, inplace=True)``), every later reader of the
    changed value reading the new one: the function is the same, and a value no longer changes
    after it is made, so a plan may cut the graph between the change and a reader (a stage's input
    is a leaf of autograd, which refuses in-place changes). Changes through views, of views, of a
    value a view was taken of, of the model's inputs, parameters and buffers stay as written (a
    tensor made in forward, which fx keeps as a constant, is a computed value: eager code makes it
    afresh at each call)."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    modules = dict(root.named_modules())
    state = _state_names(root)
    for n in list(graph.nodes):
        if not _changes_first_argument(n, modules):
            continue
        target: Any = None
        kwargs = dict(n.kwargs)
        if n.op == "call_method":
            if n.target in _NO_OUT_OF_PLACE or not hasattr(torch.Tensor, n.target[:-1]):
                continue
            target = n.target[:-1]
        elif n.op == "call_function" and n.target in _AUGMENTED:
            target = _AUGMENTED[n.target]
        elif n.op == "call_function" and kwargs.get("inplace") is not True:  # torch.relu_ -> torch.relu
            target = getattr(torch, n.target.__name__[:-1], None)
            if not callable(target):
                continue
        elif n.op == "call_function":
            target = n.target
            kwargs["inplace"] = False
        changed = n.args[0] if n.args else None
        if not isinstance(changed, torch.fx.Node) or changed.op == "placeholder" \
                or _state_root(changed, state) is not None \
                or _is_view(changed) or any(_is_view(u) for u in changed.users):
            continue
        if n.op == "call_module":  # the traced graph's modules are its own copies (_module_view)
            modules[n.target].inplace = False
        else:
            n.target, n.kwargs = target, kwargs
        for u in list(changed.users):
            if u is not n and order[u] > order[n]:
                u.replace_input_with(changed, n)
    graph.lint()


def _user_name(node: torch.fx.Node) -> str:
    """The model's own name of the input ``node`` (:func:`_canonical_inputs`)."""
    return node.meta.get("user_name", node.name)


def _check(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != 2:
        raise TraceError(
            f"forward must take (g, x): found inputs {[p.name for p in placeholders]}; "
            "gnncompile models have the signature forward(self, g, x)"
        )
    g_node = placeholders[0]
    for node in gm.graph.nodes:
        what = _graph_misuse(node, g_node)
        if what is not None:
            raise _trace_error(node, what, _GRAPH_FIX)
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _REJECTED_FUNCS:
            what, fix = _REJECTED_FUNCS[node.target]
            raise _trace_error(node, f"{what} cannot be classified as T/P/E work", f"use {fix}")
        if node.op == "call_method" and node.target in _REJECTED_METHODS:
            what, fix = _REJECTED_METHODS[node.target]
            raise _trace_error(node, f"{what} cannot be classified as T/P/E work", f"use {fix}")
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _fetch_attr(gm, node.target)
            if isinstance(value, torch.Tensor) and value.layout != torch.strided:
                users = ", ".join(u.name for u in node.users) or "nothing"
                raise _trace_error(
                    next(iter(node.users), node),
                    f"the sparse tensor attribute {node.target!r} (a precomputed adjacency?) is used by "
                    f"{users}; sparse products cannot be classified as T/P/E work",
                    "use gnncompile.ops.propagate with the graph input instead")
    modules, state = dict(model.named_modules()), _state_names(model)
    for node in gm.graph.nodes:
        root = _changed_attribute(node, modules, state)
        if root is not None:
            value = _fetch_attr(gm, root.target)
            kind = "parameter" if isinstance(value, torch.nn.Parameter) else "buffer"
            raise _trace_error(node, f"changes the model's {kind} {root.target!r} in place", (
                "a plan runs forward once per chunk and again when it recomputes, so it cannot replay updates "
                "of the model's state: update it outside forward (between steps), or compute a new value"))
    outputs = [n for n in gm.graph.nodes if n.op == "output"]
    result = outputs[0].args[0] if len(outputs) == 1 else None
    if len(outputs) != 1 or not isinstance(result, torch.fx.Node):
        where = _forward_source(model)
        if isinstance(result, (tuple, list)):
            got = f"a {type(result).__name__} of {len(result)} values"
        elif isinstance(result, dict):
            got = f"a dict with keys {sorted(map(str, result))}"
        else:
            got = f"{type(result).__name__} {result!r}"
        raise TraceError(
            f"{type(model).__name__}.forward{f' (defined at {where})' if where else ''} returns {got}: "
            "forward must return a single [N, C] tensor of logits (return extra values from a separate method)")


def _fetch_attr(gm: torch.nn.Module, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


# --------------------------------------------------------------------------- sample graphs
def _sample_graph(n: int, e: int, seed: int) -> Graph:
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n, (e,), generator=gen)
    dst = torch.randint(0, n, (e,), generator=gen)
    return Graph.from_edge_index(torch.stack([src, dst]), n, name=f"sample-{n}-{e}")


def _sample_input(x_like: Optional[torch.Tensor], n: int, f: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, f, generator=gen, dtype=dtype)
    if x_like is not None and x_like.layout == torch.sparse_csr:
        # Sparse features: every sample row gets the real graph's mean number of non-zeros
        # (rounded), so their costs stay linear in |V|.
        k = min(f, max(1, round(x_like._nnz() / max(1, x_like.shape[0]))))
        cols = torch.argsort(torch.rand(n, f, generator=gen), dim=1)[:, :k].sort(dim=1).values
        crow = torch.arange(0, n * k + 1, k, dtype=torch.int64)
        x = torch.sparse_csr_tensor(crow, cols.reshape(-1), x[:, :k].reshape(-1), size=(n, f),
                                    check_invariants=False)
    return x


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        if t.layout != torch.strided:
            return sum(_nbytes(p) for p in (t.values(),))
        return t.numel() * t.element_size()
    if isinstance(t, (tuple, list)):
        return sum(_nbytes(v) for v in t)
    return 0


def _numel(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() if t.layout == torch.strided else t._nnz()
    if isinstance(t, (tuple, list)):
        return sum(_numel(v) for v in t)
    return 0


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    try:
        st = t.untyped_storage()
        return st.data_ptr(), st.nbytes()
    except (RuntimeError, NotImplementedError):  # sparse or other storage-less tensors
        return id(t), _nbytes(t)


def _graph_tensors(g: Graph) -> set[int]:
    """data_ptrs of every tensor cached on a graph (structure, norms...), excluded from activations."""
    out: set[int] = set()

    def visit(v: Any) -> None:
        if isinstance(v, torch.Tensor):
            if v.layout == torch.strided:
                out.add(v.untyped_storage().data_ptr())
        elif isinstance(v, (tuple, list)):
            for w in v:
                visit(w)
        elif isinstance(v, dict):
            for w in v.values():
                visit(w)
        elif isinstance(v, Graph):
            visit(v.__dict__)
        elif hasattr(v, "__dict__") and not isinstance(v, type):
            visit(vars(v))

    visit(g.__dict__)
    return out


def _leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of a node's value (itself, or those in its containers)."""
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


#: tensor methods making a new tensor of their arguments, taking only the dtype and device of the
#: tensor they are called on
_NEW_TENSOR_METHODS = frozenset({"new_ones", "new_zeros", "new_empty", "new_full", "new_tensor"})


def _row_mixing(node: torch.fx.Node, rows: Optional[Lin], samples: list, probe: torch.fx.Interpreter,
                values: dict[str, Any]) -> str:
    """Why the output rows of the (non-primitive) op ``node`` depend on other rows of an input on the
    vertices' or edges' rows, or ``""`` (the :attr:`~gnncompile.ir.tpgraph.TPInfo.mixes_rows` of
    the trace): its output is not on those rows (a reduction, slice or index over dim 0), it reads
    how many there are (a value that differs between the sample graphs), or it was found mixing
    rows on the first sample (:func:`_mixes_rows`). Reading other sizes (``h.shape[1:]``) is not."""
    space = rows.space if rows is not None else "-"
    out = values[node.name]
    if not _leaves(out):    # sizes, dtypes...: judged where a tensor is made of them
        return ""
    inputs = node.all_input_nodes
    if node.op == "call_method" and node.target in _NEW_TENSOR_METHODS:
        inputs = [a for a in inputs if a is not node.args[0]]  # (h.new_ones: h gives only its dtype and device)
    spaces = {a.meta["tp"].space for a in inputs if "tp" in a.meta} & _SAMPLE_ROWS.keys()
    # inputs other than tensors (sizes, scalars) whose values differ between the sample graphs: made
    # from the number of vertices or edges
    sized = [values[a.name] for a in node.all_input_nodes if not _leaves(values[a.name])
             and not all(_same(rec[a.name]["out"], values[a.name]) for _, _, rec in samples[1:])]
    if not spaces:
        if space in _SAMPLE_ROWS and sized and not all(torch.equal(t, t[:1].expand_as(t)) for t in _leaves(out)):
            name = _ROW_NAMES[space]
            return (f"makes values that differ between the {name} from their number (as torch.arange over the "
                    f"{name}): a rank holds only its own {name}, numbered from 0")
        return ""
    name = _ROW_NAMES["V" if "V" in spaces else "E"]
    if space not in _SAMPLE_ROWS:
        if _stacks_on_dim0(node):
            return (f"stacks values on the {name} along dim 0, which puts the {name} on dim 1: a rank holds only "
                    f"its own {name}, on dim 0; stack along dim=-1 and reduce over dim=-1 instead (as PyG's "
                    f"JumpingKnowledge does)")
        return f"takes its output rows from the {name} as a whole (output rows {space}: a reduction, slice or " \
               f"index over dim 0)"
    n0, e0, _ = samples[0]
    counts = {rows(n0, e0) for rows in _SAMPLE_ROWS.values()}
    # a number made from the row count enters the values (h / x.size(0)); as a row count it is
    # a shape (h.view(x.size(0), -1)), except in an elementwise op
    scalars = [v for v in sized if _elementwise(node, probe) or not (isinstance(v, int) and v in counts)]
    if scalars:
        return (f"reads the number of {name} ({scalars[0]!r} on one sample graph, another on graphs of other "
                f"sizes): a rank holds only its own {name}")
    row_inputs = {a.name for a in node.all_input_nodes if "tp" in a.meta and a.meta["tp"].space == space}
    if not row_inputs or _elementwise(node, probe):
        return ""
    return _mixes_rows(probe, node, values, _SAMPLE_ROWS[space](n0, e0), row_inputs, _ROW_NAMES[space])


def _stacks_on_dim0(node: torch.fx.Node) -> bool:
    """Whether ``node`` is ``torch.stack(values, dim=0)`` (the default dim)."""
    if node.op != "call_function" or node.target is not torch.stack:
        return False
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
    return dim == 0


#: functions, tensor methods and modules whose output elements each depend on the inputs' elements
#: at the same position (after broadcasting) alone: row-local whatever their inputs, so
#: :func:`_row_mixing` does not run them again (dropout's mask is drawn by position too)
_ELEMENTWISE_FUNCTIONS = frozenset({
    operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.pow, operator.iadd,
    operator.isub, operator.imul, operator.itruediv, torch.add, torch.sub, torch.mul, torch.div, torch.neg,
    torch.exp, torch.log, torch.sqrt, torch.rsqrt, torch.abs, torch.relu, torch.sigmoid, torch.tanh, torch.clamp,
    torch.pow, F.relu, F.elu, F.leaky_relu, F.gelu, F.silu, F.sigmoid, F.tanh, F.softplus, F.dropout})
_ELEMENTWISE_METHODS = frozenset({
    "add", "sub", "mul", "div", "neg", "exp", "log", "sqrt", "rsqrt", "abs", "relu", "sigmoid", "tanh", "clamp",
    "pow", "add_", "sub_", "mul_", "div_", "relu_", "clamp_", "float", "double", "to", "type_as", "contiguous",
    "clone", "detach"})
_ELEMENTWISE_MODULES = (torch.nn.ReLU, torch.nn.ELU, torch.nn.LeakyReLU, torch.nn.GELU, torch.nn.SiLU, torch.nn.Sigmoid,
                        torch.nn.Tanh, torch.nn.Dropout, torch.nn.Identity)


def _elementwise(node: torch.fx.Node, probe: torch.fx.Interpreter) -> bool:
    """Whether ``node`` calls an elementwise function, method or module of ``probe``'s module (an
    input on other rows than the output's could only broadcast along a feature dimension as long
    as the vertex count, which differs between the sample graphs: it does not trace)."""
    if node.op == "call_function":
        return node.target in _ELEMENTWISE_FUNCTIONS
    if node.op == "call_method":
        return node.target in _ELEMENTWISE_METHODS
    return node.op == "call_module" and type(probe.module.get_submodule(node.target)) in _ELEMENTWISE_MODULES


#: row counts of a sample graph with ``n`` vertices and ``e`` edges, by row space
_SAMPLE_ROWS: dict[str, Callable[[int, int], int]] = {"V": lambda n, e: n, "E": lambda n, e: e, "E+V": lambda n, e: n + e}
#: what the rows of each row space are, in messages
_ROW_NAMES = {"V": "vertices", "E": "edges", "E+V": "edges"}


def _mixes_rows(interp: torch.fx.Interpreter, n: torch.fx.Node, values: dict[str, Any], rows: int,
                row_inputs: set[str], name: str) -> str:
    """Why call node ``n``'s output rows depend on other rows of its input, or ``""``.

    ``values``: every node's value on a sample graph; ``rows``: the row count of ``n``'s output
    there; ``row_inputs``: the inputs of ``n`` on the same rows (vertices or edges: ``name``). About
    half of those rows (a fixed random half) get other values in every such input, and the node runs
    on copies of its inputs as it does on unchanged copies, drawing the same random numbers: a
    row-local op (linear layers, activations, dropout, a softmax over features) then changes only
    those rows of its output; a normalization over the vertices, a sort, roll or cumulative sum
    over dim 0 changes the others too."""
    changed = torch.rand(rows, generator=torch.Generator().manual_seed(rows)) < 0.5
    changed[0], changed[-1] = True, False   # (neither no row nor every row)

    def copies(perturb: bool) -> tuple[Any, Any]:
        def one(a: torch.fx.Node) -> Any:
            v = torch.fx.node.map_aggregate(values[a.name], lambda t: t.detach().clone() if isinstance(
                t, torch.Tensor) and t.layout == torch.strided else t)   # (in-place ops change their copy)
            if perturb and a.name in row_inputs and isinstance(v, torch.Tensor) and v.is_floating_point():
                v[changed] = v[changed] * -3.0 + 1.5
            return v
        return torch.fx.node.map_arg((n.args, n.kwargs), one)

    runs = []
    state = torch.get_rng_state()   # both runs draw the same random numbers (restored after)
    try:
        for perturb in (False, True):
            args, kwargs = copies(perturb)
            torch.set_rng_state(state)
            with torch.no_grad():
                runs.append([t for t in _leaves(getattr(interp, n.op)(n.target, args, kwargs))
                             if t.layout == torch.strided and t.dim() > 0 and t.shape[0] == rows])
    except Exception:   # (an op that rejects the changed values: not probed)
        return ""
    finally:
        torch.set_rng_state(state)
    for before, after in zip(*runs):
        if before.shape != after.shape:
            return f"mixes {name}: changing some {name}' input rows changed its output's shape"
        b, a = before[~changed], after[~changed]
        if b.is_floating_point():
            scale = 1.0 + (float(b.abs().nan_to_num(0.0, 0.0, 0.0).max()) if b.numel() else 0.0)
            same = torch.allclose(b, a, rtol=1e-4, atol=1e-5 * scale, equal_nan=True)
        else:
            same = torch.equal(b, a)
        if not same:
            return f"mixes {name}: changing some {name}' input rows changed other {name}' output rows"
    return ""


class _Measure(torch.fx.Interpreter):
    """Runs the module node by node, recording shapes, costs and saved-for-backward bytes."""

    def __init__(self, gm: torch.fx.GraphModule, exclude: set[int]) -> None:
        super().__init__(gm)
        self.exclude = exclude
        self.seen: set[int] = set(exclude)
        self.records: dict[str, dict[str, Any]] = {}
        self.modules = dict(gm.named_modules())
        self.owner: dict[int, str] = {}  # storage -> the node whose value first held it

    def run_node(self, n: torch.fx.Node) -> Any:
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = super().run_node(n)
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor):
                self.owner.setdefault(_storage_key(t)[0], n.name)
        new_bytes = 0
        saves: set[str] = set()
        for t in saved:
            key = _storage_key(t)
            if key[0] in self.owner:
                saves.add(self.owner[key[0]])
            if key[0] in self.seen:
                continue
            self.seen.add(key[0])
            new_bytes += key[1]
        args = [a for a in n.all_input_nodes]
        in_vals = [self.env[a] for a in args if a in self.env]
        self.records[n.name] = {
            "out": result,
            "saved": new_bytes,
            "saves": tuple(sorted(saves)),
            "cost": _cost(n, result, in_vals, self.modules, self.env),
        }
        return result


@functools.lru_cache(maxsize=None)
def _param_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return ()


def _primitive_flag(node: torch.fx.Node, name: str, default: Any) -> Any:
    """Argument ``name`` of a primitive call, given by keyword or by position (or its default)."""
    if name in node.kwargs:
        return node.kwargs[name]
    params = _param_names(node.target)
    pos = params.index(name) if name in params else -1
    return node.args[pos] if 0 <= pos < len(node.args) else default


def _rows_of(t: Any) -> Optional[int]:
    """First dimension of a tensor output; of a tuple/list output (``max(dim)``, ``split``), the
    first dimension its tensors share (``None`` when they differ, e.g. an LSTM's ``(out, (h, c))``)."""
    if isinstance(t, torch.Tensor):
        return int(t.shape[0]) if t.dim() >= 1 else None
    if isinstance(t, (tuple, list)) and t:
        rows = {_rows_of(v) if isinstance(v, (torch.Tensor, tuple, list)) else None for v in t}
        return rows.pop() if len(rows) == 1 else None
    return None


def _cost(node: torch.fx.Node, out: Any, ins: list[Any], modules: dict[str, torch.nn.Module],
          env: dict) -> tuple[int, int, int]:
    """(flops, bytes_read, bytes_written) of one node on concrete sample values."""
    if node.op in ("placeholder", "get_attr", "output"):
        return 0, 0, 0
    written = _nbytes(out)
    read = sum(_nbytes(v) for v in ins if not isinstance(v, Graph))
    target = node.target
    if node.op == "call_function" and is_primitive(target):
        g = node.args[0]
        graph = env.get(g) if isinstance(g, torch.fx.Node) else g
        name = getattr(target, "__name__", "")
        loops = bool(_primitive_flag(node, "add_self_loops", False))
        n_v = graph.num_nodes
        n_e = graph.num_edges + (n_v if loops else 0)
        x = env.get(node.args[1]) if isinstance(node.args[1], torch.fx.Node) else node.args[1]
        s = x.element_size() if isinstance(x, torch.Tensor) else 4
        if target.__gnncompile_kind__ == "P":  # propagate and its variants (masked_propagate)
            d = 1
            for k in x.shape[1:]:
                d *= int(k)
            # Eq. 6: E'(1 + 2d) + V elements in all; read = index/value + gathered rows + indptr,
            # written = one accumulation per edge element.
            return 2 * n_e * d, (n_e * (1 + d) + n_v) * s, n_e * d * s
        if name in ("gather_src", "gather_dst"):
            return 0, written + 8 * n_e, written
        if name == "edge_softmax":
            return 5 * _numel(out), 2 * written, written
        if name == "edge_attention":
            return 8 * _numel(out), 4 * written + 4 * n_e, 3 * written
        if name == "aggregate":
            return _numel(ins[1]) if len(ins) > 1 else _numel(out), read, written
        return _numel(out), read, written
    module = modules.get(target) if node.op == "call_module" else None
    # a function marked ``__gnncompile_linear__`` computes ``F.linear`` (gnncompile.nn.functional.linear)
    linear_fn = target is F.linear or getattr(target, "__gnncompile_linear__", False)
    is_gemm = isinstance(module, _GEMM_MODULES) or (
        node.op == "call_function" and (target in _GEMM_FUNCS or linear_fn)) or (
        node.op == "call_method" and target in ("matmul", "mm"))
    if is_gemm and isinstance(out, torch.Tensor):
        if module is not None and isinstance(module, torch.nn.Linear):
            d_in = module.in_features
            read += module.weight.numel() * module.weight.element_size()
        else:
            a = ins[1] if target is torch.addmm and len(ins) > 1 else (ins[0] if ins else None)
            d_in = int(a.shape[-1]) if isinstance(a, torch.Tensor) and a.dim() else 1
        if module is not None:
            has_bias = getattr(module, "bias", None) is not None
        elif linear_fn:
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            has_bias = bias is not None
        else:
            has_bias = target is torch.addmm
        x_in = ins[0] if ins else None
        if isinstance(x_in, torch.Tensor) and x_in.layout != torch.strided and x_in.dim() == 2 and x_in.shape[0]:
            # a sparse input row multiplies only its non-zeros (sparse features: bag-of-words rows),
            # each gathering a row of the weight
            d_in = x_in._nnz() // x_in.shape[0]
            read += x_in._nnz() * _numel(out) // max(1, x_in.shape[0]) * out.element_size()
        flops = 2 * _numel(out) * d_in + (_numel(out) if has_bias else 0)
        return flops, read, written
    if isinstance(module, _NORM_MODULES) or (node.op == "call_function" and target in _NORM_FUNCS):
        return 5 * _numel(out), read, written
    return _numel(out), read, written


# --------------------------------------------------------------------------- layers
def _layers(gm: torch.fx.GraphModule) -> dict[str, int]:
    depth: dict[str, int] = {}
    for n in gm.graph.nodes:
        d = max((depth[a.name] for a in n.all_input_nodes), default=0)
        depth[n.name] = d + 1 if ends_layer(n) else d
    return {n.name: depth[n.name] if ends_layer(n) else depth[n.name] + 1 for n in gm.graph.nodes}


def _op_label(node: torch.fx.Node, modules: dict[str, torch.nn.Module]) -> str:
    if node.op == "call_module":
        return type(modules[node.target]).__name__
    if node.op in ("call_function", "call_method"):
        return _target_name(node)
    return node.op


# --------------------------------------------------------------------------- training and eval mode
# Parameters through which a functional op receives the module's mode (F.dropout & co.,
# gnncompile.nn.functional.feature_dropout: ``training``; F.instance_norm: ``use_input_stats``).
_MODE_PARAMETERS = ("training", "use_input_stats")


@dataclass(frozen=True)
class ModeDifference:
    """How a model's eval-mode graph differs from its training-mode graph.

    ``kind``: ``"none"`` (the same graph), ``"flags"`` (the same ops; only the mode arguments of
    ``flag_nodes``, e.g. dropout's ``training``, differ) or ``"graph"`` (different ops or other
    arguments). ``where`` describes the first difference with the user's line.
    """

    kind: str
    flag_nodes: tuple[str, ...] = ()
    where: str = ""

    def note(self) -> str:
        """One line for the table header (what eval mode does differently)."""
        if self.kind == "flags":
            return f"the same ops with their mode argument (training=False) in {', '.join(self.flag_nodes)}"
        if self.kind == "graph":
            return f"a different graph (first difference: {self.where})"
        return ""


def bound_arguments(node: torch.fx.Node) -> Optional[dict[str, Any]]:
    """A ``call_function`` node's arguments by parameter name, defaults applied (``None`` when its
    target has no inspectable signature or the node is not a function call)."""
    if node.op != "call_function":
        return None
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    bound.apply_defaults()
    return dict(bound.arguments)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # tensors among the constants: no elementwise truth value
        return a is b


def _describe_node(node: torch.fx.Node) -> str:
    src = node_source(node)
    return f"{node.op} {_target_name(node)} ({node.name})" + (f" at {src}" if src else "")


def mode_difference(train: torch.fx.Graph, evalg: torch.fx.Graph,
                    labels: tuple[str, str] = ("training mode", "eval mode")) -> ModeDifference:
    """Compare two traces of one forward node by node (same position, op, target and arguments);
    ``labels`` name the two traces in ``where``."""
    mapping: dict[torch.fx.Node, torch.fx.Node] = {}
    flags: list[str] = []
    first_flag = ""
    for t, e in itertools.zip_longest(train.nodes, evalg.nodes):
        if t is None or e is None or (t.op, t.target) != (e.op, e.target):
            return ModeDifference("graph", where=f"{labels[0]} runs {_describe_node(t) if t else 'nothing more'}, "
                                                 f"{labels[1]} runs {_describe_node(e) if e else 'nothing more'}")
        mapping[t] = e
        t_args = torch.fx.node.map_arg(t.args, lambda n: mapping[n])
        t_kwargs = torch.fx.node.map_arg(t.kwargs, lambda n: mapping[n])
        if _same(t_args, e.args) and _same(t_kwargs, e.kwargs):
            continue
        tb, eb = bound_arguments(t), bound_arguments(e)
        differing = [] if tb is None or eb is None else \
            [k for k in tb if not _same(torch.fx.node.map_arg(tb[k], lambda n: mapping[n]), eb.get(k))]
        if differing and all(k in _MODE_PARAMETERS and isinstance(tb[k], bool) and isinstance(eb[k], bool)
                             for k in differing):
            if not flags:
                k = differing[0]
                first_flag = f"{_describe_node(t)} has {k}={tb[k]} in {labels[0]}, {k}={eb[k]} in {labels[1]}"
            flags.append(t.name)
            continue
        shown = f"arguments {differing}" if differing else "arguments"
        return ModeDifference("graph", where=f"{_describe_node(t)} has {shown} that differ between "
                                             f"{labels[0]} and {labels[1]}")
    return ModeDifference("flags", tuple(flags), first_flag) if flags else ModeDifference("none")


def _mixed_mode_check(model: torch.nn.Module, reference: torch.fx.GraphModule) -> None:
    """Refuse a model whose traced-through submodules are in another mode than the model, when that
    changes the graph: ``tp.train()``/``tp.eval()`` can only represent the model in one mode."""
    tracer = GNNTracer()
    odd = [name for name, m in model.named_modules()
           if name and m.training != model.training and not tracer.is_leaf_module(m, name)]
    if not odd:
        return
    as_is = _symbolic_trace(_module_view(model))  # every module in its own current mode
    diff = mode_difference(reference.graph, as_is.graph, ("the model's mode", "the submodules' own modes"))
    if diff.kind == "none":
        return
    mode, other = ("training", "eval") if model.training else ("eval", "training")
    raise TraceError(
        f"{type(model).__name__} is in {mode} mode but its submodule(s) {', '.join(odd)} are in {other} mode, and "
        f"that changes what forward computes (first difference: {diff.where}); a traced graph runs "
        "the whole model in training or in eval mode (tp.train()/tp.eval()): put the model in one mode before "
        "tracing (model.train() or model.eval()); torch.nn leaf modules such as BatchNorm may keep a mode of "
        "their own")


# --------------------------------------------------------------------------- public entry point
def trace(model: torch.nn.Module, graph_or_stats: Union[Graph, GraphStats], *, training: Optional[bool] = None,
          dtype: Optional[torch.dtype] = None) -> TPGraph:
    """Trace ``model`` into an annotated :class:`~gnncompile.ir.tpgraph.TPGraph`.

    Parameters
    ----------
    model:
        A module with ``forward(self, g, x)`` written with :mod:`gnncompile.ops` and torch.
    graph_or_stats:
        The graph to train on, or just its :class:`GraphStats` (annotations are evaluated for
        these sizes; nothing proportional to the graph is allocated).
    training:
        ``None`` (default): a graph that follows ``.train()``/``.eval()`` like the model: the
        forward is traced in both modes; ``tp.graph`` (and every annotation) is the training-mode
        graph, and ``tp.eval_graph`` the eval-mode graph where it differs (see the module
        docstring). ``tp`` starts in the model's modes. ``True``/``False``: trace that mode only
        (what the planner lowers: training steps and evaluation); mode constants such as
        dropout's ``training`` flag are frozen, and calling the graph in the other mode raises.
    dtype:
        Floating dtype of the sample features (element sizes in the byte counts). Default: the
        dtype of the model's first floating parameter or buffer, else the graph's features, else
        ``float32``.

    The returned graph shares the model's parameters and buffers (training it trains the model)
    but not its module objects: it holds shallow copies of them (see :func:`_module_view`), so
    its modes are its own. Tracing leaves ``model`` as it found it: its modes are untouched and
    its buffers (BatchNorm running statistics) are restored after the sample runs.

    Raises
    ------
    TraceError
        For data-dependent control flow, graph attribute reads inside forward, ops that cannot be
        classified (raw sparse products, scatters), a forward that does not return one tensor, a
        forward that cannot be traced in one of the modes, or submodules in a mode other than
        the model's that change the graph (all naming the user's line).
    """
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"trace expects a torch.nn.Module, got {type(model).__name__}")
    if training is not None and not isinstance(training, bool):
        raise TraceError(f"trace: training must be None (follow the mode), True or False; got {training!r}")
    if isinstance(graph_or_stats, Graph):
        stats = GraphStats.from_graph(graph_or_stats)
        x_like = graph_or_stats.x
    elif isinstance(graph_or_stats, GraphStats):
        stats, x_like = graph_or_stats, None
    else:
        raise TraceError(f"trace expects a Graph or GraphStats, got {type(graph_or_stats).__name__}")

    if dtype is None:
        dtype = _default_dtype(model, x_like)
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        if training is None:
            return _trace_both_modes(model, stats, x_like, dtype)
        view = _module_view(model)
        view.train(training)
        gm = _symbolic_trace(view)
        _check(gm, model)
        tp = _annotate(model, gm, stats, x_like, training, dtype)
        tp.specialized = training
        return tp
    finally:
        with torch.no_grad():
            for b, value in buffers:
                b.copy_(value)


def _trace_both_modes(model: torch.nn.Module, stats: GraphStats, x_like: Optional[torch.Tensor],
                      dtype: torch.dtype) -> TPGraph:
    """The mode-following TPGraph: training graph, plus the eval graph where it differs."""
    view = _module_view(model)
    graphs: dict[bool, torch.fx.GraphModule] = {}
    for mode in (model.training, not model.training):  # the model's own mode first: its errors come first
        view.train(mode)
        try:
            gm = _symbolic_trace(view)
            _check(gm, model)
        except TraceError as exc:
            if mode == model.training:
                raise
            raise TraceError(f"in {'training' if mode else 'eval'} mode (the model is traced in both modes, so "
                             f"that tp.train()/tp.eval() run it like the model): {exc}") from exc
        graphs[mode] = gm
    _mixed_mode_check(model, graphs[model.training])
    diff = mode_difference(graphs[True].graph, graphs[False].graph)
    view.train(True)
    tp = _annotate(model, graphs[True], stats, x_like, True, dtype)
    if diff.kind != "none":
        view.train(False)
        tp_eval = _annotate(model, graphs[False], stats, x_like, False, dtype)
        tp_eval.specialized = False
        tp.set_eval_graph(tp_eval, diff.note())
    # start in the model's modes, module by module (the two graphs share their submodules)
    modes = {name: m.training for name, m in model.named_modules()}
    for name, m in tp.named_modules():
        m.training = modes.get(name, model.training)
    return tp


def _module_view(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module``'s hierarchy sharing its parameters and buffers, with modes of its own.

    Each module is copied shallowly (its parameter and buffer dicts are the same objects, so
    parameters, gradients and in-place buffer updates are shared), and its children are replaced
    by their views. The traced graph can then be put in training mode without flipping the
    modes of the caller's model, whose submodules it would otherwise share.
    """
    view = copy.copy(module)
    view.__dict__["_modules"] = {k: None if c is None else _module_view(c) for k, c in module._modules.items()}
    view.training = module.training
    return view


def _default_dtype(model: torch.nn.Module, x_like: Optional[torch.Tensor]) -> torch.dtype:
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_floating_point():
            return t.dtype
    if x_like is not None and x_like.is_floating_point():
        return x_like.dtype
    return torch.float32


def _annotate(model: torch.nn.Module, gm: torch.fx.GraphModule, stats: GraphStats,
              x_like: Optional[torch.Tensor], training: bool, dtype: torch.dtype) -> TPGraph:
    """Run ``gm`` on the sample graphs and attach a :class:`TPInfo` to every node."""
    modules = dict(gm.named_modules())

    # Run on the sample graphs (no RNG side effects for the caller), on one thread: the ops are
    # tiny, and on a busy machine every parallel region of every op waits for a descheduled
    # worker (a 64-layer model went from 0.5 s to 3-12 s with two threads and a neighbour).
    samples: list[tuple[int, int, dict[str, dict[str, Any]]]] = []
    with torch.random.fork_rng(devices=[]), torch_threads(1):
        torch.manual_seed(0)
        for i, (n, e) in enumerate(SAMPLE_SIZES):
            g = _sample_graph(n, e, seed=i)
            x = _sample_input(x_like, n, stats.num_features, seed=i, dtype=dtype)
            try:
                with torch.no_grad():
                    # warm the graph's caches so they are not counted as activations (forward itself:
                    # the module's __call__ prints fx's own traceback of a failure to stderr)
                    gm.forward(g, x)
                exclude = _graph_tensors(g) | {p.untyped_storage().data_ptr() for p in gm.parameters()}
                exclude |= {b.untyped_storage().data_ptr() for b in gm.buffers()}
                exclude.add(_storage_key(x)[0])
                meas = _Measure(gm, exclude)
                with torch.enable_grad():
                    meas.run(g, x)
            except TraceError:
                raise
            except Exception as exc:
                hint = ""
                held = list(itertools.chain(model.named_parameters(), model.named_buffers()))
                per_vertex = [f"{name}: {list(t.shape)}" for name, t in held if t.dim() and t.shape[0] == stats.num_nodes > n]
                per_edge = [f"{name}: {list(t.shape)}" for name, t in held if t.dim() and t.shape[0] == stats.num_edges > e]
                if per_vertex:
                    hint = (f"; the model holds a row per vertex of the graph ({', '.join(per_vertex)}): per-vertex "
                            "parameters and buffers are not supported (a plan gives each rank its own vertices, and "
                            "the tracer runs the model on small sample graphs); feed such values as input features, "
                            "or compute them from the features")
                elif per_edge:
                    hint = (f"; the model holds a row per edge of the graph ({', '.join(per_edge)}): per-edge "
                            "parameters and buffers are not supported (a plan gives each rank its own edges, and "
                            "the tracer runs the model on small sample graphs); compute edge values from the "
                            "endpoints' features (ops.gather_src / gather_dst), or pass fixed ones as the graph's "
                            "edge_weight")
                elif stats.num_features == 0:
                    hint = ("; the graph has no node features (num_features=0): trace with a Graph that has "
                            "x, or with GraphStats(num_features=...)")
                raise TraceError(
                    f"running {type(model).__name__} on a sample graph (|V|={n}, |E|={e}, "
                    f"{stats.num_features} features, {dtype}) failed: {type(exc).__name__}: {exc}{hint}"
                ) from exc
            samples.append((n, e, meas.records))

    def lin(getter: Callable[[dict[str, Any]], Optional[float]], name: str) -> Optional[Lin]:
        vals = [(n, e, getter(rec[name])) for n, e, rec in samples]
        if any(v is None for _, _, v in vals):
            return None
        try:
            return solve_lin(vals)  # type: ignore[arg-type]
        except ValueError as exc:
            raise TraceError(f"node {name!r}: a size annotation is not linear in |V| and |E| ({exc})") from exc

    layers = _layers(gm)
    probe = torch.fx.Interpreter(gm)   # reruns single nodes on the first sample (:func:`_mixes_rows`)
    values = {k: r["out"] for k, r in samples[0][2].items()}
    with torch.random.fork_rng(devices=[]), torch_threads(1):
        _annotate_nodes(gm, samples, modules, lin, layers, probe, values)
    tp = TPGraph(gm, gm.graph, stats, class_name=f"TP{type(model).__name__}")
    tp.train(training)  # sets the views' modes, not the model's
    return tp


def _annotate_nodes(gm: torch.fx.GraphModule, samples: list, modules: dict[str, torch.nn.Module],
                    lin: Callable[..., Optional[Lin]], layers: dict[str, int], probe: torch.fx.Interpreter,
                    values: dict[str, Any]) -> None:
    """Attach a :class:`TPInfo` to every node of ``gm`` from the sample runs' ``samples``."""
    for node in gm.graph.nodes:
        rec = samples[0][2][node.name]
        out = rec["out"]
        rows = lin(lambda r: _rows_of(r["out"]), node.name)
        dims = tuple(int(d) for d in out.shape[1:]) if isinstance(out, torch.Tensor) else ()
        dtype_s = str(out.dtype).replace("torch.", "") if isinstance(out, torch.Tensor) else None
        params = 0
        if node.op == "placeholder":
            kind = "input"
            if isinstance(out, Graph):
                rows, dims = None, ()
        elif node.op == "get_attr":
            kind = "param"
            params = out.numel() if isinstance(out, torch.nn.Parameter) else 0
        elif node.op == "output":
            kind = "output"
        elif node.op == "call_function" and is_primitive(node.target):
            kind = node.target.__gnncompile_kind__
        else:
            space = rows.space if rows is not None else "1"
            kind = "E" if space in ("E", "E+V") else "T"
            if node.op == "call_module":
                params = sum(p.numel() for p in modules[node.target].parameters(recurse=True))
        why = ""
        if kind in ("T", "E") and not (node.op == "call_function" and is_primitive(node.target)):
            why = _row_mixing(node, rows, samples, probe, values)
        node.meta["tp"] = TPInfo(
            kind=kind,
            layer=layers[node.name] if kind in ("T", "P", "E") else 0,
            rows=rows,
            dims=dims,
            dtype=dtype_s,
            flops=lin(lambda r: r["cost"][0], node.name) or Lin(),
            bytes_read=lin(lambda r: r["cost"][1], node.name) or Lin(),
            bytes_written=lin(lambda r: r["cost"][2], node.name) or Lin(),
            saved_bytes=lin(lambda r: r["saved"], node.name) or Lin(),
            params=params,
            op=_op_label(node, modules),
            saves=rec["saves"],
            mixes_rows=why,
        )
