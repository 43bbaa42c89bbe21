"""`from_pyg(model)`: turn a PyTorch Geometric model into an equivalent gnncompile model.

A PyG model keeps its graph convolutions as submodules and its own ``forward(x, edge_index)``
calls them as ``conv(x, edge_index)`` (``GCN2Conv``: ``conv(x, x_0, edge_index)``; ``APPNP``:
``prop(x, edge_index)``). :func:`from_pyg` rewrites such a model into a
:class:`PygConverted` module with ``forward(g, x)`` whose convolutions are
:mod:`gnncompile.nn` layers reading the graph ``g``:

1. **Copy.** The model is deep-copied (parameters and buffers too, unless
   ``share_parameters=True``), so converting never changes the user's model.
2. **Trace with convs as leaves.** ``torch.fx`` traces the copy's ``forward`` with every PyG
   ``MessagePassing`` module as a leaf (PyG's conv internals reject fx proxies) and ``torch.nn``
   modules as leaves; everything else (plain tensor code, PyG helper modules such as
   ``JumpingKnowledge``) is traced through. Optional extra inputs (``edge_weight=None``,
   ``batch=None``, ...; the signature of ``torch_geometric.nn.models.GCN`` and its siblings) are
   specialized to their defaults.
3. **Training mode.** fx records ``self.training`` as a constant, so the forward is traced once in
   training and once in eval mode. Functional dropout whose ``training`` argument follows the mode
   (``F.dropout(x, p, training=self.training)``) becomes a ``torch.nn`` dropout module, which
   follows ``.train()``/``.eval()`` of the converted model; any other difference between the
   two traces is a :class:`~gnncompile.TraceError`.
4. **Rewrite.** Every call of a supported conv becomes a call of the matching gnncompile layer with
   the graph ``g`` in place of ``edge_index`` (``conv(x, edge_index)`` -> ``layer(g, x)``,
   ``conv(x, x_0, edge_index)`` -> ``layer(g, x, x_0)``), the layer holding the conv's own
   parameter tensors under the same names. ``edge_index`` must be used by the convs and by nothing
   else.

The result is a ``torch.fx.GraphModule`` (:class:`PygConverted`) whose parameters have the PyG
model's names (``convs.0.lin.weight`` ...), so ``pyg_model.load_state_dict(converted.state_dict(),
strict=False)`` and back copy weights; gnncompile's tracer traces through its layers to the graph
primitives. Modules the forward never uses are not kept.

Supported convolutions and options
----------------------------------
Only these exact classes (not subclasses, which may override ``message``) are converted, each to
its :mod:`gnncompile.nn` namesake:

- ``GCNConv`` -> ``GCNConv``: ``add_self_loops``, ``normalize``, ``bias``; ``cached`` is accepted
  (gnncompile caches normalizations on the graph). ``improved=True`` is rejected: there is no
  ``A + 2I`` propagation.
- ``SAGEConv`` -> ``SAGEConv``: ``aggr`` in mean/sum/add/max, ``root_weight``, ``normalize``,
  ``bias``. ``project=True``, other aggregations and bipartite ``in_channels`` are rejected.
- ``GATConv`` -> ``GATConv``: ``heads``, ``concat``, ``negative_slope``, ``dropout`` (attention
  dropout), ``add_self_loops``, ``bias``. ``edge_dim`` (edge features), ``residual=True`` and
  bipartite ``in_channels`` are rejected.
- ``GINConv`` -> ``GINConv``: the conv's own ``nn`` module, ``eps``, ``train_eps``.
- ``GCN2Conv`` -> ``GCN2Conv``: ``alpha``, ``beta`` (PyG keeps only ``log(theta / layer + 1)``),
  ``shared_weights``, ``add_self_loops``, ``normalize``; ``cached`` is accepted.
- ``APPNP`` -> ``APPNPConv``: ``K``, ``alpha``, ``add_self_loops``, ``normalize``; ``cached`` is
  accepted. ``dropout > 0`` (dropout of the propagation's edge weights) is rejected.
- ``SGConv`` -> ``SGConv``: ``K`` (>= 1), ``add_self_loops``, ``bias``; ``cached`` is accepted.

Every conv must aggregate in PyG's default way (``aggr="add"``; SAGEConv as listed), use
``flow="source_to_target"``, have no hooks, initialized (non-lazy) parameters, and be called with a
single feature tensor (no ``edge_weight``/``edge_attr``/``size`` arguments, no
``return_attention_weights``). Any other ``MessagePassing`` module (``ChebConv``, ``GraphConv``,
``GATv2Conv``, ``TransformerConv``, ...) is a :class:`~gnncompile.TraceError` naming its path and
class.

Semantics
---------
The converted layers compute PyG's functions on graphs without self loops (symmetric graphs for
the GCN-normalized convs); see :mod:`gnncompile.nn.layers` for the differences on graphs with
self loops. A graph with stored edge weights is propagated with those weights where gnncompile's
layers use them (as PyG would given ``edge_weight``); the PyG forward being converted takes no
weights. ``cached=True`` of ``SGConv`` freezes PyG's propagated input after the first call; the
converted layer recomputes it (the same values for the same input).
"""

from __future__ import annotations

import copy
import inspect
import itertools
import operator
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

from ..errors import TraceError
from ..nn import layers as gnn
from .tracer import bound_arguments, mode_difference, node_source, user_frame

__all__ = ["from_pyg", "PygConverted", "SUPPORTED_CONVS"]

SUPPORTED_CONVS = ("GCNConv", "SAGEConv", "GATConv", "GINConv", "GCN2Conv", "APPNP", "SGConv")

# Functional dropouts and the torch.nn module that computes the same function with the module's mode.
_DROPOUT_MODULES: dict[Callable[..., Any], type[nn.Module]] = {
    F.dropout: nn.Dropout,
    F.dropout1d: nn.Dropout1d,
    F.dropout2d: nn.Dropout2d,
    F.dropout3d: nn.Dropout3d,
    F.alpha_dropout: nn.AlphaDropout,
    F.feature_alpha_dropout: nn.FeatureAlphaDropout,
}

# Hook dictionaries of torch.nn.Module and PyG's MessagePassing a converted conv would silently drop.
_HOOK_ATTRS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
    "_propagate_forward_pre_hooks", "_propagate_forward_hooks",
    "_message_forward_pre_hooks", "_message_forward_hooks",
    "_aggregate_forward_pre_hooks", "_aggregate_forward_hooks",
    "_message_and_aggregate_forward_pre_hooks", "_message_and_aggregate_forward_hooks",
    "_edge_update_forward_pre_hooks", "_edge_update_forward_hooks",
)


# --------------------------------------------------------------------------- result type
class PygConverted(torch.fx.GraphModule):
    """A PyG model rewritten by :func:`from_pyg`: ``forward(g, x)`` with gnncompile layers.

    A ``torch.fx.GraphModule`` whose graph is the PyG model's forward with every convolution call
    replaced by a call of a :mod:`gnncompile.nn` layer taking the graph ``g``. Parameter and buffer
    names are the PyG model's. ``meta["from_pyg"]`` records the source model's class and, per
    converted module path, the PyG and gnncompile class names (also :attr:`conversions`).
    """

    @property
    def source_class(self) -> str:
        """Qualified name of the PyG model's class."""
        return str(self.meta.get("from_pyg", {}).get("source_class", ""))

    @property
    def conversions(self) -> dict[str, tuple[str, str]]:
        """``{module path: (PyG class name, gnncompile class name)}`` of the converted convs."""
        return dict(self.meta.get("from_pyg", {}).get("conversions", {}))


# --------------------------------------------------------------------------- conv conversion table
@dataclass(frozen=True)
class _ConvRule:
    """How one PyG conv class becomes a gnncompile layer.

    ``inputs`` are the names of the conv's feature arguments, passed to the gnncompile layer after
    ``g`` in this order; ``build`` makes the layer from the PyG conv (options only: the tensors are
    moved over afterwards by :func:`_adopt_tensors`).
    """

    inputs: tuple[str, ...]
    build: Callable[[Any, str], nn.Module]


def _fail(path: str, conv: nn.Module, what: str, fix: str) -> TraceError:
    return TraceError(f"module {path!r} ({type(conv).__name__}): {what}; {fix}")


def _expect_aggr(path: str, conv: Any, expected: str = "add") -> None:
    if conv.aggr != expected:
        raise _fail(path, conv, f"aggr={conv.aggr!r} is not supported (only PyG's default {expected!r})",
                    f"build it with aggr={expected!r}")


def _int_channels(path: str, conv: Any, name: str = "in_channels") -> int:
    """The conv's ``in_channels`` as one positive int (bipartite pairs of equal sizes are accepted)."""
    value = getattr(conv, name)
    if isinstance(value, (tuple, list)):
        if len(set(value)) != 1:
            raise _fail(path, conv, f"bipartite {name}={tuple(value)} is not supported",
                        "gnncompile layers transform one feature matrix; use one size")
        value = value[0]
    if not isinstance(value, int) or value <= 0:
        raise _fail(path, conv, f"lazy {name}={value!r} is not supported",
                    "give the input size, or run one PyG forward pass first so the parameters exist")
    return value


def _build_gcn(conv: Any, path: str) -> nn.Module:
    _expect_aggr(path, conv)
    if conv.improved:
        raise _fail(path, conv, "improved=True (propagation over A + 2I) has no gnncompile equivalent",
                    "use improved=False, or write the layer with gnncompile.ops.propagate")
    return gnn.GCNConv(_int_channels(path, conv), conv.out_channels, bias=conv.bias is not None,
                       add_self_loops=conv.add_self_loops and conv.normalize, normalize=conv.normalize)


def _build_sage(conv: Any, path: str) -> nn.Module:
    if conv.project:
        raise _fail(path, conv, "project=True is not supported",
                    "apply the projection as a Linear + ReLU before the conv in the model's forward")
    if not isinstance(conv.aggr, str) or conv.aggr not in gnn.SAGEConv.AGGRS:
        raise _fail(path, conv, f"aggr={conv.aggr!r} is not supported",
                    f"use one of {', '.join(map(repr, gnn.SAGEConv.AGGRS))}")
    return gnn.SAGEConv(_int_channels(path, conv), conv.out_channels, aggr=conv.aggr,
                        root_weight=conv.root_weight, bias=conv.lin_l.bias is not None, normalize=conv.normalize)


def _build_gat(conv: Any, path: str) -> nn.Module:
    _expect_aggr(path, conv)
    if conv.edge_dim is not None:
        raise _fail(path, conv, f"edge_dim={conv.edge_dim} (edge features) is not supported",
                    "gnncompile's GATConv attends over vertex features only; drop edge_dim")
    if getattr(conv, "residual", False):
        raise _fail(path, conv, "residual=True is not supported",
                    "add the residual as a Linear of the conv's input in the model's forward")
    if conv.lin is None:
        raise _fail(path, conv, f"bipartite in_channels={conv.in_channels!r} is not supported",
                    "use one input size")
    return gnn.GATConv(_int_channels(path, conv), conv.out_channels, heads=conv.heads, concat=conv.concat,
                       negative_slope=conv.negative_slope, dropout=conv.dropout,
                       add_self_loops=conv.add_self_loops, bias=conv.bias is not None)


def _build_gin(conv: Any, path: str) -> nn.Module:
    _expect_aggr(path, conv)
    # Built around a placeholder: GINConv.__init__ resets its ``nn``, which must keep the PyG weights.
    layer = gnn.GINConv(nn.Identity(), eps=conv.initial_eps,
                        train_eps=isinstance(conv.eps, nn.Parameter))
    layer.nn = conv.nn
    return layer


def _build_gcn2(conv: Any, path: str) -> nn.Module:
    _expect_aggr(path, conv)
    layer = gnn.GCN2Conv(_int_channels(path, conv, "channels"), conv.alpha, shared_weights=conv.weight2 is None,
                         add_self_loops=conv.add_self_loops and conv.normalize, normalize=conv.normalize)
    layer.beta = float(conv.beta)  # PyG keeps only beta = log(theta / layer + 1)
    return layer


def _build_appnp(conv: Any, path: str) -> nn.Module:
    _expect_aggr(path, conv)
    if conv.dropout > 0:
        raise _fail(path, conv, f"dropout={conv.dropout} (dropout of the propagation's edge weights) is not "
                                "supported", "use dropout=0 and dropout on features in the model's forward")
    return gnn.APPNPConv(conv.K, conv.alpha, add_self_loops=conv.add_self_loops and conv.normalize,
                         normalize=conv.normalize)


def _build_sgc(conv: Any, path: str) -> nn.Module:
    _expect_aggr(path, conv)
    return gnn.SGConv(_int_channels(path, conv), conv.out_channels, K=conv.K, add_self_loops=conv.add_self_loops,
                      bias=conv.lin.bias is not None)


def _rules(pyg_nn: Any) -> dict[type, _ConvRule]:
    """The conversion table, keyed by the PyG classes themselves (imported lazily)."""
    return {
        pyg_nn.GCNConv: _ConvRule(("x",), _build_gcn),
        pyg_nn.SAGEConv: _ConvRule(("x",), _build_sage),
        pyg_nn.GATConv: _ConvRule(("x",), _build_gat),
        pyg_nn.GINConv: _ConvRule(("x",), _build_gin),
        pyg_nn.GCN2Conv: _ConvRule(("x", "x_0"), _build_gcn2),
        pyg_nn.APPNP: _ConvRule(("x",), _build_appnp),
        pyg_nn.SGConv: _ConvRule(("x",), _build_sgc),
    }


def _convert_conv(conv: Any, path: str, rules: dict[type, _ConvRule]) -> tuple[nn.Module, _ConvRule]:
    """Build the gnncompile layer for the PyG conv at ``path``, holding the conv's tensors."""
    cls = type(conv)
    rule = rules.get(cls)
    if rule is None:
        raise TraceError(
            f"module {path!r} is a {cls.__module__}.{cls.__qualname__}, which from_pyg cannot convert; "
            f"supported PyG convolutions (exact classes): {', '.join(SUPPORTED_CONVS)}; write the model with "
            "gnncompile.nn layers or gnncompile.ops primitives instead")
    if getattr(conv, "flow", "source_to_target") != "source_to_target":
        raise _fail(path, conv, f"flow={conv.flow!r} is not supported", "use flow='source_to_target'")
    hooks = [name for name in _HOOK_ATTRS if getattr(conv, name, None)]
    if hooks or getattr(conv, "_explain", None):
        what = ", ".join(hooks) if hooks else "explain mode"
        raise _fail(path, conv, f"has {what}, which the converted layer would not run",
                    "remove the hooks (or turn explain off) before converting")
    for name, t in itertools.chain(conv.named_parameters(), conv.named_buffers()):
        if isinstance(t, nn.parameter.UninitializedTensorMixin):
            raise _fail(path, conv, f"parameter {name!r} is not initialized (lazy)",
                        "run one PyG forward pass first, or give the input size")
    try:
        layer = rule.build(conv, path)
    except ValueError as exc:
        raise _fail(path, conv, f"its options have no gnncompile equivalent ({exc})",
                    "change the option or write the layer with gnncompile.ops") from exc
    _adopt_tensors(layer, conv, path)
    taken_over = {id(m) for m in conv.modules()}  # e.g. GINConv's nn keeps its own modes
    for module in layer.modules():
        if id(module) not in taken_over:
            module.training = conv.training
    return layer, rule


def _adopt_tensors(layer: nn.Module, conv: nn.Module, path: str) -> None:
    """Make ``layer``'s parameters and buffers the very tensors of ``conv`` (same names and shapes).

    The tensors are installed as they are (same objects, dtype, device and ``requires_grad``), so the
    layer shares storage with ``conv``; :func:`from_pyg` decides whether ``conv`` itself is a copy.
    """
    src: dict[str, torch.Tensor] = dict(conv.named_parameters())
    src.update(conv.named_buffers())
    dst = dict(layer.named_parameters())
    dst.update(layer.named_buffers())
    if set(src) != set(dst):
        raise _fail(path, conv, f"its tensors {sorted(src)} do not match the gnncompile layer's {sorted(dst)}",
                    "this PyG version's layer layout is not supported by from_pyg")
    for name, old in dst.items():
        new = src[name]
        if new.shape != old.shape:
            raise _fail(path, conv, f"tensor {name!r} has shape {tuple(new.shape)}, the gnncompile layer "
                                    f"expects {tuple(old.shape)}", "this configuration is not supported")
        owner_path, _, attr = name.rpartition(".")
        owner = layer.get_submodule(owner_path)
        if attr in owner._parameters:
            owner._parameters[attr] = new
        else:
            owner._buffers[attr] = new


# --------------------------------------------------------------------------- tracing
def _import_pyg() -> tuple[Any, type]:
    try:
        import torch_geometric.nn as pyg_nn
        from torch_geometric.nn.conv import MessagePassing
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("gnncompile.from_pyg needs PyTorch Geometric: pip install 'gnncompile[pyg]'") from exc
    return pyg_nn, MessagePassing


class _PygTracer(torch.fx.Tracer):
    """fx tracer with every PyG ``MessagePassing`` module (and every ``torch.nn`` module) as a leaf."""

    def __init__(self, message_passing: type) -> None:
        super().__init__()
        self.message_passing = message_passing
        self.record_stack_traces = True

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, self.message_passing) or super().is_leaf_module(m, module_qualified_name)


def _describe(node: torch.fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(
        node.target, "__qualname__", getattr(node.target, "__name__", repr(node.target)))
    src = node_source(node)
    return f"node {node.name!r} ({node.op} {target})" + (f", {src}" if src else "")


def _trace(root: nn.Module, tracer: _PygTracer, concrete: dict[str, Any]) -> torch.fx.Graph:
    name = type(root).__name__
    try:
        return tracer.trace(root, concrete_args=concrete or None)
    except TraceError:
        raise
    except Exception as exc:  # fx's own errors, or PyG/user code misusing a Proxy
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        where = user_frame(exc.__traceback__)
        raise TraceError(
            f"cannot trace {name}.forward with torch.fx (PyG convs as leaves): {msg}"
            + (f" at {where}" if where else "")
            + "; from_pyg needs a forward that calls its convs as conv(x, edge_index) and otherwise uses "
              "plain tensor ops with control flow that does not depend on tensor values; write the model "
              "explicitly (a torch.nn.Module calling the convs) or with gnncompile.nn") from exc


def _check_signature(model: nn.Module) -> tuple[list[str], dict[str, Any]]:
    """Names of forward's two inputs and the defaults that specialize the optional others."""
    name = type(model).__name__
    params = list(inspect.signature(model.forward).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2:
        raise TraceError(
            f"{name}.forward takes ({', '.join(p.name for p in params)}); from_pyg needs forward(x, edge_index) "
            "(node features and the graph's connectivity, edge_index or adj_t)")
    inputs = [positional[0].name, positional[1].name]
    concrete: dict[str, Any] = {}
    required = []
    for p in params:
        if p.name in inputs or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is p.empty:
            required.append(p.name)
        else:
            concrete[p.name] = p.default
    if required:
        raise TraceError(
            f"{name}.forward requires the input(s) {', '.join(map(repr, required))} besides "
            f"({inputs[0]}, {inputs[1]}); the converted model's forward is forward(g, x) and cannot provide "
            "them: give them defaults (None), or move them into the model")
    return inputs, concrete


def _drop_specialized_inputs(graph: torch.fx.Graph, keep: list[torch.fx.Node], model_name: str) -> None:
    """Erase the placeholders of inputs fixed to their defaults (and fx's checks of them)."""
    for ph in [n for n in graph.nodes if n.op == "placeholder" and n not in keep]:
        for user in list(ph.users):
            _erase_check(user)
        if ph.users:
            user = next(iter(ph.users))
            raise TraceError(f"{model_name}.forward reads its input {ph.target!r} at {_describe(user)}; the "
                             "converted model's forward is forward(g, x) and cannot provide it")
        graph.erase_node(ph)


def _erase_check(node: torch.fx.Node) -> None:
    """Erase ``node`` if it is one of fx's specialization asserts (or an ``eq`` feeding only those)."""
    asserts = (torch.fx._symbolic_trace._assert_is_none, torch._assert)
    if node.op == "call_function" and node.target in asserts and not node.users:
        node.graph.erase_node(node)
        return
    if node.op == "call_function" and node.target in (torch.eq, operator.eq):
        for user in list(node.users):
            _erase_check(user)
        if not node.users:
            node.graph.erase_node(node)


# --------------------------------------------------------------------------- training mode
def _mode_independent(train: torch.fx.Graph, evalg: torch.fx.Graph, root: nn.Module,
                      model_name: str) -> torch.fx.Graph:
    """Merge the training-mode and eval-mode traces into one graph that follows the module's mode.

    The two traces must be identical except for functional dropout whose ``training`` argument is
    ``True`` in one and ``False`` in the other (:func:`~gnncompile.frontend.tracer.mode_difference`);
    such a call is replaced by the matching ``torch.nn`` dropout module (registered on ``root``),
    which reads the mode when it runs. Returns ``train``, rewritten in place.
    """
    hint = ("the converted model must compute the same graph of operations in both modes: use torch.nn.Dropout "
            "modules or F.dropout(x, p, training=self.training), not branches on self.training")
    diff = mode_difference(train, evalg)
    if diff.kind == "graph" and re.search(r"\bdropout_(edge|adj|node|path)\(", diff.where):
        raise TraceError(f"{model_name}.forward drops edges or nodes at random in training mode (first difference: "
                         f"{diff.where}): the graph would change every step, and a plan partitions and propagates "
                         "over one fixed graph; remove the edge dropout from forward")
    if diff.kind == "graph":
        raise TraceError(f"{model_name}.forward runs different operations in training and eval mode "
                         f"(first difference: {diff.where}); {hint}")
    nodes = {n.name: n for n in train.nodes}
    for name in diff.flag_nodes:
        node = nodes[name]
        args = bound_arguments(node)
        if node.target not in _DROPOUT_MODULES or args is None or args.get("training") is not True:
            raise TraceError(f"{model_name}.forward calls {_describe(node)} with an argument depending on the "
                             f"mode; {hint}")
        _dropout_to_module(train, node, args, root, model_name)
    return train


def _dropout_to_module(graph: torch.fx.Graph, node: torch.fx.Node, args: dict[str, Any], root: nn.Module,
                       model_name: str) -> None:
    """Replace a functional dropout that follows the mode by a call of an equivalent dropout module."""
    p, inplace = args.get("p"), args.get("inplace", False)
    if isinstance(p, torch.fx.Node) or isinstance(inplace, torch.fx.Node):
        raise TraceError(f"{model_name}.forward: {_describe(node)} has a computed dropout probability; "
                         "use a constant p")
    module = _DROPOUT_MODULES[node.target](p=p, inplace=inplace)  # type: ignore[index]
    base = f"{node.name}_module"
    name, k = base, 1
    while hasattr(root, name):
        name, k = f"{base}_{k}", k + 1
    root.add_module(name, module)
    with graph.inserting_before(node):
        new = graph.call_module(name, (args["input"],))
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    graph.erase_node(node)


# --------------------------------------------------------------------------- rewrite
def _rewrite_convs(graph: torch.fx.Graph, root: nn.Module, g: torch.fx.Node, edge: torch.fx.Node,
                   message_passing: type, rules: dict[type, _ConvRule]) -> dict[str, tuple[str, str]]:
    """Replace every PyG conv call by a gnncompile layer call with ``g``; swap the modules in ``root``."""
    converted: dict[str, tuple[nn.Module, _ConvRule]] = {}
    conversions: dict[str, tuple[str, str]] = {}
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        conv = root.get_submodule(node.target)
        if not isinstance(conv, message_passing):
            continue
        path = str(node.target)
        if path not in converted:
            converted[path] = _convert_conv(conv, path, rules)
        layer, rule = converted[path]
        try:
            bound = inspect.signature(type(conv).forward).bind(conv, *node.args, **node.kwargs)
        except TypeError as exc:
            raise TraceError(
                f"{_describe(node)}: the call does not match {type(conv).__name__}.forward: {exc}") from exc
        bound.apply_defaults()
        arguments = dict(list(bound.arguments.items())[1:])  # without self
        edge_name = "edge_index"  # the connectivity argument of every supported PyG conv
        if arguments[edge_name] is not edge:
            raise TraceError(f"{_describe(node)} passes {arguments[edge_name]!r} as {edge_name}, not the model's "
                             f"input {edge.name!r}; from_pyg replaces the model's connectivity input by the graph g, "
                             "so the convs must receive it unchanged")
        for k in rule.inputs:
            if not isinstance(arguments[k], torch.fx.Node):
                raise TraceError(f"{_describe(node)} passes {type(arguments[k]).__name__} as {k}; gnncompile layers "
                                 "take one feature tensor (no bipartite (x_src, x_dst) pairs)")
        extra = [k for k, v in arguments.items() if k not in rule.inputs and k != edge_name and v is not None]
        if extra:
            raise TraceError(f"{_describe(node)} passes {', '.join(extra)}; from_pyg converts convs called with "
                             f"({', '.join(rule.inputs)}, {edge_name}) only (the graph's own edge weights are used "
                             "where the gnncompile layer supports them)")
        node.args = (g, *(arguments[k] for k in rule.inputs))
        node.kwargs = {}
        conversions[path] = (type(conv).__name__, type(layer).__name__)
    for path, (layer, _) in converted.items():
        parent_path, _, attr = path.rpartition(".")
        root.get_submodule(parent_path).add_module(attr, layer)
    prefixes = tuple(f"{p}." for p in converted)
    for node in graph.nodes:
        if node.op in ("call_module", "get_attr") and str(node.target).startswith(prefixes):
            raise TraceError(f"{_describe(node)} uses the internals of a converted conv; call the conv as a "
                             "whole (its submodules and parameters are gnncompile's after conversion)")
    return conversions


# --------------------------------------------------------------------------- entry point
_PYG_CACHES = ("_cached_edge_index", "_cached_adj_t", "_cached_x")


def _copy_model(model: nn.Module, message_passing: type, share_parameters: bool) -> nn.Module:
    """Deep copy of ``model``, sharing its parameters and buffers if asked, without PyG's conv caches.

    The caches (normalized edges, SGConv's propagated input) describe PyG's graph, which the
    converted model does not read; SGConv's cached input may also be a non-leaf tensor, which
    cannot be deep-copied.
    """
    memo: dict[int, Any] = {}
    if share_parameters:
        memo.update((id(t), t) for t in itertools.chain(model.parameters(), model.buffers()))
    for module in model.modules():
        if isinstance(module, message_passing):
            for attr in _PYG_CACHES:
                value = getattr(module, attr, None)
                if value is not None:
                    memo[id(value)] = None
    try:
        return copy.deepcopy(model, memo)
    except Exception as exc:
        raise TraceError(f"cannot copy {type(model).__name__} with copy.deepcopy: {exc}; from_pyg converts a "
                         "copy so that the original model stays unchanged") from exc


def from_pyg(model: nn.Module, *, share_parameters: bool = False) -> PygConverted:
    """Convert a PyTorch Geometric model into an equivalent gnncompile model with ``forward(g, x)``.

    Parameters
    ----------
    model:
        A ``torch.nn.Module`` with ``forward(x, edge_index)`` (the second input may have any name,
        e.g. ``adj_t``; further inputs need defaults and are fixed to them) that calls its PyG
        convolutions as ``conv(x, edge_index)``, e.g. a hand-written GCN or
        ``torch_geometric.nn.models.GCN/GraphSAGE/GAT/GIN``. Supported convolutions and options:
        see the module docstring.
    share_parameters:
        ``False`` (the default): the converted model owns copies of the parameters and buffers, so
        training it leaves ``model`` unchanged. ``True``: it uses ``model``'s own parameter and
        buffer tensors (training one trains the other); the module structure is copied either way.

    Returns
    -------
    PygConverted
        A ``torch.fx.GraphModule`` with ``forward(g, x)``, ``g`` a :class:`gnncompile.Graph`, whose
        convolutions are :mod:`gnncompile.nn` layers with the PyG parameter names. Its mode
        (``training``) is ``model``'s; ``.train()``/``.eval()`` switch dropout as in PyG.

    Raises
    ------
    TraceError
        For an unsupported conv (naming its module path and class) or conv option, a forward fx
        cannot trace, a forward that uses ``edge_index`` outside the convs, requires other inputs,
        or computes different operations in training and eval mode.
    """
    pyg_nn, message_passing = _import_pyg()
    if not isinstance(model, nn.Module):
        hint = ("; a PyG graph (it has edge_index) converts with gnncompile.Graph.from_pyg(data)"
                if hasattr(model, "edge_index") else "")
        raise TraceError(f"from_pyg converts a PyG model: expects a torch.nn.Module, got {type(model).__name__}{hint}")
    name = type(model).__name__
    if isinstance(model, message_passing):
        raise TraceError(f"from_pyg converts models, not a single {name}: wrap it in a module whose forward "
                         "calls it, or build the gnncompile layer and copy the state dict "
                         "(layer.load_state_dict(conv.state_dict()))")
    inputs, concrete = _check_signature(model)
    rules = _rules(pyg_nn)

    root = _copy_model(model, message_passing, share_parameters)
    modes = {m: m.training for m in root.modules()}
    try:
        root.train(True)
        train_graph = _trace(root, _PygTracer(message_passing), concrete)
        root.train(False)
        eval_graph = _trace(root, _PygTracer(message_passing), concrete)
    finally:
        for m, mode in modes.items():
            m.training = mode
    graph = _mode_independent(train_graph, eval_graph, root, name)

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    x_node, edge = placeholders[0], placeholders[1]
    _drop_specialized_inputs(graph, [x_node, edge], name)
    with graph.inserting_before(x_node):
        g = graph.placeholder("g")
    conversions = _rewrite_convs(graph, root, g, edge, message_passing, rules)
    if edge.users:
        user = next(n for n in graph.nodes if n in edge.users)
        raise TraceError(f"the model reads {inputs[1]} outside its convs at {_describe(user)}; the converted "
                         f"model has no {inputs[1]} (the graph g replaces it inside the convs): compute "
                         "graph-derived tensors outside the model, or do the work in a conv")
    graph.erase_node(edge)
    x_node.target = "x"
    x_node.type = None
    graph.lint()

    converted = PygConverted(root, graph, class_name="PygConverted")
    converted.meta["from_pyg"] = {"source_class": f"{type(model).__module__}.{type(model).__qualname__}",
                                  "conversions": conversions}
    converted.training = model.training
    for module in converted.modules():
        if isinstance(module, tuple(_DROPOUT_MODULES.values())) and module not in modes:
            module.training = model.training
    return converted
