"""Node-classification models built from :mod:`gnncompile.nn.layers`.

Every model has ``forward(self, g, x)`` returning ``[N, out_channels]`` logits, applies dropout
with :func:`torch.nn.functional.dropout` (active only in training mode), validates its sizes with
``ValueError`` messages naming the argument, and has ``reset_parameters()``.

Each model mirrors a PyG reference so weights can be copied and outputs compared:

| model | reference |
|---|---|
| :class:`GCN`, :class:`GraphSAGE`, :class:`GIN` | PyG ``models.GCN`` / ``GraphSAGE`` / ``GIN`` (``BasicGNN``) |
| :class:`GAT` | the GAT paper's Cora model (PyG ``examples/gat.py``) |
| :class:`GCNII` | PyG ``examples/gcn2_cora.py`` |
| :class:`APPNP` | PyG ``examples/citation/appnp.py`` |
| :class:`SGC` | PyG ``examples/sgc.py`` |
| :class:`ResGCN` | ``DeepGCNLayer(block="res+")`` stacks (PyG ``examples/ogbn_proteins_deepgcn.py``) |
"""

from __future__ import annotations

from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ArgumentError
from ..graph.core import Graph
from .functional import Linear, feature_dropout
from .layers import (
    APPNPConv,
    GATConv,
    GCN2Conv,
    GCNConv,
    GINConv,
    SAGEConv,
    SGConv,
    check_positive_int,
    check_probability,
)

__all__ = ["GCN", "GraphSAGE", "GAT", "GIN", "GCNII", "APPNP", "SGC", "ResGCN"]


def _dims(in_channels: int, hidden_channels: int, out_channels: int, num_layers: int) -> list[tuple[int, int]]:
    """``(in, out)`` sizes of ``num_layers`` layers: in -> hidden -> ... -> hidden -> out."""
    check_positive_int(in_channels, "in_channels")
    check_positive_int(hidden_channels, "hidden_channels")
    check_positive_int(out_channels, "out_channels")
    check_positive_int(num_layers, "num_layers")
    sizes = [in_channels] + [hidden_channels] * (num_layers - 1) + [out_channels]
    return list(zip(sizes[:-1], sizes[1:]))


def _reset_all(modules: nn.Module) -> None:
    for m in modules.children():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
        else:
            _reset_all(m)


class _ConvStack(nn.Module):
    """``convs`` applied in order with ReLU and dropout between them (PyG's ``BasicGNN`` order)."""

    convs: nn.ModuleList
    dropout: float

    def reset_parameters(self) -> None:
        """Reset every convolution."""
        _reset_all(self)

    def forward(self, g: Graph, x: Tensor) -> Tensor:
        """``[N, in_channels] -> [N, out_channels]`` logits."""
        last = len(self.convs) - 1
        for i, conv in enumerate(self.convs):
            x = conv(g, x)
            if i < last:
                x = F.relu(x)
                x = F.dropout(x, p=self.dropout, training=self.training)
        return x


# --------------------------------------------------------------------------- GCN
class GCN(_ConvStack):
    r"""Stack of :class:`GCNConv` (PyG's ``models.GCN``).

    ``x_{l+1} = dropout(relu(Â x_l W_l + b_l))`` for the hidden layers and ``Â x_{L-1} W + b``
    for the last one, ``Â = D^-1/2 (A + I) D^-1/2``.

    Parameters
    ----------
    in_channels, hidden_channels, out_channels:
        Input, hidden and output (class) sizes.
    num_layers:
        Number of convolutions (>= 1; one layer maps ``in -> out`` directly).
    dropout:
        Dropout probability after each hidden layer.
    add_self_loops, normalize:
        Passed to every :class:`GCNConv`.
    """

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, num_layers: int = 2,
                 dropout: float = 0.5, add_self_loops: Optional[bool] = None, normalize: bool = True) -> None:
        super().__init__()
        dims = _dims(in_channels, hidden_channels, out_channels, num_layers)
        self.dropout = check_probability(dropout, "dropout")
        self.num_layers = num_layers
        self.convs = nn.ModuleList(
            GCNConv(i, o, add_self_loops=add_self_loops, normalize=normalize) for i, o in dims)



# --------------------------------------------------------------------------- GraphSAGE
class GraphSAGE(_ConvStack):
    r"""Stack of :class:`SAGEConv` (PyG's ``models.GraphSAGE``).

    ``x_{l+1} = dropout(relu(W_l · aggr_{u->v} x_u + b + W_r x_v))``; no activation after the last.

    Parameters
    ----------
    in_channels, hidden_channels, out_channels:
        Input, hidden and output (class) sizes.
    num_layers:
        Number of convolutions (>= 1).
    dropout:
        Dropout probability after each hidden layer.
    aggr:
        ``"mean"``, ``"sum"`` or ``"max"`` (see :class:`SAGEConv`).
    """

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, num_layers: int = 2,
                 dropout: float = 0.5, aggr: str = "mean") -> None:
        super().__init__()
        dims = _dims(in_channels, hidden_channels, out_channels, num_layers)
        self.dropout = check_probability(dropout, "dropout")
        self.num_layers = num_layers
        self.convs = nn.ModuleList(SAGEConv(i, o, aggr=aggr) for i, o in dims)



# --------------------------------------------------------------------------- GAT
class GAT(nn.Module):
    r"""Graph attention network, the GAT paper's transductive model (PyG ``examples/gat.py``).

    Hidden layers: ``x = elu(GATConv(dropout(x)))`` with ``heads`` heads of ``hidden_channels``
    each, concatenated (``heads * hidden_channels`` features). Output layer:
    ``GATConv(dropout(x))`` with ``out_heads`` heads averaged. ``dropout`` is also the attention
    dropout of every layer. Cora defaults: 8 heads x 8 hidden, 1 output head, dropout 0.6.

    Parameters
    ----------
    in_channels:
        Input size.
    hidden_channels:
        Size **per head** of the hidden layers.
    out_channels:
        Number of classes.
    num_layers:
        Number of attention layers (>= 1).
    heads:
        Heads of the hidden layers.
    dropout:
        Feature dropout before every layer and attention dropout inside it.
    out_heads:
        Heads of the output layer (averaged; the paper uses 8 on PubMed).
    negative_slope:
        LeakyReLU slope of the attention scores.
    """

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, num_layers: int = 2,
                 heads: int = 8, dropout: float = 0.6, out_heads: int = 1, negative_slope: float = 0.2) -> None:
        super().__init__()
        check_positive_int(heads, "heads")
        check_positive_int(out_heads, "out_heads")
        _dims(in_channels, hidden_channels, out_channels, num_layers)
        self.dropout = check_probability(dropout, "dropout")
        self.num_layers = num_layers
        convs = []
        d = in_channels
        for _ in range(num_layers - 1):
            convs.append(GATConv(d, hidden_channels, heads=heads, concat=True, dropout=dropout,
                                 negative_slope=negative_slope))
            d = heads * hidden_channels
        convs.append(GATConv(d, out_channels, heads=out_heads, concat=False, dropout=dropout,
                             negative_slope=negative_slope))
        self.convs = nn.ModuleList(convs)

    def reset_parameters(self) -> None:
        """Reset every attention layer."""
        _reset_all(self)

    def forward(self, g: Graph, x: Tensor) -> Tensor:
        """``[N, in_channels] -> [N, out_channels]`` logits."""
        last = len(self.convs) - 1
        for i, conv in enumerate(self.convs):
            x = (feature_dropout if i == 0 else F.dropout)(x, p=self.dropout, training=self.training)
            x = conv(g, x)
            if i < last:
                x = F.elu(x)
        return x


# --------------------------------------------------------------------------- GIN
class GIN(nn.Module):
    r"""Stack of :class:`GINConv` with two-layer MLPs (PyG's ``models.GIN``).

    Layer ``l``: ``x = MLP_l((1 + eps) x + sum_{u->v} x_u)`` with
    ``MLP_l = Linear(d, o) -> ReLU -> Linear(o, o)``; ReLU and dropout after every layer but the last.

    Parameters
    ----------
    in_channels, hidden_channels, out_channels:
        Input, hidden and output (class) sizes.
    num_layers:
        Number of GIN layers (>= 1).
    dropout:
        Dropout probability after each hidden layer.
    eps, train_eps:
        Passed to every :class:`GINConv`.
    """

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, num_layers: int = 2,
                 dropout: float = 0.5, eps: float = 0.0, train_eps: bool = False) -> None:
        super().__init__()
        dims = _dims(in_channels, hidden_channels, out_channels, num_layers)
        self.dropout = check_probability(dropout, "dropout")
        self.num_layers = num_layers
        self.convs = nn.ModuleList(
            GINConv(nn.Sequential(Linear(i, o), nn.ReLU(), Linear(o, o)), eps=eps, train_eps=train_eps)
            for i, o in dims
        )

    def reset_parameters(self) -> None:
        """Reset every layer's MLP and ``eps``."""
        _reset_all(self)

    def forward(self, g: Graph, x: Tensor) -> Tensor:
        """``[N, in_channels] -> [N, out_channels]`` logits."""
        last = len(self.convs) - 1
        for i, conv in enumerate(self.convs):
            x = conv(g, x)
            if i < last:
                x = F.relu(x)
                x = F.dropout(x, p=self.dropout, training=self.training)
        return x


# --------------------------------------------------------------------------- GCNII
class GCNII(nn.Module):
    r"""GCNII (Chen et al. 2020), PyG ``examples/gcn2_cora.py``.

    ``x0 = relu(lin_in(dropout(x)))``; for ``l = 1..L``:
    ``x = relu(GCN2Conv_l(dropout(x), x0))`` with ``beta_l = log(theta / l + 1)``;
    ``logits = lin_out(dropout(x))``.

    Parameters
    ----------
    in_channels, hidden_channels, out_channels:
        Input, hidden and output (class) sizes.
    num_layers:
        Number of :class:`GCN2Conv` layers (>= 1).
    alpha, theta:
        Initial-residual and identity-mapping strengths.
    dropout:
        Dropout probability before every linear map and convolution.
    shared_weights:
        Passed to every :class:`GCN2Conv`.
    """

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, num_layers: int = 64,
                 alpha: float = 0.1, theta: float = 0.5, dropout: float = 0.6, shared_weights: bool = True) -> None:
        super().__init__()
        _dims(in_channels, hidden_channels, out_channels, num_layers)
        self.dropout = check_probability(dropout, "dropout")
        self.num_layers = num_layers
        self.lins = nn.ModuleList([Linear(in_channels, hidden_channels), Linear(hidden_channels, out_channels)])
        self.convs = nn.ModuleList(
            GCN2Conv(hidden_channels, alpha, theta, layer=l + 1, shared_weights=shared_weights)
            for l in range(num_layers)
        )

    def reset_parameters(self) -> None:
        """Reset the linear maps and every convolution."""
        _reset_all(self)

    def forward(self, g: Graph, x: Tensor) -> Tensor:
        """``[N, in_channels] -> [N, out_channels]`` logits."""
        x = feature_dropout(x, p=self.dropout, training=self.training)
        x = x0 = F.relu(self.lins[0](x))
        for conv in self.convs:
            x = F.dropout(x, p=self.dropout, training=self.training)
            x = F.relu(conv(g, x, x0))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.lins[1](x)


# --------------------------------------------------------------------------- APPNP
class APPNP(nn.Module):
    r"""Predict then propagate (Gasteiger et al.), PyG ``examples/citation/appnp.py``.

    ``h = MLP(x)`` (dropout before every linear map, ReLU between them), then ``K`` steps of
    ``z = (1 - alpha) Â z + alpha h`` (:class:`APPNPConv`).

    Parameters
    ----------
    in_channels, hidden_channels, out_channels:
        Input, hidden and output (class) sizes.
    num_layers:
        Number of linear layers of the MLP (>= 1).
    K, alpha:
        Propagation steps and teleport probability.
    dropout:
        Dropout probability before every linear map.
    """

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, num_layers: int = 2,
                 K: int = 10, alpha: float = 0.1, dropout: float = 0.5) -> None:
        super().__init__()
        dims = _dims(in_channels, hidden_channels, out_channels, num_layers)
        self.dropout = check_probability(dropout, "dropout")
        self.num_layers = num_layers
        self.lins = nn.ModuleList(Linear(i, o) for i, o in dims)
        self.prop = APPNPConv(K, alpha)

    def reset_parameters(self) -> None:
        """Reset the MLP."""
        _reset_all(self)

    def forward(self, g: Graph, x: Tensor) -> Tensor:
        """``[N, in_channels] -> [N, out_channels]`` logits."""
        last = len(self.lins) - 1
        for i, lin in enumerate(self.lins):
            x = (feature_dropout if i == 0 else F.dropout)(x, p=self.dropout, training=self.training)
            x = lin(x)
            if i < last:
                x = F.relu(x)
        return self.prop(g, x)


# --------------------------------------------------------------------------- SGC
class SGC(nn.Module):
    r"""Simplified graph convolution (Wu et al.), PyG ``examples/sgc.py``: ``logits = Â^K x W^T + b``.

    Has no hidden layer (``build_model`` ignores ``hidden``).

    Parameters
    ----------
    in_channels, out_channels:
        Input and output (class) sizes.
    K:
        Propagation steps (>= 1).
    dropout:
        Dropout probability on the input features (0 in the paper).
    """

    def __init__(self, in_channels: int, out_channels: int, K: int = 2, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = check_probability(dropout, "dropout")
        self.conv = SGConv(in_channels, out_channels, K=K)

    def reset_parameters(self) -> None:
        """Reset the linear map."""
        self.conv.reset_parameters()

    def forward(self, g: Graph, x: Tensor) -> Tensor:
        """``[N, in_channels] -> [N, out_channels]`` logits."""
        x = feature_dropout(x, p=self.dropout, training=self.training)
        return self.conv(g, x)


# --------------------------------------------------------------------------- ResGCN (DeepGCN)
class ResGCN(nn.Module):
    r"""Deep residual GCN with pre-activation ``res+`` blocks (Li et al., DeeperGCN).

    ::

        x = conv_0(encoder(x))
        for l in 1..L-1:  x = x + conv_l(dropout(relu(norm_l(x))))      # res+ block
        logits = decoder(dropout(relu(norm_0(x))))

    as PyG's ``DeepGCNLayer(conv, norm, ReLU, block="res+")`` stack in
    ``examples/ogbn_proteins_deepgcn.py`` (``norm_0`` normalizes the output of the last block).

    Parameters
    ----------
    in_channels, hidden_channels, out_channels:
        Input, hidden and output (class) sizes.
    num_layers:
        Number of graph convolutions (>= 1).
    dropout:
        Dropout probability inside every block and before the decoder.
    conv:
        ``"gcn"`` (:class:`GCNConv`), ``"sage"`` (:class:`SAGEConv`) or ``"gin"``
        (:class:`GINConv` with a two-layer MLP).
    norm:
        ``"layer"`` (``LayerNorm``), ``"batch"`` (``BatchNorm1d``) or ``"none"``.
    """

    CONVS = ("gcn", "sage", "gin")
    NORMS = ("layer", "batch", "none")

    def __init__(self, in_channels: int, hidden_channels: int, out_channels: int, num_layers: int = 28,
                 dropout: float = 0.1, conv: str = "gcn", norm: str = "layer") -> None:
        super().__init__()
        _dims(in_channels, hidden_channels, out_channels, num_layers)
        if conv not in self.CONVS:
            raise ArgumentError(f"conv: unknown convolution {conv!r}; valid: {', '.join(map(repr, self.CONVS))}")
        if norm not in self.NORMS:
            raise ArgumentError(f"norm: unknown normalization {norm!r}; valid: {', '.join(map(repr, self.NORMS))}")
        self.dropout = check_probability(dropout, "dropout")
        self.num_layers = num_layers
        self.conv_kind, self.norm_kind = conv, norm
        h = hidden_channels
        self.encoder = Linear(in_channels, h)
        self.convs = nn.ModuleList(self._make_conv(conv, h) for _ in range(num_layers))
        self.norms = nn.ModuleList(self._make_norm(norm, h) for _ in range(num_layers))
        self.decoder = Linear(h, out_channels)

    @staticmethod
    def _make_conv(kind: str, h: int) -> nn.Module:
        if kind == "gcn":
            return GCNConv(h, h)
        if kind == "sage":
            return SAGEConv(h, h)
        return GINConv(nn.Sequential(Linear(h, h), nn.ReLU(), Linear(h, h)))

    @staticmethod
    def _make_norm(kind: str, h: int) -> nn.Module:
        if kind == "layer":
            return nn.LayerNorm(h)
        if kind == "batch":
            return nn.BatchNorm1d(h)
        return nn.Identity()

    def reset_parameters(self) -> None:
        """Reset encoder, convolutions, norms and decoder."""
        _reset_all(self)

    def forward(self, g: Graph, x: Tensor) -> Tensor:
        """``[N, in_channels] -> [N, out_channels]`` logits."""
        x = self.convs[0](g, self.encoder(x))
        for conv, norm in zip(self.convs[1:], self.norms[1:]):
            h = F.relu(norm(x))
            h = F.dropout(h, p=self.dropout, training=self.training)
            x = x + conv(g, h)
        x = F.relu(self.norms[0](x))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.decoder(x)
