"""GNN layers and models written with the :mod:`gnncompile.ops` primitives.

Layers (``forward(g, x)``; :class:`GCN2Conv` takes ``forward(g, x, x0)``): :class:`GCNConv`,
:class:`SAGEConv`, :class:`GATConv`, :class:`GINConv`, :class:`GCN2Conv`, :class:`APPNPConv`,
:class:`SGConv`. Models (``forward(g, x)`` -> logits): :class:`GCN`, :class:`GraphSAGE`,
:class:`GAT`, :class:`GIN`, :class:`GCNII`, :class:`APPNP`, :class:`SGC`, :class:`ResGCN`.

``MODELS`` maps the short names used by the CLI to model classes and :func:`build_model` builds
one by name.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from ..errors import ArgumentError
from .layers import APPNPConv, GATConv, GCN2Conv, GCNConv, GINConv, SAGEConv, SGConv, check_positive_int
from .models import APPNP, GAT, GCN, GCNII, GIN, SGC, GraphSAGE, ResGCN

__all__ = [
    "GCNConv",
    "SAGEConv",
    "GATConv",
    "GINConv",
    "GCN2Conv",
    "APPNPConv",
    "SGConv",
    "GCN",
    "GraphSAGE",
    "GAT",
    "GIN",
    "GCNII",
    "APPNP",
    "SGC",
    "ResGCN",
    "MODELS",
    "build_model",
]

MODELS: dict[str, type[nn.Module]] = {
    "gcn": GCN,
    "sage": GraphSAGE,
    "gat": GAT,
    "gin": GIN,
    "gcnii": GCNII,
    "appnp": APPNP,
    "sgc": SGC,
    "resgcn": ResGCN,
}


def build_model(name: str, in_dim: int, hidden: int, out_dim: int, **kwargs: Any) -> nn.Module:
    """Build the model registered as ``name`` in :data:`MODELS`.

    Parameters
    ----------
    name:
        One of ``MODELS`` (case-insensitive).
    in_dim, hidden, out_dim:
        Input, hidden and output sizes. Models without a hidden layer (``sgc``) ignore ``hidden``.
    **kwargs:
        Further constructor arguments (``num_layers``, ``dropout``, ``heads``, ...). For ``sgc``,
        which has no layers, ``num_layers`` is taken as its number of hops ``K`` (SGC with ``K``
        hops is a ``K``-layer GCN without non-linearities), so one command line fits every model.

    Raises
    ------
    ValueError
        For an unknown name (listing the valid ones), a keyword the model does not take (listing
        the ones it does), or an invalid value (from the model's own validation).
    """
    key = name.lower() if isinstance(name, str) else name
    if key not in MODELS:
        raise ArgumentError(f"model: unknown name {name!r}; valid: {', '.join(sorted(MODELS))}")
    cls = MODELS[key]
    params = inspect.signature(cls.__init__).parameters
    if "num_layers" in kwargs and "num_layers" not in params and "K" in params:
        if "K" in kwargs:
            raise ArgumentError(f"{key}: give K or num_layers (an alias of K for this model), not both")
        kwargs["K"] = check_positive_int(kwargs.pop("num_layers"), "num_layers")
    accepted = [p for p in params if p not in ("self", "in_channels", "hidden_channels", "out_channels")]
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown:
        raise ArgumentError(
            f"{key}: unexpected argument(s) {', '.join(unknown)}; valid: {', '.join(accepted) or 'none'}"
        )
    if "hidden_channels" in params:
        return cls(in_dim, hidden, out_dim, **kwargs)
    return cls(in_dim, out_dim, **kwargs)
