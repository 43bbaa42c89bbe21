"""`fuse_masked_propagate`: a propagation whose output is masked computes only what survives.

MixGCN §3.2.1, Eq. 4 (S-SpMM, ``Z = (A H) ⊙ M``): in GCN training about half of the outputs of
neighbour aggregation are thrown away right after it, by dropout in the forward pass or by ReLU in
the backward pass. The pass finds a ``propagate`` whose output flows, through element-wise ops
only, into

- a **dropout** (forward mask): the dropout's multiplier is drawn *before* the propagation
  (:func:`~gnncompile.frontend.ops.dropout_noise`, the draw ``F.dropout`` makes under
  :class:`~gnncompile.frontend.ops.plan_dropout_draws`, as in gnncompile's training), the
  propagation becomes :func:`~gnncompile.frontend.ops.masked_propagate` with that mask (rows the
  mask empties are not computed; their backward is skipped too), and the dropout becomes a
  multiplication by the same multiplier;
- a **ReLU** (backward mask; no dropout follows): the propagation becomes ``masked_propagate``
  without a forward mask, whose backward skips the rows of the incoming gradient that ReLU zeroed.

The element-wise ops in between (bias add, activations, scaling, row-preserving reshapes: GCN's
``+ b -> relu -> dropout``, GAT's ``reshape -> + b -> elu -> dropout``) stay as they are; they
map a masked-out zero to a finite value that the final multiplication zeroes again, so outputs
and gradients are unchanged.

Decide, then rewrite: :func:`find_masked_propagations` returns the matches as data; the pass
rewrites them. Only ``F.dropout`` / :func:`gnncompile.nn.functional.feature_dropout` calls with
constant ``training=True`` and ``0 < p < 1`` count as dropout. A match is skipped when another
op that draws random numbers sits between the propagation and the dropout in graph order (moving
the draw would change which numbers each op gets).

Savings are per row (see :mod:`gnncompile.kernels.masked`): element-wise dropout on
``d`` features leaves almost every row partly alive (a fraction ``p^d`` is empty), so on CPU the
fused op skips nothing there and costs two row scans more (mask forward, gradient backward: a few
percent, ``benchmarks/masked_spmm.py``). Row-structured masks (dropped vertices, rows ReLU zeroed
entirely, small ``d``) are where it computes less.
"""

from __future__ import annotations

import inspect
import math
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx
import torch.nn.functional as F

from ..frontend import ops
from ..ir.symbolic import Lin
from ..ir.tpgraph import TPGraph, TPInfo
from ..nn.functional import feature_dropout
from .infra import graph_pass
from .recompute import draws_random_numbers

__all__ = ["MaskedPropagation", "find_masked_propagations", "fuse_masked_propagate"]

_PROPAGATE_SIG = inspect.signature(ops.propagate)

_DROPOUTS = {F.dropout, feature_dropout}
_RELUS_F = {F.relu, torch.relu}
_RELU_MODULES = (torch.nn.ReLU,)
# element-wise functions that map a finite value to a finite value (masked-out zeros stay harmless)
_UNARY_F = {F.relu, torch.relu, F.elu, F.leaky_relu, F.gelu, F.silu, F.relu6, F.celu, F.selu, torch.tanh,
            torch.sigmoid, F.softplus}
_UNARY_MODULES = (torch.nn.ReLU, torch.nn.ELU, torch.nn.LeakyReLU, torch.nn.GELU, torch.nn.SiLU, torch.nn.ReLU6,
                  torch.nn.CELU, torch.nn.SELU, torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Softplus,
                  torch.nn.Identity)
_UNARY_METHODS = {"relu", "tanh", "sigmoid", "contiguous"}
_BINARY_F = {operator.add, operator.sub, operator.mul, torch.add, torch.sub, torch.mul}
_BINARY_METHODS = {"add", "sub", "mul"}
_RESHAPE_METHODS = {"view", "reshape", "flatten"}


@dataclass(frozen=True)
class MaskedPropagation:
    """One match: propagation ``propagate``, element-wise ``chain`` after it, and the mask source.

    ``mask`` is ``"dropout"`` (``dropout`` names the dropout node, ``p`` its probability) or
    ``"relu"`` (``dropout`` is ``None``).
    """

    propagate: str
    chain: tuple[str, ...]
    mask: str
    dropout: Optional[str]
    p: float


def _info(n: torch.fx.Node) -> Optional[TPInfo]:
    t = n.meta.get("tp")
    return t if isinstance(t, TPInfo) else None


def _dropout_p(n: torch.fx.Node) -> Optional[float]:
    """``p`` of an active dropout call (constant ``training=True``, ``0 < p < 1``), else None."""
    if n.op != "call_function" or n.target not in _DROPOUTS:
        return None
    params = list(inspect.signature(n.target).parameters)
    args = dict(zip(params, n.args))
    args.update(n.kwargs)
    p, training = args.get("p", 0.5), args.get("training", True)
    if not isinstance(p, (int, float)) or training is not True or not 0.0 < float(p) < 1.0:
        return None
    return float(p)


def _elementwise_step(n: torch.fx.Node, cur: torch.fx.Node, modules: dict[str, torch.nn.Module]) -> bool:
    """Whether ``n`` applies an element-wise, finite-preserving map to ``cur`` (its only vertex operand)."""
    tin, tout = _info(cur), _info(n)
    if tin is None or tout is None or tout.kind != "T" or tout.space != "V":
        return False
    others = [a for a in n.all_input_nodes if a is not cur]
    for a in others:
        ta = _info(a)
        if ta is None or ta.space in ("V", "E", "E+V", "?"):
            return False  # a second per-vertex operand: masked rows of it would matter
    if n.op == "call_function" and n.target in _UNARY_F:
        return bool(n.args) and n.args[0] is cur and tout.dims == tin.dims
    if n.op == "call_function" and n.target in _BINARY_F:
        return tout.dims == tin.dims
    if n.op == "call_method" and n.target in _UNARY_METHODS | _BINARY_METHODS:
        return tout.dims == tin.dims
    if n.op == "call_method" and n.target in _RESHAPE_METHODS:
        return n.args[0] is cur and math.prod(tout.dims) == math.prod(tin.dims)
    if n.op == "call_module":
        return isinstance(modules[n.target], _UNARY_MODULES) and tout.dims == tin.dims
    return False


def _is_relu(n: torch.fx.Node, modules: dict[str, torch.nn.Module]) -> bool:
    return ((n.op == "call_function" and n.target in _RELUS_F) or (n.op == "call_method" and n.target == "relu")
            or (n.op == "call_module" and isinstance(modules[n.target], _RELU_MODULES)))


def find_masked_propagations(tp: TPGraph) -> list[MaskedPropagation]:
    """The ``propagate -> element-wise chain -> dropout | ReLU`` matches of ``tp`` (see the module docstring)."""
    modules = dict(tp.named_modules())
    order = {n: i for i, n in enumerate(tp.graph.nodes)}
    nodes = list(tp.graph.nodes)
    found = []
    for p in nodes:
        if p.op != "call_function" or p.target is not ops.propagate:
            continue
        chain: list[torch.fx.Node] = []
        cur, relu, drop = p, False, None
        while len(cur.users) == 1:
            u = next(iter(cur.users))
            if _dropout_p(u) is not None and u.args and u.args[0] is cur:
                tin, tp_ = _info(cur), _info(p)
                if tin is not None and tp_ is not None and math.prod(tin.dims) == math.prod(tp_.dims):
                    drop = u
                break
            if not _elementwise_step(u, cur, modules):
                break
            relu = relu or _is_relu(u, modules)
            chain.append(u)
            cur = u
        if drop is not None:
            between = nodes[order[p] + 1:order[drop]]
            if any(draws_random_numbers(n, modules) for n in between):
                drop = None
        if drop is not None:
            found.append(MaskedPropagation(p.name, tuple(c.name for c in chain), "dropout", drop.name,
                                           _dropout_p(drop) or 0.0))
        elif relu:
            relu_at = max(i for i, c in enumerate(chain) if _is_relu(c, modules))
            found.append(MaskedPropagation(p.name, tuple(c.name for c in chain[:relu_at + 1]), "relu", None, 0.0))
    return found


def _propagate_args(p: torch.fx.Node) -> dict[str, Any]:
    """The arguments of a ``propagate`` call by parameter name (only those given)."""
    return dict(_PROPAGATE_SIG.bind(*p.args, **p.kwargs).arguments)


def _rewrite(tp: TPGraph, match: MaskedPropagation) -> None:
    graph = tp.graph
    by_name = {n.name: n for n in graph.nodes}
    p = by_name[match.propagate]
    pt = p.meta["tp"]
    args = _propagate_args(p)
    g, x = args.pop("g"), args.pop("x")
    noise = None
    if match.mask == "dropout":
        with graph.inserting_before(p):
            noise = graph.call_function(ops.dropout_noise, (x, match.p))
        numel = Lin() if pt.rows is None else pt.rows * math.prod(pt.dims)
        noise.meta["tp"] = TPInfo(kind="T", layer=pt.layer, rows=pt.rows, dims=pt.dims, dtype=pt.dtype,
                                  flops=numel, bytes_written=numel * _itemsize(pt), op="dropout_noise")
    with graph.inserting_before(p):
        fused = graph.call_function(ops.masked_propagate, (g, x, noise), args)
    fused.meta["tp"] = pt.with_(op="masked_propagate")
    p.replace_all_uses_with(fused)
    graph.erase_node(p)
    if noise is None or match.dropout is None:
        return
    drop = by_name[match.dropout]
    dt = drop.meta["tp"]
    factor = noise
    if dt.dims != pt.dims:
        with graph.inserting_before(drop):
            factor = graph.call_method("reshape", (noise, -1) + tuple(dt.dims))
        factor.meta["tp"] = TPInfo(kind="T", layer=pt.layer, rows=dt.rows, dims=dt.dims, dtype=dt.dtype, op="reshape")
    with graph.inserting_before(drop):
        mul = graph.call_function(operator.mul, (drop.args[0], factor))
    mul.meta["tp"] = dt.with_(op="mul")
    drop.replace_all_uses_with(mul)
    graph.erase_node(drop)


def _itemsize(t: TPInfo) -> int:
    dtype = getattr(torch, t.dtype or "float32", torch.float32)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 4


@graph_pass(exact=True)
def fuse_masked_propagate(tp: TPGraph) -> TPGraph:
    """Fuse a propagation with the dropout or ReLU mask applied to its output (exact; MixGCN S-SpMM).

    Requires:
        A verified TPGraph. Matches (:func:`find_masked_propagations`): a ``propagate`` whose only
        use is a chain of element-wise, finite-preserving ops (each with the chain as its only
        per-vertex operand) ending in an active ``F.dropout``/``feature_dropout`` on it, or
        containing a ReLU; no other random op between the propagation and the dropout.
    Ensures:
        Dropout matches: ``dropout_noise`` (T, the P op's layer) drawn from the propagation's
        input just before it; ``masked_propagate(g, x, noise, ...)`` (P, the original
        annotations) in place of ``propagate``; ``x_chain * noise`` (``operator.mul``) in place of
        the dropout (with a ``reshape`` of the noise when the chain reshaped). ReLU matches:
        ``masked_propagate(g, x, None, ...)``. Other nodes untouched.
    Preserves:
        Outputs and every gradient for the same seed: the noise is the one ``F.dropout`` would
        draw (same RNG call, same position in the RNG stream) and ``x * noise`` is what
        ``F.dropout`` computes on CPU; masked-out entries are zero after the multiplication either
        way; skipped backward rows have zero gradient. Exact. (CUDA's fused dropout draws other
        numbers: same distribution.)

    Example (GCN hidden layer)::

        before                                   after
        convs_0_lin  T 1                         convs_0_lin     T 1
        propagate    P 1  Â h                    dropout_noise   T 1  m = Bernoulli(1-p) / (1-p)
        add          T 2  + b                    masked_propagate P 1  Â h on rows where m has a nonzero
        relu         T 2                         add             T 2  + b
        dropout      T 2  p = 0.5                relu            T 2
                                                 mul             T 2  * m
    """
    for match in find_masked_propagations(tp):
        _rewrite(tp, match)
    tp.recompile()
    return tp
