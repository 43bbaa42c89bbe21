"""Input feature layout: a mostly-zero dense feature matrix read only by linear layers is stored as CSR.

Bag-of-words features (cora, citeseer, the Amazon and Wikipedia graphs) are stored dense but are 1-5%
non-zero. When every reader of the model's input ``x`` is a :class:`gnncompile.nn.functional.Linear`
(which multiplies a CSR ``x`` without densifying it, forward and backward), storing ``x`` as CSR
computes the same function (the products skip zero terms: the sums differ only in rounding) with
``2 nnz width`` FLOPs instead of ``2 N K width``, and holds ``nnz`` values and column indices
instead of ``N K`` values. :func:`choose_feature_layout` makes that choice for the planner
(``gc.plan(..., features=...)``):

- ``"auto"`` (default): CSR when the model qualifies, at most a third of ``x`` is non-zero (CSR is
  then smaller), and the cost models predict the linear layers reading ``x`` faster on the
  cluster's device with CSR (forward plus backward, whole graph);
- ``"dense"``: ``x`` as given;
- ``"csr"``: CSR whenever the model qualifies; otherwise a :class:`~gnncompile.errors.PlanningError`
  naming the op that reads ``x`` another way.

Features that are already CSR stay CSR under every choice. A model that reads ``x`` with anything
else (dropout on ``x`` draws one random number per stored value, so its masks would differ from
dense training's; a propagation; a plain ``torch.nn.Linear``) keeps ``x`` dense under ``"auto"``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from ..cost_models.hardware import Cluster
from ..cost_models.model import op_time
from ..errors import PlanningError
from ..frontend.tracer import trace
from ..graph.core import Graph, GraphStats
from ..ir.plan import RankSizes
from ..ir.tpgraph import TPGraph
from ..nn.functional import Linear
from .lower import op_costs

__all__ = ["FEATURE_LAYOUTS", "FeatureLayout", "choose_feature_layout", "linear_readers", "trace_both", "MAX_CSR_DENSITY"]

#: The values of ``gc.plan(..., features=)``.
FEATURE_LAYOUTS = ("auto", "dense", "csr")

#: The largest share of non-zeros for which ``"auto"`` considers CSR: above it the CSR copy (a value and a
#: column index per non-zero) is larger than the dense matrix.
MAX_CSR_DENSITY = 1 / 3


@dataclass
class FeatureLayout:
    """The planner's choice of the input feature layout.

    ``graph``: the graph to plan with (``x`` converted to CSR when ``layout == "csr"`` and it was
    dense); ``layout``: ``"dense"`` or ``"csr"`` (what the ranks hold); ``converted``: whether this
    choice converted a dense ``x``; ``note``: one line for ``plan.explain()`` (empty when nothing
    was decided: statistics only, no features, features already CSR); ``tp``/``tp_eval``: the traces
    for ``graph`` (re-traced after a conversion: the linear layers' costs are the CSR products').
    """

    graph: Union[Graph, GraphStats]
    layout: str
    converted: bool
    note: str
    tp: TPGraph
    tp_eval: TPGraph


def trace_both(model: torch.nn.Module, graph: Union[Graph, GraphStats]) -> tuple[TPGraph, TPGraph]:
    """``model``'s training- and eval-mode traces for ``graph`` (the model's mode is left as it was)."""
    was_training = model.training
    try:
        return trace(model, graph, training=True), trace(model, graph, training=False)
    finally:
        model.train(was_training)


def linear_readers(tp: TPGraph) -> tuple[list[torch.fx.Node], Optional[torch.fx.Node]]:
    """The nodes of ``tp`` that read the input features (its second placeholder), and the first of
    them that is not a call of a :class:`gnncompile.nn.functional.Linear` (``None``: all are)."""
    placeholders = [n for n in tp.graph.nodes if n.op == "placeholder"]
    if len(placeholders) < 2:
        return [], None
    readers = list(placeholders[1].users)
    for n in readers:
        if n.op != "call_module" or not isinstance(tp.get_submodule(n.target), Linear):
            return readers, n
    return readers, None


def _reader_seconds(tp: TPGraph, readers: list[torch.fx.Node], graph: Graph, cluster: Cluster) -> float:
    """Predicted forward plus backward seconds of ``readers`` over the whole graph on one of
    ``cluster``'s devices."""
    sizes = RankSizes(nodes=graph.num_nodes, edges=graph.num_edges)
    device = cluster.rank_device(0)
    costs = op_costs(tp, readers)
    return sum(op_time(c, sizes, device) + op_time(c, sizes, device, backward=True) for c in costs)


def _describe(node: torch.fx.Node) -> str:
    return f"{node.op} {node.target if node.op != 'call_function' else getattr(node.target, '__name__', node.target)}"


def choose_feature_layout(model: torch.nn.Module, graph: Union[Graph, GraphStats], cluster: Cluster,
                          tp: TPGraph, tp_eval: TPGraph, features: str = "auto") -> FeatureLayout:
    """Decide how ranks hold ``graph.x`` (see the module docstring); ``tp``/``tp_eval`` are the
    model's training- and eval-mode traces for ``graph`` as given."""
    if features not in FEATURE_LAYOUTS:
        raise PlanningError(f"features: expected one of {', '.join(map(repr, FEATURE_LAYOUTS))}, got {features!r}")
    x = graph.x if isinstance(graph, Graph) else None
    if x is None or x.layout == torch.sparse_csr:
        layout = "csr" if x is not None else "dense"
        return FeatureLayout(graph, layout, False, "", tp, tp_eval)
    if features == "dense":
        return FeatureLayout(graph, "dense", False, "", tp, tp_eval)
    readers, other = linear_readers(tp)
    if other is None and tp_eval is not None:
        _, other = linear_readers(tp_eval)
    if not readers or other is not None or x.dim() != 2 or not x.is_floating_point():
        if features == "csr":
            why = (f"the model reads x with {_describe(other)}" if other is not None else
                   "the model does not read x" if not readers else "x is not a 2-D floating-point matrix")
            raise PlanningError(f"features='csr': {why}; only gnncompile.nn.functional.Linear layers multiply CSR "
                                "features as the dense ones (use features='auto' or 'dense')")
        return FeatureLayout(graph, "dense", False, "", tp, tp_eval)
    nnz = int(torch.count_nonzero(x))
    density = nnz / max(1, x.numel())
    if features == "auto" and density > MAX_CSR_DENSITY:
        return FeatureLayout(graph, "dense", False, "", tp, tp_eval)
    sparse = graph.replace(x=x.to_sparse_csr(), validate=False)
    tp_csr, tp_eval_csr = trace_both(model, sparse)
    what = (f"input features {x.shape[0]} x {x.shape[1]}, {density:.2%} non-zero, read only by linear layers "
            f"({', '.join(str(n.target) for n in readers)})")
    if features == "auto":
        dense_s = _reader_seconds(tp, readers, graph, cluster)
        sparse_s = _reader_seconds(tp_csr, [n for n in tp_csr.graph.nodes if n.name in {r.name for r in readers}],
                                   sparse, cluster)
        where = f"their forward and backward over the whole graph on one {cluster.device.name}"
        if sparse_s >= dense_s:
            return FeatureLayout(graph, "dense", False, f"{what}: kept dense (predicted {dense_s * 1e3:.3g} ms for "
                                 f"{where}, {sparse_s * 1e3:.3g} ms as CSR)", tp, tp_eval)
        why = f"predicted {sparse_s * 1e3:.3g} ms for {where}, {dense_s * 1e3:.3g} ms dense"
    else:
        why = "features='csr'"
    return FeatureLayout(sparse, "csr", True, f"{what}: stored as CSR ({why}; exact: the products skip zero "
                         "terms; features='dense' keeps them dense)", tp_csr, tp_eval_csr)
