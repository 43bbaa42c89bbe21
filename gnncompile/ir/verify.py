"""`verify(tp)`: the one verifier of the annotated operator graph.

Checks, in order (the first violation raises :class:`~gnncompile.errors.VerificationError` with the
faulty node and its neighbourhood printed):

1. the fx graph is well formed (``Graph.lint``: defs before uses, one output);
2. every node carries a :class:`~gnncompile.ir.tpgraph.TPInfo` with a known kind, and the kind
   agrees with the node (placeholders are ``input``, ``get_attr`` is ``param``, primitives have the
   kind they are registered with, nothing else is ``P``);
3. the first input is the graph, only primitives use it, and every primitive takes it as its first
   argument;
4. row spaces: ``propagate`` (every P primitive) maps V -> V; ``gather_*`` and ``edge_attention``
   (both its score inputs) map V -> E (E+V with implicit self loops); ``edge_softmax`` maps E -> E; ``aggregate`` maps E -> V (with the same
   self-loop convention); edge weights have the edge space of their call;
5. shapes: the rows of each P/E op's output match its inputs' spaces, ``Linear`` modules see
   inputs of ``in_features`` columns and produce ``out_features``, and layer indices never
   decrease along an edge of the graph;
6. the output is a single tensor;
7. modes: a graph that carries an eval-mode graph (``tp.eval_graph``) follows the mode itself
   (``specialized is None``), and its eval graph is specialized to eval mode, evaluated for the same
   statistics, carries no eval graph of its own and passes checks 1-6 (its errors say "eval-mode
   graph").
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.fx

from ..errors import VerificationError
from .symbolic import Lin
from .tpgraph import KINDS, TPGraph, TPInfo

__all__ = ["verify"]

_V = Lin.of(v=1)
_E = Lin.of(e=1)
_EV = Lin.of(v=1, e=1)


def _neighbourhood(tp: TPGraph, node: torch.fx.Node) -> str:
    names = {a.name for a in node.all_input_nodes} | {u.name for u in node.users} | {node.name}
    lines = []
    for n in tp.graph.nodes:
        if n.name not in names:
            continue
        t = n.meta.get("tp")
        ann = f"{t.kind} L{t.layer} rows={t.rows} dims={t.dims}" if isinstance(t, TPInfo) else "<no annotation>"
        args = ", ".join(a.name for a in n.all_input_nodes)
        mark = ">>" if n is node else "  "
        lines.append(f"  {mark} {n.name} = {n.op}[{_tname(n)}]({args})  # {ann}")
    return "\n".join(lines)


def _tname(n: torch.fx.Node) -> str:
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__name__", repr(t))


def _fail(tp: TPGraph, node: Optional[torch.fx.Node], msg: str) -> VerificationError:
    if node is None:
        return VerificationError(msg)
    return VerificationError(f"node {node.name!r}: {msg}\n{_neighbourhood(tp, node)}")


def _flag(node: torch.fx.Node, name: str, default: Any) -> Any:
    """Argument ``name`` of a call, by keyword or by its position in the target's signature."""
    if name in node.kwargs:
        return node.kwargs[name]
    try:
        params = list(inspect.signature(node.target).parameters)
    except (TypeError, ValueError):
        return default
    pos = params.index(name) if name in params else -1
    return node.args[pos] if 0 <= pos < len(node.args) else default


def verify(tp: TPGraph) -> TPGraph:
    """Check every invariant of ``tp`` (see the module docstring); return ``tp`` unchanged."""
    if not isinstance(tp, TPGraph):
        raise VerificationError(f"verify expects a TPGraph, got {type(tp).__name__}")
    try:
        tp.graph.lint()
    except Exception as exc:  # fx raises RuntimeError with its own message
        raise VerificationError(f"malformed fx graph: {exc}") from exc

    modules = dict(tp.named_modules())
    nodes = list(tp.graph.nodes)
    outputs = [n for n in nodes if n.op == "output"]
    if len(outputs) != 1:
        names = ", ".join(repr(n.name) for n in outputs)
        raise _fail(tp, outputs[-1] if outputs else None,
                    f"expected a single output node, found {len(outputs)}{f' ({names})' if names else ''}")
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) < 2:
        raise _fail(tp, placeholders[0] if placeholders else None, "expected inputs (g, x)")
    g_node = placeholders[0]

    for n in nodes:
        t = n.meta.get("tp")
        if not isinstance(t, TPInfo):
            raise _fail(tp, n, "missing TPInfo annotation (node.meta['tp'])")
        if t.kind not in KINDS:
            raise _fail(tp, n, f"unknown kind {t.kind!r}; valid: {', '.join(KINDS)}")
        expected = {"placeholder": "input", "get_attr": "param", "output": "output"}.get(n.op)
        if expected and t.kind != expected:
            raise _fail(tp, n, f"{n.op} node must have kind {expected!r}, has {t.kind!r}")
        prim_kind = getattr(n.target, "__gnncompile_kind__", None) if n.op == "call_function" else None
        if prim_kind is not None and t.kind != prim_kind:
            raise _fail(tp, n, f"primitive {_tname(n)} is a {prim_kind} op but is annotated {t.kind!r}")
        if prim_kind is None and t.kind == "P":
            raise _fail(tp, n, "only a P primitive (gnncompile.ops.propagate) may be a P op")
        if n.op not in ("placeholder", "output") and g_node in n.all_input_nodes:
            tensor_args = list(n.args[1:]) + list(n.kwargs.values())
            if prim_kind is None or not n.args or n.args[0] is not g_node or any(a is g_node for a in tensor_args):
                raise _fail(tp, n, f"the graph input {g_node.name!r} is used outside a graph primitive")
        if prim_kind is not None and (not n.args or n.args[0] is not g_node):
            first = n.args[0] if n.args else None
            shown = first.name if isinstance(first, torch.fx.Node) else repr(first)
            raise _fail(tp, n, f"primitive {_tname(n)} must take the graph input {g_node.name!r} as its first "
                               f"argument, takes {shown!r}")
        for a in n.all_input_nodes:
            ta = a.meta.get("tp")
            if isinstance(ta, TPInfo) and t.kind in ("T", "P", "E") and ta.kind in ("T", "P", "E") and ta.layer > t.layer:
                raise _fail(tp, n, f"layer {t.layer} consumes {a.name!r} of later layer {ta.layer}")
        if prim_kind is not None:
            _check_primitive(tp, n, t)
        if n.op == "call_module" and isinstance(modules.get(n.target), torch.nn.Linear):
            lin = modules[n.target]
            src = n.all_input_nodes[0].meta["tp"] if n.all_input_nodes else None
            if src is not None and src.dims and src.dims[-1] != lin.in_features:
                raise _fail(tp, n, f"Linear expects {lin.in_features} input features, its input has {src.dims[-1]}")
            if t.dims and t.dims[-1] != lin.out_features:
                raise _fail(tp, n, f"Linear produces {lin.out_features} features, annotation says {t.dims[-1]}")
    out_arg = outputs[0].args[0]
    if not isinstance(out_arg, torch.fx.Node):
        raise _fail(tp, outputs[0], "the output must be a single tensor")
    _verify_modes(tp)
    return tp


def _verify_modes(tp: TPGraph) -> None:
    ev = tp.eval_graph
    if ev is None:
        return
    if tp.specialized is not None:
        raise VerificationError(f"a graph traced for {'training' if tp.specialized else 'eval'} mode only "
                                "(specialized) must not carry an eval-mode graph")
    if not isinstance(ev, TPGraph) or ev.specialized is not False or ev.eval_graph is not None:
        raise VerificationError("eval-mode graph (tp.eval_graph): must be a TPGraph specialized to eval mode "
                                "without an eval graph of its own")
    if ev.stats != tp.stats:
        raise VerificationError(f"eval-mode graph (tp.eval_graph): evaluated for {ev.stats}, the training graph "
                                f"for {tp.stats}; bind both to the same statistics")
    try:
        verify(ev)
    except VerificationError as exc:
        raise VerificationError(f"eval-mode graph (tp.eval_graph): {exc}") from exc


def _rows(node: Any) -> Optional[Lin]:
    if isinstance(node, torch.fx.Node) and isinstance(node.meta.get("tp"), TPInfo):
        return node.meta["tp"].rows
    return None


def _check_primitive(tp: TPGraph, n: torch.fx.Node, t: TPInfo) -> None:
    name = getattr(n.target, "__name__", "")
    loops = bool(_flag(n, "add_self_loops", False))
    espace = _EV if loops else _E
    arg = n.args[1] if len(n.args) > 1 else None
    rin = _rows(arg)
    if n.target.__gnncompile_kind__ == "P":  # propagate and its variants
        want_in, want_out = _V, _V
    else:
        want_in, want_out = {
            "gather_src": (_V, espace),
            "gather_dst": (_V, espace),
            "edge_softmax": (espace, espace),
            "edge_attention": (_V, espace),
            "aggregate": (espace, _V),
        }.get(name, (None, None))
    if want_in is None:
        return
    if rin is not None and rin != want_in:
        raise _fail(tp, n, f"{name} reads rows in space {want_in.space}, its input has rows {rin}")
    if t.rows != want_out:
        raise _fail(tp, n, f"{name} writes rows in space {want_out.space}, annotation says {t.rows}")
    if name == "edge_attention":
        rd = _rows(_flag(n, "dst_scores", None))
        if rd is not None and rd != _V:
            raise _fail(tp, n, f"edge_attention reads dst_scores in space {_V.space}, its input has rows {rd}")
    rw = _rows(_flag(n, "edge_weight", None))
    if rw is not None and rw != espace:
        raise _fail(tp, n, f"{name} edge_weight must have rows {espace.space}, has {rw}")
