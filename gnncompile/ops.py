"""Public namespace of the graph primitives (``gnncompile.ops.propagate`` ...).

See :mod:`gnncompile.frontend.ops` for their definitions.
"""

from .frontend.ops import (  # noqa: F401
    BACKWARD_PRODUCTS,
    NORMS,
    PRIMITIVES,
    REDUCES,
    aggregate,
    backward_product,
    dropout_noise,
    dst_rows,
    edge_attention,
    edge_softmax,
    gather_dst,
    gather_src,
    is_primitive,
    masked_propagate,
    mask_generator,
    plan_dropout_draws,
    propagate,
    set_backward_product,
)

__all__ = ["propagate", "gather_src", "gather_dst", "edge_softmax", "edge_attention", "aggregate", "dst_rows", "masked_propagate",
           "dropout_noise", "plan_dropout_draws", "mask_generator", "PRIMITIVES", "NORMS", "REDUCES", "is_primitive", "BACKWARD_PRODUCTS",
           "set_backward_product", "backward_product"]
