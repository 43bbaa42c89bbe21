"""GNN layers built only from :mod:`gnncompile.ops` primitives and plain torch ops.

Every layer's ``forward`` passes the graph ``g`` to the primitives and to nothing else (it never
reads a :class:`~gnncompile.graph.Graph` attribute), so the torch.fx tracer sees each operation as
a dense vertex-wise op (T), a propagation (P) or an edge op (E), and the layers compute the same
functions as their PyTorch Geometric namesakes (parameter names mirror PyG's, so
``pyg_layer.load_state_dict(layer.state_dict())`` copies the weights).

Differences from PyG shared by all layers
-----------------------------------------
- **Self loops.** ``add_self_loops=True`` uses the primitives' *implicit* self loops: every vertex
  gets exactly one extra ``v -> v`` edge of weight 1 on top of the stored edges. PyG's
  ``gcn_norm`` uses ``add_remaining_self_loops`` (no loop is added where one exists; the existing
  loop's weight is kept) and ``GATConv`` removes existing loops before adding one. On graphs
  without self loops the results are identical; on a graph that already has loops the loop
  vertices get two loop terms here.
- **GCN normalization of directed graphs.** ``norm="gcn"`` is ``w_uv / sqrt(deg_in(v) deg_out(u))``;
  PyG's ``gcn_norm`` uses the *in*-degree of the source ``u``. Both agree on symmetric graphs (the
  usual case: undirected graphs stored with both directions).
- **Stored edge weights.** Propagations with ``norm`` in ``"gcn"``, ``"mean"``, ``"sum"`` use the
  graph's stored edge weights when it has them (PyG's ``GCNConv``/``SGConv``/``APPNP``/
  ``GCN2Conv`` take them as ``edge_weight``; PyG's ``SAGEConv`` and ``GINConv`` ignore weights,
  here mean/sum aggregation is weighted as in DGL). Attention (``GATConv``) ignores them.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops as gops
from ..errors import ArgumentError
from .functional import Linear, linear
from ..graph.core import Graph

__all__ = [
    "GCNConv",
    "SAGEConv",
    "GATConv",
    "GINConv",
    "GCN2Conv",
    "APPNPConv",
    "SGConv",
]


# --------------------------------------------------------------------------- helpers
def glorot_(t: Tensor) -> Tensor:
    """PyG's ``glorot``: uniform in ``±sqrt(6 / (size(-2) + size(-1)))`` (in place)."""
    bound = math.sqrt(6.0 / (t.size(-2) + t.size(-1)))
    with torch.no_grad():
        return t.uniform_(-bound, bound)


def check_positive_int(value: int, name: str, minimum: int = 1) -> int:
    """Return ``value`` if it is an int ``>= minimum``; raise a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentError(f"{name}: expected an int >= {minimum}, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ArgumentError(f"{name}: must be >= {minimum}, got {value}")
    return value


def check_probability(value: float, name: str, upper_inclusive: bool = False) -> float:
    """Return ``value`` if it lies in ``[0, 1)`` (``[0, 1]`` with ``upper_inclusive``)."""
    v = float(value)
    ok = 0.0 <= v <= 1.0 if upper_inclusive else 0.0 <= v < 1.0
    if not ok:
        interval = "[0, 1]" if upper_inclusive else "[0, 1)"
        raise ArgumentError(f"{name}: must be in {interval}, got {value!r}")
    return v


def _reset(module: nn.Module) -> None:
    """Reset ``module`` if it can be, else each child recursively (PyG's ``reset``)."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    else:
        for child in module.children():
            _reset(child)


def _resolve_loops(add_self_loops: Optional[bool], normalize: bool) -> bool:
    """PyG's rule: self loops default to on exactly when the propagation is normalized."""
    return bool(normalize) if add_self_loops is None else bool(add_self_loops)


# --------------------------------------------------------------------------- GCN
class GCNConv(nn.Module):
    r"""Graph convolution (Kipf & Welling): ``X' = D^-1/2 (A + I) D^-1/2 X W + b``.

    Computed in PyG's order: ``lin`` (no bias) -> ``propagate(norm="gcn")`` -> ``+ bias``.

    Parameters
    ----------
    in_channels, out_channels:
        Feature sizes.
    bias:
        Learn an additive bias (initialized to zero).
    add_self_loops:
        Propagate over ``A + I`` (implicit self loops, see the module docstring). ``None`` (the
        default) means ``normalize``, as in PyG. Unlike PyG, ``add_self_loops=True`` with
        ``normalize=False`` is allowed and sums over ``A + I``.
    normalize:
        Symmetric normalization (``norm="gcn"``); otherwise an unnormalized (weighted) sum.

    Notes
    -----
    PyG adds self loops only where none exist and normalizes the source by its in-degree; the
    results are identical on symmetric graphs without self loops (module docstring).
    """

    def __init__(self, in_channels: int, out_channels: int, bias: bool = True,
                 add_self_loops: Optional[bool] = None, normalize: bool = True) -> None:
        super().__init__()
        self.in_channels = check_positive_int(in_channels, "in_channels")
        self.out_channels = check_positive_int(out_channels, "out_channels")
        self.normalize = bool(normalize)
        self.add_self_loops = _resolve_loops(add_self_loops, self.normalize)
        self.lin = Linear(in_channels, out_channels, bias=False)
        if bias:
            self.bias: Optional[nn.Parameter] = nn.Parameter(torch.empty(out_channels))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot weight, zero bias (PyG's initialization)."""
        glorot_(self.lin.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, g: Graph, x: Tensor) -> Tensor:
        """``[N, in_channels] -> [N, out_channels]``."""
        h = self.lin(x)
        h = gops.propagate(g, h, "gcn" if self.normalize else "sum", add_self_loops=self.add_self_loops)
        if self.bias is not None:
            h = h + self.bias
        return h

    def extra_repr(self) -> str:
        return (f"{self.in_channels}, {self.out_channels}, normalize={self.normalize}, "
                f"add_self_loops={self.add_self_loops}")


# --------------------------------------------------------------------------- GraphSAGE
class SAGEConv(nn.Module):
    r"""GraphSAGE: ``x'_v = W_l · aggr_{u->v} x_u + b + W_r x_v`` (PyG's ``SAGEConv``).

    ``aggr="mean"`` and ``"sum"`` are one propagation. Because a linear map commutes with a
    (weighted) mean or sum, when ``out_channels < in_channels`` the layer transforms first and
    propagates the narrower features (``propagate(x W_l^T) + b``), which is the same function
    with fewer propagated columns. ``aggr="max"`` gathers sources onto edges and reduces with max
    (vertices without in-edges get 0, as in PyG), then applies ``lin_l``.

    Parameters
    ----------
    in_channels, out_channels:
        Feature sizes.
    aggr:
        ``"mean"``, ``"sum"`` (alias ``"add"``) or ``"max"``.
    root_weight:
        Add the root term ``lin_r(x)`` (no bias).
    bias:
        Bias of ``lin_l``.
    normalize:
        L2-normalize the output rows (PyG's ``normalize``).

    Notes
    -----
    On a weighted graph, mean and sum aggregation use the stored weights (``sum w x / sum w``);
    PyG's ``SAGEConv`` ignores edge weights.
    """

    AGGRS = ("mean", "sum", "add", "max")

    def __init__(self, in_channels: int, out_channels: int, aggr: str = "mean", root_weight: bool = True,
                 bias: bool = True, normalize: bool = False) -> None:
        super().__init__()
        if aggr not in self.AGGRS:
            raise ArgumentError(f"aggr: unknown aggregation {aggr!r}; valid: {', '.join(map(repr, self.AGGRS))}")
        self.in_channels = check_positive_int(in_channels, "in_channels")
        self.out_channels = check_positive_int(out_channels, "out_channels")
        self.aggr = "sum" if aggr == "add" else aggr
        self.root_weight = bool(root_weight)
        self.normalize = bool(normalize)
        # Decided once, so the traced graph is static.
        self.transform_first = self.aggr != "max" and out_channels < in_channels
        self.lin_l = Linear(in_channels, out_channels, bias=bias)
        self.lin_r: Optional[Linear] = Linear(in_channels, out_channels, bias=False) if root_weight else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``torch.nn.Linear`` initialization (PyG's default for ``SAGEConv``)."""
        self.lin_l.reset_parameters()
        if self.lin_r is not None:
            self.lin_r.reset_parameters()

    def forward(self, g: Graph, x: Tensor) -> Tensor:
        """``[N, in_channels] -> [N, out_channels]``."""
        if self.aggr == "max":
            out = self.lin_l(gops.aggregate(g, gops.gather_src(g, x), "max"))
        elif self.transform_first:
            out = gops.propagate(g, linear(x, self.lin_l.weight), self.aggr)
            if self.lin_l.bias is not None:
                out = out + self.lin_l.bias
        else:
            out = self.lin_l(gops.propagate(g, x, self.aggr))
        if self.lin_r is not None:
            out = out + self.lin_r(x)
        if self.normalize:
            out = F.normalize(out, p=2.0, dim=-1)
        return out

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, aggr={self.aggr!r}, transform_first={self.transform_first}"


# --------------------------------------------------------------------------- GAT
class GATConv(nn.Module):
    r"""Graph attention (Veličković et al.), multi-head, PyG's ``GATConv`` semantics.

    With ``h = x W^T`` viewed as ``[N, H, C]``::

        e_uv^h     = LeakyReLU(<a_src^h, h_u^h> + <a_dst^h, h_v^h>)
        alpha_uv^h = softmax over the in-edges u->v of v (incl. the self loop)  (then dropout)
        x'_v^h     = sum_{u->v} alpha_uv^h h_u^h
        out        = concat_h x'^h  (or mean_h x'^h)  + bias

    Computed without ever materializing an ``[E, H, C]`` tensor: the per-vertex scores
    ``(h * att).sum(-1)`` are ``[N, H]``; :func:`~gnncompile.ops.edge_attention` turns them into the
    coefficients ``alpha`` (``[E, H]``: the scores' gathers, LeakyReLU and softmax fused, one edge
    tensor made), the multi-head edge weights of one ``propagate``.

    Parameters
    ----------
    in_channels:
        Input size.
    out_channels:
        Size per head.
    heads:
        Number of attention heads ``H``.
    concat:
        Concatenate heads (``[N, H*C]``) or average them (``[N, C]``).
    negative_slope:
        LeakyReLU slope.
    dropout:
        Dropout probability of the attention coefficients (training only).
    add_self_loops:
        Each vertex attends to itself through an implicit self loop. PyG removes existing loops
        before adding one; here an existing loop is kept as a second ``v -> v`` edge.
    bias:
        Learn an additive bias (zero initialized).

    Notes
    -----
    Stored edge weights are ignored (the attention coefficients are the weights).
    """

    def __init__(self, in_channels: int, out_channels: int, heads: int = 1, concat: bool = True,
                 negative_slope: float = 0.2, dropout: float = 0.0, add_self_loops: bool = True,
                 bias: bool = True) -> None:
        super().__init__()
        self.in_channels = check_positive_int(in_channels, "in_channels")
        self.out_channels = check_positive_int(out_channels, "out_channels")
        self.heads = check_positive_int(heads, "heads")
        self.concat = bool(concat)
        self.negative_slope = float(negative_slope)
        self.dropout = check_probability(dropout, "dropout")
        self.add_self_loops = bool(add_self_loops)
        self.lin = Linear(in_channels, heads * out_channels, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, heads, out_channels))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_channels))
        if bias:
            self.bias: Optional[nn.Parameter] = nn.Parameter(
                torch.empty(heads * out_channels if concat else out_channels))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot weights and attention vectors, zero bias (PyG's initialization)."""
        glorot_(self.lin.weight)
        glorot_(self.att_src)
        glorot_(self.att_dst)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, g: Graph, x: Tensor) -> Tensor:
        """``[N, in_channels] -> [N, heads * out_channels]`` (concat) or ``[N, out_channels]``."""
        heads, c, sl = self.heads, self.out_channels, self.add_self_loops
        h = self.lin(x).view(-1, heads, c)
        a_src = (h * self.att_src).sum(dim=-1)
        a_dst = (h * self.att_dst).sum(dim=-1)
        alpha = gops.edge_attention(g, a_src, a_dst, self.negative_slope, sl)
        alpha = F.dropout(alpha, p=self.dropout, training=self.training)
        out = gops.propagate(g, h, "none", edge_weight=alpha, add_self_loops=sl)
        out = out.reshape(-1, heads * c) if self.concat else out.mean(dim=1)
        if self.bias is not None:
            out = out + self.bias
        return out

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, heads={self.heads}, concat={self.concat}"


# --------------------------------------------------------------------------- GIN
class GINConv(nn.Module):
    r"""Graph isomorphism layer (Xu et al.): ``x'_v = nn((1 + eps) x_v + sum_{u->v} x_u)``.

    Parameters
    ----------
    nn:
        The network applied after aggregation (e.g. an MLP).
    eps:
        (Initial) ``eps``.
    train_eps:
        Make ``eps`` a parameter; otherwise it is a buffer (as in PyG).

    Notes
    -----
    On a weighted graph the sum is weighted by the stored edge weights; PyG's ``GINConv``
    ignores edge weights.
    """

    def __init__(self, nn: nn.Module, eps: float = 0.0, train_eps: bool = False) -> None:
        super().__init__()
        self.nn = nn
        self.initial_eps = float(eps)
        if train_eps:
            self.eps = torch.nn.Parameter(torch.empty(1))
        else:
            self.register_buffer("eps", torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Reset every sub-module of ``nn`` that can be reset, and ``eps`` to its initial value."""
        _reset(self.nn)
        with torch.no_grad():
            self.eps.fill_(self.initial_eps)

    def forward(self, g: Graph, x: Tensor) -> Tensor:
        """``[N, F] -> nn([N, F])``."""
        out = gops.propagate(g, x, "sum") + (1 + self.eps) * x
        return self.nn(out)


# --------------------------------------------------------------------------- GCNII
class GCN2Conv(nn.Module):
    r"""GCNII layer (Chen et al. 2020), PyG's ``GCN2Conv``.

    ``P = (1 - alpha) Â x + alpha x0`` with ``Â = D^-1/2 (A + I) D^-1/2``; then
    ``out = (1 - beta) P + beta P W1`` (shared weights) or, with separate weights,
    ``out = (1 - beta)((1-alpha) Â x) + beta ((1-alpha) Â x) W1 + (1 - beta) alpha x0 + beta (alpha x0) W2``,
    where ``beta = log(theta / layer + 1)`` (``beta = 1`` when ``theta`` or ``layer`` is ``None``).

    Parameters
    ----------
    channels:
        Feature size (input, initial residual and output).
    alpha:
        Initial-residual strength.
    theta, layer:
        Identity-mapping strength and this layer's 1-based depth.
    shared_weights:
        One weight ``W1`` for both terms (otherwise ``W2`` for the ``x0`` term).
    add_self_loops:
        Implicit self loops; ``None`` means ``normalize`` (PyG).
    normalize:
        GCN normalization; otherwise a (weighted) sum.
    """

    def __init__(self, channels: int, alpha: float, theta: Optional[float] = None, layer: Optional[int] = None,
                 shared_weights: bool = True, add_self_loops: Optional[bool] = None,
                 normalize: bool = True) -> None:
        super().__init__()
        self.channels = check_positive_int(channels, "channels")
        self.alpha = check_probability(alpha, "alpha", upper_inclusive=True)
        self.beta = 1.0
        if theta is not None and layer is not None:
            check_positive_int(layer, "layer")
            self.beta = math.log(theta / layer + 1)
        self.normalize = bool(normalize)
        self.add_self_loops = _resolve_loops(add_self_loops, self.normalize)
        self.weight1 = nn.Parameter(torch.empty(channels, channels))
        if shared_weights:
            self.register_parameter("weight2", None)
        else:
            self.weight2: Optional[nn.Parameter] = nn.Parameter(torch.empty(channels, channels))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot weights (PyG's initialization)."""
        glorot_(self.weight1)
        if self.weight2 is not None:
            glorot_(self.weight2)

    def forward(self, g: Graph, x: Tensor, x0: Tensor) -> Tensor:
        """``x, x0: [N, channels] -> [N, channels]``."""
        h = gops.propagate(g, x, "gcn" if self.normalize else "sum", add_self_loops=self.add_self_loops)
        h = h * (1 - self.alpha)
        r = self.alpha * x0
        b = self.beta
        if self.weight2 is None:
            p = h + r
            return (1 - b) * p + b * (p @ self.weight1)
        return (1 - b) * h + b * (h @ self.weight1) + (1 - b) * r + b * (r @ self.weight2)

    def extra_repr(self) -> str:
        return f"{self.channels}, alpha={self.alpha}, beta={self.beta:.4g}, shared={self.weight2 is None}"


# --------------------------------------------------------------------------- APPNP
class APPNPConv(nn.Module):
    r"""APPNP propagation (Gasteiger et al.): ``x_{k+1} = (1 - alpha) Â x_k + alpha x_0`` for ``K`` steps.

    ``Â = D^-1/2 (A + I) D^-1/2``; no parameters (PyG's ``torch_geometric.nn.APPNP`` layer, without
    its edge dropout).

    Parameters
    ----------
    K:
        Number of propagation steps (>= 1).
    alpha:
        Teleport (restart) probability.
    add_self_loops:
        Implicit self loops; ``None`` means ``normalize`` (PyG).
    normalize:
        GCN normalization; otherwise a (weighted) sum.
    """

    def __init__(self, K: int, alpha: float, add_self_loops: Optional[bool] = None, normalize: bool = True) -> None:
        super().__init__()
        self.K = check_positive_int(K, "K")
        self.alpha = check_probability(alpha, "alpha", upper_inclusive=True)
        self.normalize = bool(normalize)
        self.add_self_loops = _resolve_loops(add_self_loops, self.normalize)

    def reset_parameters(self) -> None:
        """No parameters; present for a uniform interface."""

    def forward(self, g: Graph, x: Tensor) -> Tensor:
        """``[N, F] -> [N, F]``."""
        norm = "gcn" if self.normalize else "sum"
        h0 = self.alpha * x
        for _ in range(self.K):
            x = (1 - self.alpha) * gops.propagate(g, x, norm, add_self_loops=self.add_self_loops) + h0
        return x

    def extra_repr(self) -> str:
        return f"K={self.K}, alpha={self.alpha}"


# --------------------------------------------------------------------------- SGC
class SGConv(nn.Module):
    r"""Simplified graph convolution (Wu et al.): ``X' = Â^K X W^T + b``, ``Â = D^-1/2 (A + I) D^-1/2``.

    Propagates ``K`` times then applies ``lin`` (PyG's order: the propagation involves no
    parameters, so it can be precomputed).

    Parameters
    ----------
    in_channels, out_channels:
        Feature sizes.
    K:
        Number of propagation steps (>= 1).
    add_self_loops:
        Implicit self loops.
    bias:
        Bias of ``lin``.
    """

    def __init__(self, in_channels: int, out_channels: int, K: int = 1, add_self_loops: bool = True,
                 bias: bool = True) -> None:
        super().__init__()
        self.in_channels = check_positive_int(in_channels, "in_channels")
        self.out_channels = check_positive_int(out_channels, "out_channels")
        self.K = check_positive_int(K, "K")
        self.add_self_loops = bool(add_self_loops)
        self.lin = Linear(in_channels, out_channels, bias=bias)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``torch.nn.Linear`` initialization (PyG's default for ``SGConv``)."""
        self.lin.reset_parameters()

    def forward(self, g: Graph, x: Tensor) -> Tensor:
        """``[N, in_channels] -> [N, out_channels]``.

        The propagations are linear, so ``Â^K (x W) + b`` equals ``(Â^K x) W + b``; the layer
        transforms first when that narrows the features (always for classifiers, and required
        for sparse input features, which propagate cannot take).
        """
        if self.out_channels < self.in_channels:
            x = x @ self.lin.weight.t()
            for _ in range(self.K):
                x = gops.propagate(g, x, "gcn", add_self_loops=self.add_self_loops)
            return x if self.lin.bias is None else x + self.lin.bias
        for _ in range(self.K):
            x = gops.propagate(g, x, "gcn", add_self_loops=self.add_self_loops)
        return self.lin(x)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, K={self.K}"
