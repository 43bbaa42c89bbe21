"""Functional helpers shared by the models."""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

__all__ = ["feature_dropout"]


def feature_dropout(x: torch.Tensor, p: float = 0.5, training: bool = True) -> torch.Tensor:
    """``F.dropout`` that also accepts sparse CSR input features.

    For a sparse ``x`` the stored values are dropped and rescaled: the zeros of ``x`` stay zero
    under dropout anyway, so this has exactly the distribution of dropout on the dense matrix
    without materializing it. Dense inputs go to ``F.dropout`` unchanged. An fx leaf (one T node).
    """
    if isinstance(x, torch.fx.Proxy):  # fx leaf: record one node whatever the import style
        return x.tracer.create_proxy("call_function", feature_dropout, (x,), {"p": p, "training": training})
    if x.layout != torch.sparse_csr:
        return F.dropout(x, p=p, training=training)
    if not training or p == 0.0:
        return x
    values = F.dropout(x.values(), p=p, training=True)
    return torch.sparse_csr_tensor(x.crow_indices(), x.col_indices(), values, size=x.shape,
                                   check_invariants=False)
