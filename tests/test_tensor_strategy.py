"""The ``tensor`` strategy (NeutronTP): P ops on feature columns, T ops on vertex rows, all-to-all between.

The property test draws small graphs, models with only T and P ops, 1-4 ranks (widths that do not
divide by the rank count included) and recomputation on/off, and checks with
:func:`gnncompile.testing.check_plan` that one training step equals the single-device reference
(float64). Bytes are compared with NeutronTP's closed form.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile import PlanningError, ops
from gnncompile.cost_models import formulas
from gnncompile.ir.plan import AllToAll
from gnncompile.passes.tensor import column_splits, row_blocks
from gnncompile.testing import check_plan
from graph_strategies import DT, labelled, small_graphs

MODELS: dict[str, Callable[[int, int], torch.nn.Module]] = {
    "gcn": lambda f, c: gc.nn.GCN(f, 5, c, num_layers=2, dropout=0.0),
    "sage": lambda f, c: gc.nn.GraphSAGE(f, 5, c, num_layers=2, dropout=0.0),
    "gin": lambda f, c: gc.nn.GIN(f, 5, c, num_layers=2, dropout=0.0),
    "gcnii": lambda f, c: gc.nn.GCNII(f, 5, c, num_layers=3, dropout=0.0),
    "gcn_dropout": lambda f, c: gc.nn.GCN(f, 5, c, num_layers=2, dropout=0.5),
    "gcnii_dropout": lambda f, c: gc.nn.GCNII(f, 5, c, num_layers=3, dropout=0.5),
}


def model_for(name: str, g: gc.Graph) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name](g.num_features, g.num_classes).to(DT)


@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    g = gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=5, num_features=6, num_classes=3, seed=1)
    return g.replace(x=g.x.to(DT))


# --------------------------------------------------------------------------- exactness
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=small_graphs(), name=st.sampled_from(sorted(MODELS)), ranks=st.integers(1, 4), recompute=st.booleans())
def test_one_step_matches_single_device(g: gc.Graph, name: str, ranks: int, recompute: bool) -> None:
    ranks = min(ranks, g.num_nodes)
    check_plan(model_for(name, g), g, ranks, strategy="tensor", recompute=recompute, rtol=1e-9, atol=1e-11,
               timeout=60)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_on_three_ranks(sbm: gc.Graph, name: str) -> None:
    """Three ranks: the hidden width 5 and the 3 classes split unevenly (2/2/1, 1/1/1)."""
    check_plan(model_for(name, sbm), sbm, 3, strategy="tensor", rtol=1e-9, atol=1e-11, timeout=60)


# --------------------------------------------------------------------------- layout and bytes
def test_splits_are_balanced() -> None:
    assert column_splits(5, 3) == [2, 2, 1] and column_splits(2, 4) == [1, 1, 0, 0]
    assert row_blocks(10, 4) == [3, 3, 2, 2] and sum(row_blocks(10, 4)) == 10


def test_plan_alternates_layouts(sbm: gc.Graph) -> None:
    p = gc.plan(model_for("gcn", sbm), sbm, 4, strategy="tensor")
    a2a = [i for i in p.ranks[0].instructions if isinstance(i, AllToAll)]
    # per layer: rows->cols before the propagation, cols->rows after it; both again for the gradients
    assert [(i.src_layout, i.dst_layout, i.grad) for i in a2a[:4]] == [
        ("rows", "cols", False), ("cols", "rows", False), ("rows", "cols", False), ("cols", "rows", False)]
    assert len(a2a) == 8
    ops_layout = {op.name: op.layout for s in p.ranks[0].stages for op in s.costs}
    assert ops_layout["propagate"] == "cols" and ops_layout["convs_0_lin"] == "rows"


def test_bytes_equal_neutrontp_closed_form() -> None:
    """Widths and vertex counts that divide: the total is 4 (N-1)/N V D L (forward and backward)."""
    g = labelled(gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=5, num_features=6, num_classes=8, seed=2),
                 num_classes=8, num_features=6)
    torch.manual_seed(0)
    model = gc.nn.GCN(6, 8, 8, num_layers=2, dropout=0.0).to(DT)
    for n in (2, 4):
        p = gc.plan(model, g, n, strategy="tensor")
        ring = 2 * (n - 1) * p.info["params"] * 8 // n
        conversions = sum(p.predictions["bytes_sent"]) - n * ring
        assert conversions == formulas.comm_tensor(120, 8, 2, num_workers=n, elsize=8)


def test_measured_bytes_equal_predicted(sbm: gc.Graph) -> None:
    p = gc.plan(model_for("gcn", sbm), sbm, 3, strategy="tensor")
    res = p.run(epochs=2, timeout=60)
    assert [r.bytes_sent for r in res.ranks] == p.predictions["bytes_sent"]
    assert [r.bytes_received for r in res.ranks] == p.predictions["bytes_received"]


# --------------------------------------------------------------------------- what is refused
def test_edge_ops_are_refused(sbm: gc.Graph) -> None:
    torch.manual_seed(0)
    for model in (gc.nn.GAT(6, 3, 3, heads=2), gc.nn.GraphSAGE(6, 5, 3, aggr="max")):
        with pytest.raises(PlanningError, match="edge-wise op"):
            gc.plan(model.to(DT), sbm, 2, strategy="tensor")


def test_output_in_columns_is_gathered_back_to_rows(sbm: gc.Graph) -> None:
    class EndsWithPropagation(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(6, 3)

        def forward(self, g, x):
            return ops.propagate(g, self.lin(x), norm="gcn", add_self_loops=True)

    torch.manual_seed(0)
    model = EndsWithPropagation().to(DT)
    p = gc.plan(model, sbm, 3, strategy="tensor")
    last = [str(i) for i in p.ranks[0].instructions if isinstance(i, AllToAll)]
    assert last[1] == "A2A propagate c0 cols->rows" and last[2] == "A2A grad propagate c0 cols->rows"
    check_plan(model, sbm, 3, strategy="tensor", rtol=1e-9, atol=1e-11, timeout=60)


def test_batchnorm_is_refused_under_exact(sbm: gc.Graph) -> None:
    class WithBatchNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = gc.nn.GCNConv(6, 4)
            self.bn = torch.nn.BatchNorm1d(4)
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, g, x):
            return self.lin(torch.relu(self.bn(self.conv(g, x))))

    with pytest.raises(PlanningError, match="not exact"):
        gc.plan(WithBatchNorm().to(DT), sbm, 2, strategy="tensor")
    relaxed = gc.plan(WithBatchNorm().to(DT), sbm, 2, strategy="tensor", semantics="relaxed")
    assert relaxed.relaxations


# --------------------------------------------------------------------------- planner
def test_planner_considers_tensor(sbm: gc.Graph) -> None:
    p = gc.plan(model_for("gcn", sbm), sbm, "4xA5000")
    strategies = {e.candidate.strategy for e in p.search.ranked}
    assert {"data", "tensor", "mop"} <= strategies
    assert p.prediction.step_time == min(e.step_time for e in p.search.ranked)


def test_tensor_plan_from_statistics() -> None:
    stats = gc.datasets.stats("ogbn-papers100M")
    torch.manual_seed(0)
    p = gc.plan(gc.nn.GCN(128, 128, 172, num_layers=3), stats, "8x8xA100-ib200", strategy="tensor")
    assert p.program is None and p.prediction.step_time > 0
    assert p.ranks[0].sizes["all_nodes"] == stats.num_nodes


# --------------------------------------------------------------------------- decoupled (NeutronTP §4.1)
@pytest.mark.parametrize("layers", [2, 4, 8])
def test_decoupled_tensor_has_four_collectives_per_step(sbm: gc.Graph, layers: int) -> None:
    torch.manual_seed(0)
    model = gc.nn.GCN(6, 5, 3, num_layers=layers, dropout=0.5).to(DT)
    p = gc.plan(model, sbm, 3, strategy="tensor", decouple=True, semantics="relaxed")
    a2a = [i for i in p.ranks[0].instructions if isinstance(i, AllToAll)]
    assert len(a2a) == 4 and [i.grad for i in a2a] == [False, False, True, True]
    assert p.relaxations and "decoupled" in p.relaxations[0] and p.semantics == "relaxed"


def test_decoupled_tensor_equals_the_decoupled_model_on_one_rank(sbm: gc.Graph) -> None:
    """n ranks train the decoupled model exactly as one rank does (the decoupled single-device reference)."""
    results = []
    for n in (1, 3):
        torch.manual_seed(0)
        model = gc.nn.GCN(6, 5, 3, num_layers=2, dropout=0.5).to(DT)
        p = gc.plan(model, sbm, n, strategy="tensor", decouple=True, semantics="relaxed")
        results.append(p.run(epochs=1, seed=0, capture=True, update_model=False, timeout=60))
    one, three = results
    torch.testing.assert_close(torch.tensor(three.history.loss[0]), torch.tensor(one.history.loss[0]),
                               rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(three.captured["logits"], one.captured["logits"], rtol=1e-9, atol=1e-11)
    for name, g in one.captured["grads"].items():
        torch.testing.assert_close(three.captured["grads"][name], g, rtol=1e-9, atol=1e-11)


def test_decoupling_a_nonlinear_model_is_refused_under_exact(sbm: gc.Graph) -> None:
    torch.manual_seed(0)
    with pytest.raises(PlanningError, match="decoupling changes this model"):
        gc.plan(gc.nn.GCN(6, 5, 3).to(DT), sbm, 2, strategy="tensor", decouple=True)
    # the planner never proposes it under exact semantics
    p = gc.plan(gc.nn.GCN(6, 5, 3).to(DT), sbm, "2xA5000")
    assert all(not e.candidate.options.get("decouple") for e in p.search.ranked + p.search.rejected)
