"""`decouple` / `decouple_exact`: run every T op first, then every propagation (Eq. 4 of NeutronTask).

NeutronTask §5.1 ("task-decoupled GNN training", Fig. 8b) and NeutronTP §4.1 ("generalized
decoupled training") reorder an L-layer GNN, ``T_1 P_1 T_2 P_2 ... T_L P_L``, into
``P_L ∘ ... ∘ P_1 ∘ (T_L ∘ ... ∘ T_1)``: an MLP on the un-propagated features followed by L
propagations, ``Z = Â^L · MLP(X)``. Consecutive P ops need no saved intermediates and a tensor- or
task-parallel plan switches data layout once instead of twice per layer.

The model the pass produces
---------------------------
Let ``F(X; P_1..P_m)`` be the traced model with its propagate nodes ``P_i``. The decoupled model is

    D(X) = Q_L( ... Q_2( Q_1( F(X; P_i := identity) ) ) )

- the **MLP** ``F(X; identity)`` is the graph with every propagation replaced by its input: all T
  ops run in their original order on un-propagated features (dropout draws the same masks, in the
  same order, as the original model with the same seed);
- the **edge ops** (GAT's attention: gather, LeakyReLU, edge softmax, attention dropout) stay in the
  MLP and so are computed from the features the decoupled model has at that point, the
  transformed but not yet propagated ones (NeutronTP §4.1: attention precomputed before graph
  aggregation; NeutronTask's GATv2-style order, Scatter-P/edge-T before every P);
- ``Q_l`` is layer ``l``'s propagation (same ``norm``, self loops and edge weights as its P ops),
  applied to the MLP's output. Multi-head edge weights ``[E, H]`` are averaged over the heads
  (``alpha.mean(1)``: each head's rows sum to 1, so the mean does too), since the MLP output has
  no head axis.

**Exact** when propagation commutes with everything after it: every T op applied to a propagated
tensor is linear and acts on each row alike (``Linear`` without bias, scaling by a constant or a
per-column parameter, sums of tensors propagated equally often, reshapes and sums over feature
axes, dropout with ``p = 0``), no edge op reads a propagated tensor, no propagation uses
multi-head weights, and the output has been propagated once per layer. Then
``D = F`` (SGC/``Â^K X W`` without bias, linear GCNs). Anything else (ReLU, a bias: ``Â·1 ≠ 1``,
dropout, GAT's attention on propagated features, APPNP's teleport term) makes the pass *relaxed*:
it changes the model to ``D``. :func:`plan_decoupling` reports which nodes break exactness.

Two registered passes share the code: ``decouple`` (relaxed; ``semantics="exact"`` makes it
refuse non-exact inputs) and ``decouple_exact`` (exact; refuses non-exact inputs), so a
``PassManager(semantics="exact")`` can decouple linear models and refuses the rest with a
:class:`~gnncompile.errors.PassError` naming the pass and the offending nodes.

Not decouplable at all (``PassError`` in both modes): edge ops that carry vertex features over
edges outside a propagation (``aggregate``, e.g. GraphSAGE-max), a layer whose P ops differ
(norm, self loops, edge weights), P ops other than ``propagate`` (run ``decouple`` before
``fuse_masked_propagate``), and graphs with recomputed segments (run it before
``insert_recomputation``).
"""

from __future__ import annotations

import inspect
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx
import torch.nn.functional as F

from ..errors import PassError
from ..frontend import ops
from ..frontend.tracer import trace
from ..ir.tpgraph import TPGraph, TPInfo
from ..nn.functional import feature_dropout, linear
from .infra import SEMANTICS, graph_pass
from .recompute import Recompute

__all__ = ["Propagation", "DecouplingPlan", "plan_decoupling", "decouple", "decouple_exact"]

_PROPAGATE_SIG = inspect.signature(ops.propagate)


@dataclass(frozen=True)
class Propagation:
    """Layer ``layer``'s propagation in the decoupled model (from the P ops ``nodes``)."""

    layer: int
    nodes: tuple[str, ...]
    norm: str
    add_self_loops: bool
    edge_weight: Optional[str]
    backend: Optional[str]

    def __str__(self) -> str:
        w = f", edge_weight={self.edge_weight}" if self.edge_weight else ""
        return f"Q{self.layer} = propagate(norm={self.norm!r}, add_self_loops={self.add_self_loops}{w})"


@dataclass(frozen=True)
class DecouplingPlan:
    """What :func:`decouple` will do: the propagations in order, and whether the result is exact.

    ``reasons`` names every node that makes the decoupled model differ from the original
    (empty when ``exact``).
    """

    propagations: tuple[Propagation, ...]
    exact: bool
    reasons: tuple[str, ...]

    def __str__(self) -> str:
        lines = [f"decoupled model: MLP then {len(self.propagations)} propagation(s); "
                 f"{'exact' if self.exact else 'relaxed'}"]
        lines += [f"  {p}" for p in self.propagations]
        lines += [f"  not exact: {r}" for r in self.reasons]
        return "\n".join(lines)


# --------------------------------------------------------------------------- analysis
def _info(n: torch.fx.Node) -> TPInfo:
    return n.meta["tp"]


def _label(n: torch.fx.Node) -> str:
    t = n.target
    if n.op == "call_module":
        return f"{t} ({_info(n).op})"
    if isinstance(t, str):
        return f".{t}()"
    mod = getattr(t, "__module__", "") or ""
    return f"{mod.replace('torch.nn.functional', 'F').replace('_operator', 'operator')}.{getattr(t, '__name__', t)}"


def _propagate_args(n: torch.fx.Node) -> dict[str, Any]:
    bound = _PROPAGATE_SIG.bind(*n.args, **n.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


_ADD = {operator.add, operator.sub, torch.add, torch.sub, operator.iadd, operator.isub}
_MUL = {operator.mul, torch.mul, operator.imul}
_DIV = {operator.truediv, torch.div, torch.true_divide, operator.itruediv}
_NEG = {operator.neg, torch.neg}
_MATMUL = {operator.matmul, torch.matmul, torch.mm}
_SHAPE_METHODS = {"view", "reshape", "flatten", "contiguous", "squeeze", "unsqueeze"}
_REDUCE_METHODS = {"sum", "mean"}
_METHOD_OPS = {"add": _ADD, "sub": _ADD, "mul": _MUL, "div": _DIV, "neg": _NEG, "matmul": _MATMUL}


def _is_vertex_or_edge(n: Any) -> bool:
    return isinstance(n, torch.fx.Node) and _info(n).space in ("V", "E", "E+V", "?")


def _reduce_dims(n: torch.fx.Node) -> Any:
    if "dim" in n.kwargs:
        return n.kwargs["dim"]
    return n.args[1] if len(n.args) > 1 else None


def _non_commuting(n: torch.fx.Node, count: dict[torch.fx.Node, Optional[int]], modules: dict[str, torch.nn.Module]
                   ) -> Optional[str]:
    """Why T op ``n``, applied to a propagated tensor, does not commute with propagation (None if it does)."""
    feats = [a for a in n.all_input_nodes if count.get(a) is not None]
    k = max(count[a] for a in feats)
    where = f"node {n.name!r} ({_label(n)}) after {k} propagation(s)"
    target = n.target
    operands = list(n.args) + list(n.kwargs.values())
    if n.op == "call_method" and target in _METHOD_OPS:
        target = next(iter(_METHOD_OPS[target]))
    if n.op == "call_module":
        m = modules[target]
        if isinstance(m, torch.nn.Linear):
            if m.bias is None:
                return None
            return f"{where}: a Linear with bias (Â·1 ≠ 1: the bias would be propagated)"
        if isinstance(m, torch.nn.Identity) or (isinstance(m, torch.nn.Dropout) and (m.p == 0 or not m.training)):
            return None
        return f"{where}: {type(m).__name__} does not commute with propagation"
    if n.op == "call_method" and target in _SHAPE_METHODS | _REDUCE_METHODS:
        src = _info(n.args[0]) if isinstance(n.args[0], torch.fx.Node) else None
        if src is None or src.space != "V" or _info(n).space != "V":
            return f"{where}: reshapes across vertex rows"
        if target in _REDUCE_METHODS:
            dims = _reduce_dims(n)
            dims = dims if isinstance(dims, (tuple, list)) else (dims,)
            ndim = 1 + len(src.dims)
            if any(d is None or d % ndim == 0 for d in dims):
                return f"{where}: reduces over vertices"
        return None
    if target in _ADD:
        nodes = [a for a in operands if isinstance(a, torch.fx.Node)]
        scalars = [a for a in n.args if not isinstance(a, torch.fx.Node)]
        if scalars:
            return f"{where}: adds a constant (Â·1 ≠ 1)"
        others = [a for a in nodes if count.get(a) is None]
        if others:
            return (f"{where}: adds {others[0].name!r}, which is not propagated (a bias or constant "
                    "term: Â·1 ≠ 1)")
        counts = sorted({count[a] for a in nodes})
        if len(counts) > 1:
            return f"{where}: adds tensors propagated {counts[0]} and {counts[-1]} time(s)"
        return None
    if target in _MUL or target in _DIV:
        args = list(n.args[:2])
        if len(feats) > 1 or (target in _DIV and args and args[0] not in feats):
            return f"{where}: multiplies or divides feature tensors (not linear)"
        other = args[1] if args and args[0] in feats else args[0]
        if _is_vertex_or_edge(other):
            return f"{where}: scales rows by a per-vertex tensor {other.name!r}"
        return None
    if target in _NEG:
        return None
    if target in _MATMUL:
        a, b = n.args[0], n.args[1]
        if a in feats and b not in feats and not _is_vertex_or_edge(b):
            return None
        return f"{where}: a product that mixes vertex rows or multiplies feature tensors"
    if target is F.linear or target is linear:
        bias = n.kwargs.get("bias", n.args[2] if len(n.args) > 2 else None)
        if n.args[0] in feats and len(feats) == 1 and bias is None:
            return None
        return f"{where}: F.linear with bias or on a feature weight"
    if target is F.dropout or target is feature_dropout:
        p = n.kwargs.get("p", n.args[1] if len(n.args) > 1 else 0.5)
        training = n.kwargs.get("training", n.args[2] if len(n.args) > 2 else True)
        if p == 0 or not training:
            return None
        return f"{where}: dropout (a mask drawn per vertex row does not commute with propagation)"
    return f"{where}: not linear or not row-wise (does not commute with propagation)"


def plan_decoupling(tp: TPGraph, pass_name: str = "decouple") -> DecouplingPlan:
    """Decide what :func:`decouple` does on ``tp``: the propagations, and whether it is exact.

    Raises :class:`~gnncompile.errors.PassError` (naming ``pass_name``) when ``tp`` cannot be
    decoupled at all (see the module docstring).
    """
    nodes = list(tp.graph.nodes)
    modules = dict(tp.named_modules())
    placeholders = [n for n in nodes if n.op == "placeholder"]
    g_node = placeholders[0]
    count: dict[torch.fx.Node, Optional[int]] = {}
    reasons: list[str] = []
    by_layer: dict[int, list[torch.fx.Node]] = {}

    def fail(msg: str) -> PassError:
        return PassError(f"pass {pass_name}: cannot decouple {type(tp).__name__}: {msg}")

    for n in nodes:
        if n.op == "placeholder":
            count[n] = None if n is g_node else 0
            continue
        if n.op in ("get_attr", "output"):
            count[n] = None
            continue
        t = _info(n)
        if n.op == "call_module" and isinstance(modules.get(n.target), Recompute):
            raise fail(f"node {n.name!r} is a recomputed segment; run decouple before insert_recomputation")
        ins = [count[a] for a in n.all_input_nodes if count.get(a) is not None]
        if t.kind == "P":
            if n.target is not ops.propagate:
                raise fail(f"P op {n.name!r} is {_label(n)}, only propagate can be moved; run decouple before "
                           "fuse_masked_propagate")
            args = _propagate_args(n)
            x = args["x"]
            count[n] = (count.get(x) or 0) + 1
            by_layer.setdefault(t.layer, []).append(n)
            w = args["edge_weight"]
            if isinstance(w, torch.fx.Node) and len(_info(w).dims) > 0 and _info(w).dims != (1,):
                reasons.append(f"node {n.name!r}: {_info(w).dims[0]}-head edge weights are averaged over heads")
            continue
        if t.kind == "E":
            for u in n.users:
                ut = u.meta.get("tp")
                is_weight = (ut is not None and ut.kind == "P" and u.target is ops.propagate
                             and _propagate_args(u)["edge_weight"] is n)
                if not (is_weight or (ut is not None and ut.kind == "E")):
                    raise fail(f"edge op {n.name!r} ({_label(n)}) feeds {u.name!r}: edge ops may only compute "
                               "propagation weights, not carry vertex features over edges (aggregate)")
            if any(c >= 1 for c in ins):
                reasons.append(f"node {n.name!r} ({_label(n)}): an edge op on propagated features is computed "
                               "from un-propagated ones")
            count[n] = max(ins) if ins else None
            continue
        if not ins:
            count[n] = None
        elif max(ins) == 0:
            count[n] = 0
        else:
            why = _non_commuting(n, count, modules)
            if why:
                reasons.append(why)
            count[n] = max(ins)

    props = []
    for layer in sorted(by_layer):
        group = by_layer[layer]
        specs = set()
        for n in group:
            a = _propagate_args(n)
            w = a["edge_weight"]
            specs.add((a["norm"], bool(a["add_self_loops"]), w.name if isinstance(w, torch.fx.Node) else None,
                       a["backend"]))
            if w is not None and not isinstance(w, torch.fx.Node):
                raise fail(f"P op {n.name!r} has a constant edge_weight")
        if len(specs) > 1:
            raise fail(f"layer {layer} has P ops with different propagations "
                       f"({', '.join(n.name for n in group)}); one propagation per layer can be moved")
        norm, loops, w, backend = specs.pop()
        props.append(Propagation(layer, tuple(n.name for n in group), norm, loops, w, backend))
    if props and [p.layer for p in props] != list(range(1, len(props) + 1)):
        raise fail(f"P ops sit in layers {[p.layer for p in props]}, expected 1..{len(props)}")
    out = next(n for n in nodes if n.op == "output").args[0]
    c_out = count.get(out) or 0
    if props and c_out != len(props):
        reasons.append(f"the output is propagated {c_out} time(s), the decoupled model propagates it "
                       f"{len(props)} time(s)")
    return DecouplingPlan(tuple(props), not reasons, tuple(reasons))


# --------------------------------------------------------------------------- rewrite
def _rewrite(tp: TPGraph, plan: DecouplingPlan) -> TPGraph:
    """Build the decoupled graph and re-trace it (fresh annotations for the new shapes)."""
    old = tp.graph
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    p_nodes = {name for p in plan.propagations for name in p.nodes}
    g_node = None
    for n in old.nodes:
        if n.op == "output":
            continue
        if n.name in p_nodes:
            env[n] = env[_propagate_args(n)["x"]]
            continue
        env[n] = new.node_copy(n, lambda a: env[a])
        if n.op == "placeholder" and g_node is None:
            g_node = env[n]
    by_name = {n.name: n for n in old.nodes}
    y = env[next(n for n in old.nodes if n.op == "output").args[0]]
    for p in plan.propagations:
        kwargs: dict[str, Any] = {"add_self_loops": p.add_self_loops}
        if p.edge_weight is not None:
            w_old = by_name[p.edge_weight]
            w = env[w_old]
            if _info(w_old).dims:
                w = new.call_method("mean", (w,), {"dim": 1})
            kwargs["edge_weight"] = w
        if p.backend is not None:
            kwargs["backend"] = p.backend
        y = new.call_function(ops.propagate, (g_node, y, p.norm), kwargs)
    new.output(y)
    name = type(tp).__name__
    gm = torch.fx.GraphModule(tp, new, class_name=name[2:] if name.startswith("TP") else name)
    x_info = _info([n for n in old.nodes if n.op == "placeholder"][1])
    dtype = getattr(torch, x_info.dtype or "float32", torch.float32)
    return trace(gm, tp.stats, training=tp.training, dtype=dtype)


def _decouple(tp: TPGraph, semantics: str, pass_name: str) -> TPGraph:
    if semantics not in SEMANTICS:
        raise PassError(f"pass {pass_name}: unknown semantics {semantics!r}; valid: {', '.join(SEMANTICS)}")
    plan = plan_decoupling(tp, pass_name)
    if semantics == "exact" and not plan.exact:
        raise PassError(
            f"pass {pass_name}: decoupling {type(tp).__name__} is not exact (it would change the model): "
            + "; ".join(plan.reasons)
            + ". Use the relaxed pass 'decouple' with semantics='relaxed' to train the decoupled model")
    if not plan.propagations:
        return tp
    return _rewrite(tp, plan)




@graph_pass(exact=False)
def decouple(tp: TPGraph, semantics: str = "relaxed") -> TPGraph:
    """Move every T op ahead of every propagation: ``Z = Q_L ∘ ... ∘ Q_1 (MLP(X))`` (relaxed).

    NeutronTask §5.1 Eq. 4 / Fig. 8b, NeutronTP §4.1. The module docstring defines the model
    produced (the MLP is the model with propagations replaced by identity; edge ops compute
    attention from un-propagated features; multi-head weights are averaged) and when it is exact.

    Parameters
    ----------
    semantics:
        ``"relaxed"`` (default): rewrite any decouplable model. ``"exact"``: raise ``PassError``
        unless the rewrite preserves the function (see :func:`plan_decoupling`).

    Requires:
        A verified TPGraph whose P ops are ``propagate`` calls, one propagation per layer, edge
        ops only feeding propagation weights, no recomputed segments (else ``PassError``).
    Ensures:
        All T and E ops sit in layer 1 (the MLP), followed by the layers' propagations in order
        on the MLP's output (P ops of layers 1..L); fresh annotations from re-tracing; parameter
        names unchanged. A model without P ops is returned unchanged.
    Preserves:
        The parameters and the order of RNG draws (same dropout masks for the same seed).
        The function only when :func:`plan_decoupling` says exact; otherwise the model becomes the
        decoupled model described in the module docstring. Relaxed.

    Example (2-layer GCN)::

        before                                 after
        convs_0_lin   T 1  x W0                convs_0_lin   T 1  x W0
        propagate     P 1  Â                   add           T 1  + b0
        add           T 2  + b0                relu          T 1
        relu          T 2                      dropout       T 1
        dropout       T 2                      convs_1_lin   T 1  W1
        convs_1_lin   T 2  W1                  add_1         T 1  + b1
        propagate_1   P 2  Â                   propagate     P 1  Â
        add_1         T 3  + b1                propagate_1   P 2  Â
    """
    return _decouple(tp, semantics, "decouple")


@graph_pass(exact=True)
def decouple_exact(tp: TPGraph) -> TPGraph:
    """Decouple a model whose T ops commute with propagation (exact; refuses the others).

    Same rewrite as :func:`decouple` with ``semantics="exact"``; registered as an exact pass so
    that ``PassManager(["decouple_exact"])`` runs under exact semantics.

    Requires:
        As ``decouple``, and every T op after a propagation is linear and row-wise, no edge op reads a
        propagated tensor, single-head edge weights: else ``PassError`` naming this pass and the
        offending nodes.
    Ensures:
        As ``decouple``.
    Preserves:
        The function and every gradient (up to float reassociation: ``Â(xW) = (Âx)W``). Exact.
    """
    return _decouple(tp, "exact", "decouple_exact")

