"""The planner's input feature layout (:mod:`gnncompile.passes.features`): a mostly-zero dense ``x``
read only by linear layers is held as CSR, exactly; other models and dense features keep ``x`` dense."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile import PlanningError
from gnncompile.passes.features import MAX_CSR_DENSITY, choose_feature_layout, linear_readers, trace_both
from gnncompile.testing import check_plan

DT = torch.float64


def bag_of_words(num_nodes: int = 90, features: int = 200, density: float = 0.03, seed: int = 0) -> gc.Graph:
    """An SBM graph whose dense features are 0/1 with ``density`` of them ones, row-normalized (cora's
    kind of input)."""
    g = gc.datasets.synthetic("sbm", num_nodes=num_nodes, avg_degree=4, num_features=features, num_classes=3,
                              seed=seed)
    gen = torch.Generator().manual_seed(seed)
    x = (torch.rand(num_nodes, features, generator=gen) < density).to(DT)
    x[:, 0] = 1.0  # no empty row
    return g.replace(x=x).normalize_features()


def gcn(g: gc.Graph, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    return gc.nn.GCN(g.num_features, 8, g.num_classes, num_layers=2, dropout=dropout).to(DT)


def test_auto_holds_mostly_zero_features_as_csr_and_says_why() -> None:
    g = bag_of_words()
    p = gc.plan(gcn(g), g, 2, strategy="data")
    assert p.options["features"] == "csr"
    assert "input features held as CSR" in str(p)
    note = next(n for n in p.search.notes if "input features" in n)
    assert "non-zero" in note and "convs.0.lin" in note and "stored as CSR" in note
    # the ranks hold CSR rows; the user's graph is untouched
    assert g.x.layout == torch.strided
    held = [prog.step.inputs["x"] for prog in p.program]
    assert [x.layout for x in held] == [torch.sparse_csr] * 2
    assert sum(int(x._nnz()) for x in held) >= int(torch.count_nonzero(g.x))


def test_csr_plan_trains_as_the_dense_model() -> None:
    g = bag_of_words()
    res = check_plan(gcn(g, dropout=0.5), g, 2, strategy="data")
    assert res.plan.options["features"] == "csr"


@pytest.mark.parametrize("strategy", ["tensor", "task", "mop", "layer"])
def test_csr_features_are_exact_under_other_strategies(strategy: str) -> None:
    g = bag_of_words(seed=2)
    res = check_plan(gcn(g), g, 2, strategy=strategy)
    assert res.plan.options["features"] == "csr"


@pytest.mark.parametrize("strategy", ["data", "split"])
def test_csr_features_are_exact_in_sampled_mini_batches(strategy: str) -> None:
    g = bag_of_words(seed=3)
    res = check_plan(gcn(g), g, 2, strategy=strategy, batch_size=int(g.train_mask.sum()), fanouts=[3, 2],
                     device="cpu")
    assert res.plan.options["features"] == "csr"


def test_dense_keeps_dense_and_auto_keeps_dense_features_dense() -> None:
    g = bag_of_words()
    assert gc.plan(gcn(g), g, 2, strategy="data", features="dense").options["features"] == "dense"
    full = g.replace(x=torch.rand(g.num_nodes, g.num_features, dtype=DT) + 0.1)
    assert gc.plan(gcn(full), full, 2, strategy="data").options["features"] == "dense"


def test_density_bound() -> None:
    # just above a third non-zero: auto keeps dense (CSR would be larger); csr still converts on request
    g = bag_of_words(features=60, density=MAX_CSR_DENSITY + 0.1)
    x = g.x.clone()
    x[:, :] = 0.0
    x[:, : int(g.num_features * (MAX_CSR_DENSITY + 0.05)) + 1] = 1.0
    g = g.replace(x=x)
    assert gc.plan(gcn(g), g, 2, strategy="data").options["features"] == "dense"
    assert gc.plan(gcn(g), g, 2, strategy="data", features="csr").options["features"] == "csr"


def test_models_that_read_x_otherwise_keep_it_dense() -> None:
    g = bag_of_words()
    torch.manual_seed(0)
    gat = gc.nn.GAT(g.num_features, 4, g.num_classes, num_layers=2, heads=2, dropout=0.5).to(DT)
    # GAT drops features before its first layer: the masks of a CSR x would differ from dense training's
    assert gc.plan(gat, g, 2, strategy="data").options["features"] == "dense"
    with pytest.raises(PlanningError, match="features='csr': the model reads x with .*dropout"):
        gc.plan(gat, g, 2, strategy="data", features="csr")

    class PlainLinear(torch.nn.Module):  # torch.nn.Linear densifies a CSR input's transpose every step
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(g.num_features, g.num_classes)

        def forward(self, g, x):
            return gc.ops.propagate(g, self.lin(x), "gcn", add_self_loops=True)

    tp, _ = trace_both(PlainLinear().to(DT), g)
    readers, other = linear_readers(tp)
    assert [n.target for n in readers] == ["lin"] and other is readers[0]
    assert gc.plan(PlainLinear().to(DT), g, 2, strategy="data").options["features"] == "dense"


def test_csr_features_stay_csr_and_bad_values_are_refused() -> None:
    g = bag_of_words()
    sparse = g.replace(x=g.x.to_sparse_csr())
    for choice in ("auto", "dense", "csr"):
        assert gc.plan(gcn(g), sparse, 2, strategy="data", features=choice).options["features"] == "csr"
    with pytest.raises(PlanningError, match="features: expected one of 'auto', 'dense', 'csr', got 'coo'"):
        gc.plan(gcn(g), g, 2, strategy="data", features="coo")


def test_statistics_only_plans_record_dense() -> None:
    g = bag_of_words()
    p = gc.plan(gcn(g), gc.GraphStats.from_graph(g), 2, strategy="data")
    assert p.options["features"] == "dense"


def test_saved_plan_reloads_with_its_layout(tmp_path) -> None:
    g = bag_of_words()
    p = gc.plan(gcn(g), g, 2, strategy="data")
    p.save(tmp_path / "plan.json")
    again = gc.load_plan(tmp_path / "plan.json", gcn(g), g)
    assert again.options["features"] == "csr"
    dense = gc.plan(gcn(g), g, 2, strategy="data", features="dense")
    dense.save(tmp_path / "dense.json")
    assert gc.load_plan(tmp_path / "dense.json", gcn(g), g).options["features"] == "dense"


def test_auto_compares_the_cost_models_predictions() -> None:
    g = bag_of_words()
    model = gcn(g)
    cluster = gc.Cluster.parse("2xcpu")
    tp, tp_eval = trace_both(model, g)
    chosen = choose_feature_layout(model, g, cluster, tp, tp_eval)
    assert chosen.layout == "csr" and chosen.converted and chosen.graph.x.layout == torch.sparse_csr
    assert torch.equal(chosen.graph.x.to_dense(), g.x)
    assert "ms for their forward and backward over the whole graph" in chosen.note
    # the CSR trace costs the first layer by its stored entries, the dense one by N K width
    lin = {n.name: n.meta["tp"].flops for n in tp.graph.nodes if n.name == "convs_0_lin"}["convs_0_lin"]
    lin_csr = {n.name: n.meta["tp"].flops for n in chosen.tp.graph.nodes
               if n.name == "convs_0_lin"}["convs_0_lin"]
    assert lin_csr.v < lin.v / 10
    # where neither layout's products cost anything but the op's fixed cost, dense stays (no gain)
    free = dataclasses.replace(cluster.device, flops={"float32": 1e30, "float64": 1e30}, mem_bandwidth=1e30)
    kept = choose_feature_layout(model, g, dataclasses.replace(cluster, device=free), tp, tp_eval)
    assert kept.layout == "dense" and kept.graph is g and "kept dense" in kept.note


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(density=st.floats(0.005, 0.2), ranks=st.integers(1, 3), seed=st.integers(0, 5))
def test_property_csr_layout_is_exact(density: float, ranks: int, seed: int) -> None:
    g = bag_of_words(num_nodes=40, features=64, density=density, seed=seed)
    res = check_plan(gcn(g, dropout=0.3), g, ranks, strategy="data", features="csr")
    assert res.plan.options["features"] == "csr"
