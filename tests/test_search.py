"""The plan cost model, the planner's search and ``gc.plan`` without a strategy."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

import gnncompile as gc
from gnncompile import PlanningError, datasets
from gnncompile.cost_models import formulas
from gnncompile.cost_models.hardware import Cluster
from gnncompile.cost_models.model import PlanCost, static_memory
from gnncompile.ir.plan import AllReduce, Backward, Forward, HaloExchange
from gnncompile.passes.search import candidates, rank_counts, search


@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    return datasets.synthetic("sbm", num_nodes=600, avg_degree=8, num_features=16, num_classes=4, seed=3)


def gcn(g, hidden: int = 16, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return gc.nn.GCN(g.num_features, hidden, g.num_classes, num_layers=layers)


def small_gpu(memory: float) -> Cluster:
    """4 A5000-like devices with ``memory`` bytes each."""
    base = Cluster.parse("4xA5000")
    return dataclasses.replace(base, device=dataclasses.replace(base.device, memory=int(memory)), name="test")


# --------------------------------------------------------------------------- cost model
def test_instruction_costs_follow_the_formulas(sbm):
    p = gc.plan(gcn(sbm), sbm, "4xA5000", strategy="data")
    cluster = Cluster.parse("4xA5000")
    cost = PlanCost(p, cluster)
    link = cluster.intra
    for dp in p.ranks:
        for inst in dp.instructions:
            c = cost(dp.rank, inst)
            assert c.seconds >= 0
            if isinstance(inst, HaloExchange):
                out = [r * inst.width * 4 for r in inst.send_rows]
                into = [r * inst.width * 4 for r in inst.recv_rows]
                if inst.grad:
                    out, into = into, out
                assert c.stream == "comm"
                assert c.seconds == pytest.approx(formulas.all_to_all_time(out, into, link.bandwidth, link.latency))
            elif isinstance(inst, AllReduce):
                assert c.seconds == pytest.approx(
                    formulas.ring_allreduce_time(inst.numel * 4, 4, link.bandwidth, link.latency))
            elif isinstance(inst, (Forward, Backward)):
                assert c.stream == "compute" and c.seconds > 0


def test_backward_work_follows_what_needs_gradients(sbm):
    """x @ W on raw features needs only W's gradient; a hidden h @ W both; relu and propagate one."""
    p = gc.plan(gcn(sbm), sbm, "4xA5000", strategy="data", dropout="local")
    ops = {op.name: op for s in p.ranks[0].stages for op in s.costs}
    assert ops["convs_0_lin"].backward == 1 and ops["convs_1_lin"].backward == 2
    assert ops["relu"].backward == 1 and ops["propagate"].backward == 1
    cost = PlanCost(p, Cluster.parse("4xA5000"))
    for s in p.ranks[0].stages:
        if all(op.backward >= 2 for op in s.costs if op.kind == "T"):
            assert cost(0, Backward(s.index)).seconds > cost(0, Forward(s.index)).seconds


def test_memory_liveness_releases_everything_it_allocates(sbm):
    """After one step every activation, halo tensor and gradient buffer is released again."""
    for recompute in (False, True):
        p = gc.plan(gcn(sbm, layers=3), sbm, "4xA5000", strategy="data", recompute=recompute)
        pred = p.prediction
        for r, rs in enumerate(pred.simulation.ranks):
            base = pred.static[r].resident  # the gradients live from their backward to the optimizer step
            assert rs.memory_curve[0][1] >= base
            assert rs.memory_curve[-1][1] == base, f"rank {r} leaks {rs.memory_curve[-1][1] - base} bytes"
            assert rs.peak_memory > base


def test_static_memory_counts_what_the_rank_holds(sbm):
    p = gc.plan(gcn(sbm), sbm, "4xA5000", strategy="data")
    for dp in p.ranks:
        m = static_memory(p, dp)
        assert m.features == 4 * dp.sizes.nodes * sbm.num_features
        assert m.optimizer == 2 * m.parameters == 2 * 4 * p.info["params"]
        assert m.topology >= 8 * dp.sizes.edges  # the CSR and its transpose, int32 indices each


def test_static_memory_counts_sparse_features_as_stored(sbm):
    """Sparse CSR features stay sparse on the ranks: a rank holds their stored bytes per row (values,
    column indices, row pointer), not dense rows (here a tenth of the dense size's entries)."""
    x = sbm.x.clone()
    x[x.abs() < x.abs().quantile(0.9)] = 0  # a tenth of the entries stored
    sparse = sbm.replace(x=x.to(torch.float32).to_sparse_csr())
    p = gc.plan(gcn(sbm), sparse, "4xA5000", strategy="data")
    xs = sparse.x
    per_row = (xs.values().numel() * 12 + xs.crow_indices().numel() * 8) / sparse.num_nodes
    assert p.info["feature_bytes_per_row"] == pytest.approx(per_row)
    for dp in p.ranks:
        assert static_memory(p, dp).features == int(dp.sizes.nodes * per_row) < 4 * dp.sizes.nodes * sbm.num_features


def test_recomputation_trades_time_for_memory(sbm):
    """GAT: a checkpointed layer keeps its input instead of its attention's edge tensors. (GCN's
    hidden layer saves about its input's size anyway: ``relu``'s output and a bool mask, the linear
    layer's input being replayed from them, so checkpointing it gains nothing there.)"""
    torch.manual_seed(0)
    model = gc.nn.GAT(sbm.num_features, 8, sbm.num_classes, heads=4, num_layers=3)
    plain = gc.plan(model, sbm, "4xA5000", strategy="data", recompute=False)
    rec = gc.plan(model, sbm, "4xA5000", strategy="data", recompute=True)
    assert rec.prediction.max_peak_memory < plain.prediction.max_peak_memory
    assert rec.prediction.step_time > plain.prediction.step_time


def test_random_partition_predicts_more_traffic_and_time_than_metis(sbm):
    model = gcn(sbm)
    metis = gc.plan(model, sbm, "4xT4-eth15", strategy="data", partitioner="metis")
    rand = gc.plan(model, sbm, "4xT4-eth15", strategy="data", partitioner="random")
    assert sum(rand.predictions["bytes_sent"]) > sum(metis.predictions["bytes_sent"])
    assert rand.prediction.step_time > metis.prediction.step_time


# --------------------------------------------------------------------------- search
def test_rank_counts():
    assert rank_counts(Cluster.parse("8xA100")) == [8, 4, 2, 1]
    assert rank_counts(Cluster.parse("6xA100")) == [6, 4, 2, 1]
    assert rank_counts(Cluster.parse("A100")) == [1]


def test_candidates_keep_fixed_options():
    cands = candidates(Cluster.parse("4xA100"), fixed={"partitioner": "metis", "seed": 3})
    assert cands and all(c.options["seed"] == 3 for c in cands)
    data = [c for c in cands if c.strategy == "data"]
    assert data and all(c.options["partitioner"] == "metis" for c in data)
    assert all("partitioner" not in c.options for c in cands if c.strategy in ("tensor", "mop", "task"))
    assert {c.options["recompute"] for c in cands if c.strategy in ("data", "tensor", "task")} == {False, True}
    # task: with and without recomputation (regime, Eq. 7 split and chunks follow from the cost model);
    # task-decoupled training only where relaxations are allowed
    assert [c.options for c in cands if c.strategy == "task"] == [
        {"seed": 3, "recompute": rc, "decouple": False, "semantics": "exact"} for rc in (False, True)]
    # tensor: whole-graph all-to-alls with and without recomputation, and NeutronTP's chunk pipeline
    assert sorted((c.options["chunks"], c.options["recompute"]) for c in cands if c.strategy == "tensor") == [
        (1, False), (1, True), (8, False)]
    # mop: the naive MoA workflow and an RCM-ordered fine-grain pipeline
    assert {(c.options["chunks"], c.options["reorder"]) for c in cands if c.strategy == "mop"} == {(1, "none"),
                                                                                                (8, "rcm")}
    # layer: with and without recomputation, one stage per rank or GNNPipe's hybrid of 2 stages x 2
    # partitions, 4 (the default) or 2 chunks per rank; historical embeddings only where
    # relaxations are allowed
    assert [c.options for c in cands if c.strategy == "layer"] == [
        {"seed": 3, "recompute": rc, "history": False, "stages": s, "chunks": k, "semantics": "exact"}
        for rc in (False, True) for s in (None, 2) for k in (None, 8)]
    relaxed = candidates(Cluster.parse("4xA100"), semantics="relaxed", fixed={"seed": 3})
    assert sorted({(c.options["recompute"], c.options["history"]) for c in relaxed if c.strategy == "layer"}) == [
        (False, False), (False, True), (True, False), (True, True)]
    with pytest.raises(PlanningError, match="no lowering registered"):
        candidates(Cluster.parse("4xA100"), strategies=["nonsense"])


def test_search_ranks_by_predicted_time(sbm):
    res = search(gcn(sbm), sbm, Cluster.parse("4xA5000"))
    times = [e.step_time for e in res.ranked]
    assert times == sorted(times)
    # data 4, tensor 3, mop 2, task 2, layer 8 (recompute x stages 4 or 2 x chunks 16 or 8)
    assert len(res.ranked) + len(res.rejected) == len(candidates(Cluster.parse("4xA5000"), fixed={})) == 19


def test_fewer_devices_when_allowed(sbm):
    """On a 600-vertex graph over slow Ethernet, one device beats four: the search may say so."""
    p = gc.plan(gcn(sbm), sbm, "4xT4-eth15", devices="any")
    counts = {e.candidate.num_ranks for e in p.search.ranked}
    assert counts == {4, 2, 1}
    assert p.num_ranks == min(p.search.ranked, key=lambda e: e.step_time).candidate.num_ranks


@settings(max_examples=12, deadline=None)
@given(capacity_mib=st.floats(0.05, 64.0))
def test_search_never_returns_a_plan_that_does_not_fit(sbm, capacity_mib):
    cluster = small_gpu(capacity_mib * 2**20)
    model = gcn(sbm, hidden=32)
    try:
        p = gc.plan(model, sbm, cluster)
    except PlanningError as e:
        assert "too much" in str(e) or "exceeds a device" in str(e)
        # nothing fits: every candidate's prediction overflows
        res_all = search(model, sbm, small_gpu(1 << 40))
        assert all(e2.peak_memory > cluster.device.memory for e2 in res_all.ranked)
        return
    assert p.prediction.max_peak_memory <= cluster.device.memory
    for e in p.search.ranked:
        assert e.peak_memory <= cluster.device.memory


def test_nothing_fits_says_by_how_much_and_what_helps(sbm):
    with pytest.raises(PlanningError, match=r"no plan fits .* too much"):
        gc.plan(gcn(sbm), sbm, small_gpu(64 * 1024))


def test_relaxed_plans_are_never_returned_under_exact_semantics(sbm):
    class WithBatchNorm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = gc.nn.GCNConv(sbm.num_features, 8)
            self.bn = torch.nn.BatchNorm1d(8)
            self.conv2 = gc.nn.GCNConv(8, sbm.num_classes)

        def forward(self, g, x):
            return self.conv2(g, torch.relu(self.bn(self.conv1(g, x))))

    model = WithBatchNorm()
    with pytest.raises(PlanningError, match="not exact"):
        gc.plan(model, sbm, "4xA5000")  # data parallelism would change BatchNorm's statistics
    exact = gc.plan(model, sbm, "4xA5000", devices="any")
    assert exact.relaxations == () and exact.semantics == "exact" and exact.num_ranks == 1
    assert any("not exact" in e.rejected for e in exact.search.rejected)
    relaxed = gc.plan(model, sbm, "4xA5000", semantics="relaxed", devices="any")
    multi = [e for e in relaxed.search.ranked if e.candidate.num_ranks > 1]
    assert multi and all(e.plan.relaxations for e in multi)


def test_explicit_strategy_uses_every_device(sbm):
    p = gc.plan(gcn(sbm), sbm, 4, strategy="data")
    assert p.num_ranks == 4 and p.options["partitioner"] == "metis" and p.options["recompute"] is False
    assert len(p.search.ranked) == 1


def test_plan_chooses_without_a_strategy_and_explains(sbm, capsys):
    p = gc.plan(gcn(sbm), sbm, "4xA5000")
    assert p.strategy == "data"
    assert p.search.ranked[0].plan is p
    text = p.explanation()
    assert "wins" in text and "step time" in text and "peak mem/rank" in text
    p.explain()
    assert "Search over" in capsys.readouterr().out


def test_timeline_and_memory_plot(sbm, tmp_path):
    p = gc.plan(gcn(sbm), sbm, "4xA5000", strategy="data")
    assert p.timeline(tmp_path / "t.png").stat().st_size > 1000
    assert p.memory_plot(tmp_path / "m.png").stat().st_size > 1000
    loaded = gc.load_plan(p.save(tmp_path / "p.json"))
    with pytest.raises(PlanningError, match="prediction"):
        loaded.timeline(tmp_path / "x.png")


# --------------------------------------------------------------------------- statistics only
def test_planning_from_statistics_alone():
    stats = datasets.stats("ogbn-papers100M")
    torch.manual_seed(0)
    model = gc.nn.GCN(128, 128, 172, num_layers=3)
    p = gc.plan(model, stats, "8x8xA100-ib200")
    # mop's pipelines are pruned (their step bound exceeds tensor's simulated step) or ranked
    pruned = {e.candidate.strategy for e in p.search.rejected if e.rejected.startswith("pruned")}
    assert {e.candidate.strategy for e in p.search.ranked} | pruned == {"data", "tensor", "mop"}
    assert p.program is None  # statistics only: not runnable
    assert p.prediction.fits and p.prediction.max_peak_memory <= 80 * 2**30
    p = gc.plan(model, stats, "8x8xA100-ib200", strategy="data")
    part = p.info["partition"]
    assert part["estimated"] and part["replication_factor"] == pytest.approx(stats.replication[p.num_ranks])
    assert "Search over" in p.explanation()
    with pytest.raises(PlanningError, match="holds no program to run: it was planned from graph statistics"):
        p.run(epochs=1)


def test_single_device_papers100m_does_not_fit_an_a100():
    """NeutronTask Table 1: a 3-layer GCN on ogbn-papers100M needs hundreds of GB on one device."""
    stats = datasets.stats("ogbn-papers100M")
    torch.manual_seed(0)
    model = gc.nn.GCN(128, 128, 172, num_layers=3)
    with pytest.raises(PlanningError, match="no plan fits"):
        gc.plan(model, stats, "1xA100")


def test_graphstats_plan_matches_graph_plan_shape(sbm):
    """A plan from statistics has the same instruction structure as one from the graph."""
    model = gcn(sbm)
    stats = dataclasses.replace(sbm.stats(), replication={4: 1.5})
    a = gc.plan(model, sbm, "4xA5000", strategy="data")
    b = gc.plan(model, stats, "4xA5000", strategy="data")
    assert [[type(i) for i in dp.instructions] for dp in a.ranks] == [[type(i) for i in dp.instructions] for dp in b.ranks]
    assert b.info["partition"]["replication_factor"] == 1.5
    assert sum(dp.sizes.halo for dp in b.ranks) == pytest.approx(0.5 * sbm.num_nodes, rel=0.02)


# --------------------------------------------------------------------------- command line
def test_cli_plan_explains_on_a_named_cluster(capsys, tmp_path):
    from gnncompile.cli import main

    small = ["--dataset", "sbm", "--num-nodes", "300", "--num-features", "8", "--num-classes", "3"]
    assert main(["plan", *small, "--gpus", "2x4xA5000-ib200", "--explain",
                 "--timeline", str(tmp_path / "t.png"), "--memory-plot", str(tmp_path / "m.png")]) == 0
    out = capsys.readouterr().out
    assert "Search over" in out and "wins" in out and "ranks=8" in out
    assert (tmp_path / "t.png").exists() and (tmp_path / "m.png").exists()
    with pytest.raises(SystemExit) as exc:   # a cluster description that does not parse: a usage error
        main(["plan", *small, "--gpus", "4xB9000"])
    assert exc.value.code == 2 and "argument --gpus: unknown device model 'B9000'" in capsys.readouterr().err


def test_cli_plans_a_graph_known_by_its_statistics(capsys):
    from gnncompile.cli import main

    assert main(["plan", "--dataset", "ogbn-papers100M", "--layers", "3", "--hidden", "128",
                 "--gpus", "8x8xA100-ib200", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "Search over" in out and "ranks=64" in out and "ogbn-papers100M" in out


def test_an_option_the_named_strategy_lacks_is_refused() -> None:
    """partitioner is data's; given to split or tensor by name it was dropped without a word."""
    g = gc.datasets.synthetic("sbm", num_nodes=100, avg_degree=4, num_features=4, num_classes=2, seed=0)
    model = gc.nn.GCN(4, 4, 2)
    for strategy, extra in (("tensor", {}), ("split", dict(batch_size=16, fanouts=[2, 2]))):
        with pytest.raises(PlanningError, match=rf"strategy {strategy!r} has no option partitioner \(its options: "):
            gc.plan(model, g, gpus=2, strategy=strategy, partitioner="random", **extra)
    assert gc.plan(model, g, gpus=2, partitioner="random").program is not None   # the search: data's only
