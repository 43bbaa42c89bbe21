"""Negative tests of the operator-graph verifier: traced IR corrupted by hand must be rejected with a
VerificationError naming the faulty node (and showing its neighbourhood)."""

from __future__ import annotations

import operator
import re
from typing import Any, Callable

import pytest
import torch
import torch.fx

import gnncompile as gc
from gnncompile.errors import VerificationError
from gnncompile.ir.symbolic import Lin
from gnncompile.ir.tpgraph import TPGraph, TPInfo
from gnncompile.ir.verify import verify

STATS = gc.GraphStats(num_nodes=100, num_edges=400, num_features=7, num_classes=3)
V_ROWS, E_ROWS, EV_ROWS = Lin.of(v=1), Lin.of(e=1), Lin.of(v=1, e=1)


def gcn() -> TPGraph:
    """A fresh 2-layer GCN trace: x -> convs_0_lin -> propagate -> add -> relu -> dropout ->
    convs_1_lin -> propagate_1 -> add_1 -> output."""
    torch.manual_seed(0)
    return gc.trace(gc.nn.GCN(7, 16, 3), STATS)


class _UnfusedGAT(torch.nn.Module):
    """A one-layer GAT written with the unfused primitives (gathers, add, leaky_relu, edge_softmax)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(7, 4, bias=False)
        self.att_src = torch.nn.Parameter(torch.randn(1, 2, 2))
        self.att_dst = torch.nn.Parameter(torch.randn(1, 2, 2))

    def forward(self, g: Any, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x).view(-1, 2, 2)
        scores = gc.ops.gather_src(g, (h * self.att_src).sum(-1), True) \
            + gc.ops.gather_dst(g, (h * self.att_dst).sum(-1), True)
        alpha = gc.ops.edge_softmax(g, torch.nn.functional.leaky_relu(scores, 0.2), True)
        return gc.ops.propagate(g, h, "none", edge_weight=alpha, add_self_loops=True).reshape(-1, 4)


def gat() -> TPGraph:
    """GAT attention written with the unfused primitives."""
    torch.manual_seed(0)
    return gc.trace(_UnfusedGAT(), STATS)


def gat_fused() -> TPGraph:
    """The zoo's GAT (``edge_attention``)."""
    torch.manual_seed(0)
    return gc.trace(gc.nn.GAT(7, 2, 3, heads=2), STATS)


def sage_max() -> TPGraph:
    torch.manual_seed(0)
    return gc.trace(gc.nn.GraphSAGE(7, 16, 3, aggr="max"), STATS)


def node(tp: TPGraph, name: str) -> torch.fx.Node:
    return next(n for n in tp.graph.nodes if n.name == name)


def annotate(tp: TPGraph, name: str, **changes: Any) -> None:
    n = node(tp, name)
    n.meta["tp"] = n.meta["tp"].with_(**changes)


def expect_failure(tp: TPGraph, name: str, pattern: str) -> VerificationError:
    """verify(tp) fails on node ``name`` with a message matching ``pattern`` and its neighbourhood."""
    with pytest.raises(VerificationError, match=f"node {re.escape(repr(name))}: {pattern}") as info:
        verify(tp)
    assert re.search(rf"^  >> {re.escape(name)} = ", str(info.value), re.M), str(info.value)
    return info.value


@pytest.mark.parametrize("build", [gcn, gat, gat_fused, sage_max])
def test_traced_graphs_verify(build: Callable[[], TPGraph]) -> None:
    tp = build()
    assert verify(tp) is tp
    assert verify(tp.bind(gc.GraphStats(10, 20, 7, 3))) is not tp


def test_not_a_tpgraph() -> None:
    with pytest.raises(VerificationError, match="verify expects a TPGraph, got "):
        verify(torch.fx.symbolic_trace(torch.nn.Linear(2, 2)))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- annotations and kinds
def test_missing_annotation() -> None:
    tp = gcn()
    del node(tp, "relu").meta["tp"]
    err = expect_failure(tp, "relu", re.escape("missing TPInfo annotation (node.meta['tp'])"))
    assert "<no annotation>" in str(err)


def test_annotation_of_the_wrong_type() -> None:
    tp = gcn()
    node(tp, "dropout").meta["tp"] = {"kind": "T"}
    expect_failure(tp, "dropout", "missing TPInfo annotation")


def test_unknown_kind() -> None:
    tp = gcn()
    annotate(tp, "relu", kind="Q")
    expect_failure(tp, "relu", "unknown kind 'Q'; valid: T, P, E, input, param, output")


def test_wrong_kind_on_a_primitive() -> None:
    tp = gcn()
    annotate(tp, "propagate", kind="T")
    expect_failure(tp, "propagate", "primitive propagate is a P op but is annotated 'T'")
    tp = gat()
    annotate(tp, "edge_softmax", kind="P")
    expect_failure(tp, "edge_softmax", "primitive edge_softmax is a E op but is annotated 'P'")


def test_p_kind_on_a_non_primitive() -> None:
    tp = gcn()
    annotate(tp, "relu", kind="P")
    expect_failure(tp, "relu", r"only a P primitive \(gnncompile.ops.propagate\) may be a P op")


def test_wrong_kind_on_placeholder_and_param() -> None:
    tp = gcn()
    annotate(tp, "x", kind="T")
    expect_failure(tp, "x", "placeholder node must have kind 'input', has 'T'")
    tp = gcn()
    annotate(tp, "convs_0_bias", kind="T")
    expect_failure(tp, "convs_0_bias", "get_attr node must have kind 'param', has 'T'")


# --------------------------------------------------------------------------- row spaces
def test_propagate_annotated_with_edge_rows() -> None:
    tp = gcn()
    annotate(tp, "propagate", rows=E_ROWS)
    expect_failure(tp, "propagate", "propagate writes rows in space V, annotation says E")


def test_propagate_reading_edge_rows() -> None:
    tp = gcn()
    annotate(tp, "convs_0_lin", rows=E_ROWS)
    expect_failure(tp, "propagate", "propagate reads rows in space V, its input has rows E")


def test_gather_with_the_wrong_self_loop_space() -> None:
    # GAT gathers with implicit self loops: E+V rows, not E
    tp = gat()
    annotate(tp, "gather_src", rows=E_ROWS)
    expect_failure(tp, "gather_src", r"gather_src writes rows in space E\+V, annotation says E")
    # the converse: the call drops its self loops while the annotation keeps E+V
    tp = gat()
    n = node(tp, "gather_dst")
    n.args = n.args[:2] + (False,)
    expect_failure(tp, "gather_dst", r"gather_dst writes rows in space E, annotation says E\+V")


def test_edge_softmax_and_aggregate_spaces() -> None:
    tp = gat()
    annotate(tp, "leaky_relu", rows=E_ROWS)
    expect_failure(tp, "edge_softmax", r"edge_softmax reads rows in space E\+V, its input has rows E")
    tp = sage_max()
    annotate(tp, "aggregate", rows=E_ROWS)
    expect_failure(tp, "aggregate", "aggregate writes rows in space V, annotation says E")
    tp = sage_max()
    annotate(tp, "gather_src", rows=V_ROWS)
    expect_failure(tp, "gather_src", "gather_src writes rows in space E, annotation says V")


def test_edge_attention_spaces() -> None:
    tp = gat_fused()
    annotate(tp, "edge_attention", rows=E_ROWS)
    expect_failure(tp, "edge_attention", r"edge_attention writes rows in space E\+V, annotation says E")
    tp = gat_fused()
    dst = node(tp, "edge_attention").args[2]
    annotate(tp, dst.name, rows=EV_ROWS)
    expect_failure(tp, "edge_attention", r"edge_attention reads dst_scores in space V, its input has rows E\+V")


def test_propagate_edge_weight_rows() -> None:
    tp = gat_fused()
    weight = node(tp, "propagate").kwargs["edge_weight"]
    annotate(tp, weight.name, rows=E_ROWS)
    expect_failure(tp, "propagate", r"propagate edge_weight must have rows E\+V, has E")


# --------------------------------------------------------------------------- dims, layers
def test_linear_input_dims_mismatch() -> None:
    tp = gcn()
    annotate(tp, "dropout", dims=(17,))
    expect_failure(tp, "convs_1_lin", "Linear expects 16 input features, its input has 17")


def test_linear_output_dims_mismatch() -> None:
    tp = gcn()
    annotate(tp, "convs_1_lin", dims=(4,))
    expect_failure(tp, "convs_1_lin", "Linear produces 3 features, annotation says 4")


def test_layer_decreasing_along_an_edge() -> None:
    tp = gcn()
    assert node(tp, "add").meta["tp"].layer == 2
    annotate(tp, "relu", layer=1)
    expect_failure(tp, "relu", "layer 1 consumes 'add' of later layer 2")


# --------------------------------------------------------------------------- the graph input
def _insert_after(tp: TPGraph, after: str, target: Callable[..., Any], args: tuple, info: TPInfo) -> torch.fx.Node:
    with tp.graph.inserting_after(node(tp, after)):
        new = tp.graph.call_function(target, args)
    new.meta["tp"] = info
    return new


def test_graph_input_used_by_a_non_primitive() -> None:
    tp = gcn()
    g = node(tp, "g")
    read = _insert_after(tp, "x", getattr, (g, "num_nodes"), TPInfo(kind="T", layer=1, op="getattr"))
    expect_failure(tp, read.name, "the graph input 'g' is used outside a graph primitive")


def test_graph_input_passed_as_a_tensor_argument() -> None:
    tp = gcn()
    prop = node(tp, "propagate")
    prop.args = (prop.args[0], node(tp, "g")) + prop.args[2:]
    expect_failure(tp, "propagate", "the graph input 'g' is used outside a graph primitive")


def test_primitive_without_the_graph() -> None:
    tp = gcn()
    prop = node(tp, "propagate")
    prop.args = (node(tp, "x"),) + prop.args[1:]
    expect_failure(tp, "propagate", "primitive propagate must take the graph input 'g' as its first argument, takes 'x'")


# --------------------------------------------------------------------------- structure
def test_two_outputs() -> None:
    tp = gcn()
    out = next(n for n in tp.graph.nodes if n.op == "output")
    second = tp.graph.output(node(tp, "relu"))
    second.meta["tp"] = out.meta["tp"]
    expect_failure(tp, second.name, r"expected a single output node, found 2 \('output', 'output_1'\)")


def test_output_not_a_single_tensor() -> None:
    tp = gcn()
    out = next(n for n in tp.graph.nodes if n.op == "output")
    out.args = ((out.args[0], node(tp, "relu")),)
    expect_failure(tp, "output", "the output must be a single tensor")


def test_use_before_definition_fails_lint() -> None:
    tp = gcn()
    node(tp, "add").prepend(node(tp, "relu"))  # relu now runs before its input
    with pytest.raises(VerificationError, match=r"malformed fx graph: .*'add'.*'relu'.*before it has been defined"):
        verify(tp)


def test_missing_graph_input() -> None:
    tp = gcn()
    # a graph whose only input is x: rebuild it without g (propagates then take x twice)
    g = node(tp, "g")
    for user in list(g.users):
        user.args = (node(tp, "x"),) + user.args[1:]
    tp.graph.erase_node(g)
    with pytest.raises(VerificationError, match=r"node 'x': expected inputs \(g, x\)"):
        verify(tp)


def test_error_shows_the_neighbourhood() -> None:
    tp = gcn()
    annotate(tp, "relu", kind="P")
    err = str(expect_failure(tp, "relu", "only a P primitive"))
    lines = err.splitlines()[1:]
    # the node, its input and its user, in graph order, each with its annotation
    assert [ln.split(" = ")[0].strip() for ln in lines] == ["add", ">> relu", "dropout"]
    assert "relu = call_function[relu](add)  # P L2 rows=V dims=(16,)" in err


def test_operator_targets_render_by_name() -> None:
    tp = gcn()
    relu = node(tp, "relu")
    extra = _insert_after(tp, "relu", operator.mul, (relu, 2.0), TPInfo(kind="T", layer=1, rows=V_ROWS, dims=(16,)))
    expect_failure(tp, extra.name, "layer 1 consumes 'relu' of later layer 2")
