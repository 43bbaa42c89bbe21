"""The ``data`` strategy end to end: lowering, local graphs, runtime on real ranks (gloo).

The property test draws small graphs (isolated vertices, self loops, directed edges), models from the
zoo, 1-4 ranks and every partitioner, and checks with :func:`gnncompile.testing.check_plan` that one
training step across ranks gives the single-device reference's loss, logits, gradients and updated
parameters (float64). Byte counters are compared with the closed form exactly.
"""

from __future__ import annotations

import copy
import math
import re
import time
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile import PlanningError, RuntimeFailure, ops
from gnncompile.graph.partition import PARTITIONERS
from gnncompile.graph.shard import build_shards
from gnncompile.ir.plan import HaloExchange, Plan
from gnncompile.ir.verify_plan import verify_plan
from gnncompile.passes.lower import split_stages
from gnncompile.passes.data import data_decisions
from gnncompile.testing import check_plan, reference_step
from graph_strategies import DT, small_graphs

MODELS: dict[str, Callable[[int, int], torch.nn.Module]] = {
    "gcn": lambda f, c: gc.nn.GCN(f, 6, c, num_layers=2, dropout=0.0),
    "sage": lambda f, c: gc.nn.GraphSAGE(f, 6, c, num_layers=2, dropout=0.0),
    "sage_max": lambda f, c: gc.nn.GraphSAGE(f, 6, c, num_layers=2, dropout=0.0, aggr="max"),
    "gat": lambda f, c: gc.nn.GAT(f, 3, c, num_layers=2, heads=2, dropout=0.0),
    "gin": lambda f, c: gc.nn.GIN(f, 6, c, num_layers=2, dropout=0.0),
    "gcnii": lambda f, c: gc.nn.GCNII(f, 6, c, num_layers=3, dropout=0.0),
    # with dropout: the ranks draw the single-device masks (replicated masks, the default)
    "gcn_dropout": lambda f, c: gc.nn.GCN(f, 6, c, num_layers=2, dropout=0.5),
    "gat_dropout": lambda f, c: gc.nn.GAT(f, 3, c, num_layers=2, heads=2, dropout=0.4),
    "gcnii_dropout": lambda f, c: gc.nn.GCNII(f, 6, c, num_layers=3, dropout=0.5),
}


def model_for(name: str, g: gc.Graph, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return MODELS[name](g.num_features, g.num_classes).to(DT)


@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    g = gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=5, num_features=6, num_classes=3, seed=1)
    return g.replace(x=g.x.to(DT))


# --------------------------------------------------------------------------- exactness across ranks
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=small_graphs(), name=st.sampled_from(sorted(MODELS)), ranks=st.integers(1, 4),
       partitioner=st.sampled_from(PARTITIONERS), recompute=st.booleans())
def test_one_step_matches_single_device(g: gc.Graph, name: str, ranks: int, partitioner: str,
                                        recompute: bool) -> None:
    ranks = min(ranks, g.num_nodes)
    # (strategy named: without it the search could return another strategy's plan, e.g. layer's)
    check_plan(model_for(name, g), g, ranks, strategy="data", partitioner=partitioner, recompute=recompute,
               rtol=1e-9, atol=1e-11, timeout=60)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_on_four_ranks_metis(sbm: gc.Graph, name: str) -> None:
    check_plan(model_for(name, sbm), sbm, 4, strategy="data", partitioner="metis", rtol=1e-9, atol=1e-11, timeout=60)


# --------------------------------------------------------------------------- bytes == closed form
def closed_form_bytes(plan: Plan, model: torch.nn.Module, graph: gc.Graph) -> tuple[list[int], list[int]]:
    """Per rank, from the partition alone: halo rows x width x element size per exchanged value, forward
    and (for values depending on parameters) backward, plus the ring all-reduce of the gradients."""
    from gnncompile.graph.partition import partition

    n = plan.num_ranks
    part = partition(graph, n, plan.options["partitioner"], seed=plan.options["seed"])
    hm = part.halo_matrix()  # [p, q] = rows p needs from q
    tp = gc.trace(model, graph)
    staged = split_stages(tp, data_decisions(tp))
    es = 8  # float64
    numel = sum(p.numel() for p in model.parameters())
    sent, recv = [], []
    for r in range(n):
        rows_out = int(hm[:, r].sum())  # rows others need from r
        rows_in = int(hm[r].sum())
        s = rv = 0
        for c in staged.conversions:
            w = math.prod(next(x for x in tp.graph.nodes if x.name == c.value).meta["tp"].dims)
            s += rows_out * w * es + (rows_in * w * es if c.needs_grad else 0)
            rv += rows_in * w * es + (rows_out * w * es if c.needs_grad else 0)
        ring = 2 * (n - 1) * numel * es // n if n > 1 else 0
        sent.append(s + ring)
        recv.append(rv + ring)
    return sent, recv


@pytest.mark.parametrize("name,partitioner", [("gcn", "metis"), ("gat", "random"), ("sage", "contiguous")])
def test_measured_bytes_equal_closed_form(sbm: gc.Graph, name: str, partitioner: str) -> None:
    model = model_for(name, sbm)
    plan = gc.plan(copy.deepcopy(model), sbm, gpus=3, partitioner=partitioner)
    res = plan.run(epochs=2, lr=0.01)
    sent, recv = closed_form_bytes(plan, model, sbm)
    assert [r.bytes_sent for r in res.ranks] == sent
    assert [r.bytes_received for r in res.ranks] == recv
    assert plan.predictions["bytes_sent"] == sent and plan.predictions["bytes_received"] == recv
    report = verify_plan(plan)
    assert [int(b) for b in report.bytes_sent] == sent
    # per peer: what r sends to q is what q receives from r
    for r in res.ranks:
        for q, b in r.sent_to.items():
            assert res.ranks[q].received_from[r.rank] == b
    # the halo volume summed over ranks is NeutronTask's (alpha - 1) |V| per exchanged row width
    halo_rows = sum(plan.info["halo_rows"])
    alpha = plan.info["partition"]["replication_factor"]
    assert halo_rows == round((alpha - 1) * sbm.num_nodes)


# --------------------------------------------------------------------------- plan structure
def test_plan_prints_verifies_and_round_trips(sbm: gc.Graph, tmp_path) -> None:
    model = model_for("gcn", sbm)
    plan = gc.plan(model, sbm, gpus=4, partitioner="metis")
    text = str(plan)
    assert "strategy=data" in text and "HALO convs_0_lin c0" in text and "AR grads" in text
    assert "relaxed transformations applied: none" in text
    verify_plan(plan)
    kinds = [type(i).__name__ for i in plan.ranks[0].instructions]
    assert kinds.count("HaloExchange") == 4 and kinds[-2:] == ["AllReduce", "OptimizerStep"]
    path = plan.save(tmp_path / "plan.json")
    data_only = gc.load_plan(path)
    assert data_only == plan
    assert data_only.program is None
    with pytest.raises(PlanningError, match="load_plan"):
        data_only.run(epochs=1)
    runnable = gc.load_plan(path, model, sbm)
    assert runnable.ranks == plan.ranks and runnable.program is not None
    other = gc.nn.GraphSAGE(sbm.num_features, 6, sbm.num_classes, num_layers=2).to(DT)
    with pytest.raises(gc.VerificationError, match="does not match"):
        gc.load_plan(path, other, sbm)


def test_halo_before_every_source_read(sbm: gc.Graph) -> None:
    model = model_for("gat", sbm)
    plan = gc.plan(model, sbm, gpus=2, partitioner="random")
    halos = [i for i in plan.ranks[0].instructions if isinstance(i, HaloExchange) and not i.grad]
    tp = gc.trace(model, sbm)
    from gnncompile.passes.lower import source_input
    read = {source_input(n).name for n in tp.graph.nodes if source_input(n) is not None}
    # GAT layer: the source attention scores (H wide, gathered onto edges) and the projected features
    # (H x C, propagated) are exchanged; nothing else (one exchange per value, however many readers)
    assert sorted(h.value for h in halos) == sorted(read) and len(read) == 4
    assert sorted(h.width for h in halos) == [1, 2, 3, 6]


def test_local_graph_propagation_matches_global(sbm: gc.Graph) -> None:
    from gnncompile import ops
    parts = torch.arange(sbm.num_nodes) % 3
    shards = build_shards(sbm, parts, 3, norms=[("gcn", True), ("mean", False)])
    x = torch.randn(sbm.num_nodes, 4, dtype=DT)
    for norm, loops in [("gcn", True), ("mean", False), ("sum", False)]:
        ref = ops.propagate(sbm, x, norm=norm, add_self_loops=loops)
        for s in shards:
            for lg in (s.graph, s.graph.to("cpu")):  # .to keeps the local structure and coefficients
                out = ops.propagate(lg, x[torch.cat([s.owned, s.halo])], norm=norm, add_self_loops=loops)
                torch.testing.assert_close(out, ref[s.owned], rtol=1e-12, atol=1e-14)


def test_row_mixing_op_refused_under_exact(sbm: gc.Graph) -> None:
    torch.manual_seed(0)
    model = gc.nn.ResGCN(sbm.num_features, 8, sbm.num_classes, num_layers=2, norm="batch").to(DT)
    with pytest.raises(PlanningError, match="BatchNorm1d"):
        gc.plan(model, sbm, gpus=2)
    plan = gc.plan(model, sbm, gpus=2, semantics="relaxed")
    assert plan.semantics == "relaxed" and plan.relaxations
    assert "per-rank statistics" in str(plan)
    assert "(evaluation)" not in str(plan.relaxations)  # evaluation normalizes with the running statistics


class _CentersInEvaluation(torch.nn.Module):
    def __init__(self, fin: int, fout: int) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(fin, 8), torch.nn.Linear(8, fout)

    def forward(self, g, x):
        h = ops.propagate(g, self.l1(x), norm="gcn")
        if not self.training:
            h = h - h.mean(0)
        return self.l2(h)


def test_row_mixing_in_evaluation_only_refused_under_exact(sbm: gc.Graph) -> None:
    """The evaluation trace is checked as the training trace is: a plan would evaluate each rank
    with its own rows' mean (accuracies unlike gc.train's) under an "exact" label."""
    model = _CentersInEvaluation(sbm.num_features, sbm.num_classes).to(DT)
    with pytest.raises(PlanningError, match=r"strategy 'data' is not exact for this model: mean \(evaluation\): "
                                            r"takes its output rows from the vertices as a whole"):
        gc.plan(model, sbm, gpus=2, strategy="data")
    plan = gc.plan(model, sbm, gpus=2, semantics="relaxed", strategy="data")
    assert any("mean (evaluation)" in r for r in plan.relaxations)


class _MixesRows(torch.nn.Module):
    def __init__(self, fin: int, fout: int, mix: str) -> None:
        super().__init__()
        self.l1, self.l2, self.mix = torch.nn.Linear(fin, 8), torch.nn.Linear(8, fout), mix

    def forward(self, g, x):
        h = ops.propagate(g, self.l1(x), norm="gcn")
        if self.mix == "batch_norm":
            h = F.batch_norm(h, None, None, training=True)
        elif self.mix == "softmax":
            h = torch.softmax(h, 0)
        else:
            h = torch.cumsum(h, 0)
        return self.l2(h)


@pytest.mark.parametrize("mix", ["batch_norm", "softmax", "cumsum"])
def test_functional_row_mixing_refused_by_every_strategy_under_exact(sbm: gc.Graph, mix: str) -> None:
    """Ops over dim 0 that keep the rows' shape (the tracer's row probe finds them): each strategy
    refuses them under exact semantics, naming the op; relaxed plans record the relaxation."""
    model = _MixesRows(sbm.num_features, sbm.num_classes, mix).to(DT)
    with pytest.raises(PlanningError, match=rf"no candidate plan.*{mix}: mixes vertices"):
        gc.plan(model, sbm, gpus=2)
    for strategy in ("data", "tensor", "task", "mop", "layer"):
        with pytest.raises(PlanningError, match=rf"strategy {strategy!r} is not exact for this model: {mix}: "
                                                rf"mixes vertices"):
            gc.plan(model, sbm, gpus=2, strategy=strategy)
    plan = gc.plan(model, sbm, gpus=2, semantics="relaxed", strategy="data")
    assert plan.semantics == "relaxed" and any(mix in r for r in plan.relaxations)


class _JumpingKnowledgeMax(torch.nn.Module):
    def __init__(self, fin: int, fout: int, dim: int) -> None:
        super().__init__()
        self.l1, self.l2, self.out, self.dim = torch.nn.Linear(fin, 8), torch.nn.Linear(8, 8), \
            torch.nn.Linear(8, fout), dim

    def forward(self, g, x):
        h1 = ops.propagate(g, self.l1(x), norm="gcn").relu()
        h2 = ops.propagate(g, self.l2(h1), norm="gcn").relu()
        return self.out(torch.stack([h1, h2], dim=self.dim).max(dim=self.dim)[0])


def test_stacking_layers_on_dim0_is_refused_once_with_the_form_that_plans(sbm: gc.Graph) -> None:
    """``torch.stack(hs, dim=0)`` puts the vertices on dim 1: refused under exact with the
    row-local form as a hint, said once for every candidate (not once per candidate), and that
    form (stack and reduce on dim -1) plans exact."""
    model = _JumpingKnowledgeMax(sbm.num_features, sbm.num_classes, 0).to(DT)
    with pytest.raises(PlanningError) as info:
        gc.plan(model, sbm, gpus=2)
    msg = str(info.value)
    assert re.search(r"no candidate plan could be built: \S+.* and \d+ more candidates: strategies 'data', 'tensor', "
                     r"'mop', 'task', 'layer' are not exact for this model: stack: stacks values on the vertices along dim 0.*stack along dim=-1", msg), msg
    assert msg.count("stacks values") == 1, msg
    plan = gc.plan(_JumpingKnowledgeMax(sbm.num_features, sbm.num_classes, -1).to(DT), sbm, gpus=2)
    assert plan.semantics == "exact"


class _ScalesByVertexCount(torch.nn.Module):
    def __init__(self, fin: int, fout: int, how: str) -> None:
        super().__init__()
        self.l1, self.l2, self.how = torch.nn.Linear(fin, 8), torch.nn.Linear(8, fout), how

    def forward(self, g, x):
        h = ops.propagate(g, self.l1(x), norm="gcn")
        if self.how == "scale":
            h = h * (100.0 / x.size(0))
        elif self.how == "divide":
            h = h / h.shape[0]
        else:  # the count as a shape: row-local
            h = h.view(x.size(0), 2, -1).flatten(1)
        return self.l2(h)


@pytest.mark.parametrize("how", ["scale", "divide"])
def test_a_scalar_made_from_the_vertex_count_is_refused_under_exact(sbm: gc.Graph, how: str) -> None:
    """Each rank would divide by its own number of rows (the loss was off by 2-30% under an exact
    label); the count used as a shape stays exact."""
    model = _ScalesByVertexCount(sbm.num_features, sbm.num_classes, how).to(DT)
    for strategy in ("data", "tensor", "task", "layer"):
        with pytest.raises(PlanningError, match=rf"strategy {strategy!r} is not exact for this model: \w+: reads the "
                                                rf"number of vertices"):
            gc.plan(model, sbm, gpus=2, strategy=strategy)
    shaped = _ScalesByVertexCount(sbm.num_features, sbm.num_classes, "view").to(DT)
    assert gc.plan(shaped, sbm, gpus=2, strategy="data").relaxations == ()


def test_planning_errors(sbm: gc.Graph) -> None:
    model = model_for("gcn", sbm)
    with pytest.raises(PlanningError, match="unknown strategy"):
        gc.plan(model, sbm, gpus=2, strategy="nope")
    with pytest.raises(PlanningError, match="partitioner"):
        gc.plan(model, sbm, gpus=2, partitioner="nope")
    with pytest.raises(PlanningError, match="at least one rank"):
        gc.plan(model, sbm, gpus=0)
    # planned, then every rank died in torch.optim.Adam ("empty parameter list")
    with pytest.raises(PlanningError, match="has no trainable parameters"):
        gc.plan(gc.nn.SGC(sbm.num_features, sbm.num_classes).requires_grad_(False), sbm, gpus=2)
    with pytest.raises(PlanningError, match="exceeds"):
        gc.plan(model, sbm, gpus=10_000)
    with pytest.raises(PlanningError, match="split: needs batch_size and fanouts"):
        gc.plan(model, sbm, gpus=2, strategy="split")  # split trains on sampled mini-batches only


# --------------------------------------------------------------------------- runtime behaviour
def test_run_reports_history_timeline_and_memory(sbm: gc.Graph) -> None:
    model = model_for("gcn", sbm)
    plan = gc.plan(model, sbm, gpus=2, partitioner="metis")
    res = plan.run(epochs=3, lr=0.01)
    h = res.history
    assert len(h.loss) == len(h.val_acc) == len(h.epoch_time) == 3
    assert all(0.0 <= a <= 1.0 for a in h.test_acc)
    for r in res.ranks:
        assert r.peak_memory > 0
        steps = {e.step for e in r.timeline}
        assert steps == {0, 1, 2}
        names = [e.instruction for e in r.timeline if e.step == 0]
        assert names == [str(i) for i in plan.ranks[r.rank].instructions]
        assert all(e.end >= e.start for e in r.timeline)


def test_local_dropout_masks_train_but_differ(sbm: gc.Graph) -> None:
    model = model_for("gcn_dropout", sbm)
    replicated = gc.plan(copy.deepcopy(model), sbm, gpus=2, partitioner="random")
    local = gc.plan(copy.deepcopy(model), sbm, gpus=2, partitioner="random", dropout="local")
    assert not any(n.startswith("dropout_index") for s in local.ranks[0].stages for n in s.inputs)
    assert any(n.startswith("dropout_index") for s in replicated.ranks[0].stages for n in s.inputs)
    ref = reference_step(copy.deepcopy(model), sbm)
    res = local.run(epochs=1, capture=True)
    assert math.isfinite(res.history.loss[0])
    assert not torch.allclose(res.captured["logits"], ref.logits)  # other masks, same distribution
    with pytest.raises(PlanningError, match="dropout mode"):
        gc.plan(model, sbm, gpus=2, dropout="sometimes")


def test_dead_rank_fails_the_run_naming_it(sbm: gc.Graph) -> None:
    model = model_for("gcn", sbm)
    plan = gc.plan(model, sbm, gpus=3, partitioner="random")
    t0 = time.monotonic()
    with pytest.raises(RuntimeFailure, match=r"rank 1") as info:
        plan.run(epochs=5, fail_at=(1, 2), timeout=60)
    assert time.monotonic() - t0 < 30
    assert "injected failure" in str(info.value)


# --------------------------------------------------------------------------- command line
def test_cli_plan_and_run(tmp_path, capsys) -> None:
    from gnncompile.cli import main

    small = ["--dataset", "sbm", "--num-nodes", "300", "--avg-degree", "4", "--num-features", "8",
             "--num-classes", "3", "--hidden", "8"]
    assert main(["plan", *small, "--gpus", "2", "--partitioner", "random", "--save", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "strategy=data" in out and "HALO" in out and (tmp_path / "p.json").exists()
    assert main(["run", *small, "--gpus", "2", "--epochs", "2", "--quiet", "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "per rank, one training step" in out
    import json
    rec = json.loads((tmp_path / "r.json").read_text())
    assert rec["ranks"] == 2 and len(rec["loss"]) == 2 and len(rec["bytes_sent"]) == 2
    with pytest.raises(SystemExit) as exit_:  # a usage error, before anything is loaded
        main(["plan", *small, "--gpus", "2", "--strategy", "split"])
    assert exit_.value.code == 2
    assert "--strategy split needs --batch-size B and --fanouts" in capsys.readouterr().err


def test_time_by_kind_groups_instructions() -> None:
    from gnncompile.runtime.executor import RankResult, TimelineEvent

    ev = [TimelineEvent(0, "F0c0", 0.0, 1.0), TimelineEvent(0, "HALO h c0", 1.0, 1.5),
          TimelineEvent(0, "HALO^T grad h c0", 2.0, 2.25), TimelineEvent(0, "B0c0", 3.0, 5.0),
          TimelineEvent(0, "AR grads", 5.0, 5.5), TimelineEvent(0, "OPT", 5.5, 6.0)]
    r = RankResult(0, 0, 0, {}, {}, {}, 0, ev, [6.0])
    assert r.time_by_kind() == {"F": 1.0, "HALO": 0.5, "HALO^T": 0.25, "B": 2.0, "AR": 0.5, "OPT": 0.5}


def test_cli_trace(tmp_path, capsys) -> None:
    from gnncompile.cli import main

    assert main(["trace", "--dataset", "sbm", "--num-nodes", "200", "--num-features", "8", "--model", "gat",
                 "--hidden", "4", "--heads", "2", "--dot", str(tmp_path / "g.dot")]) == 0
    out = capsys.readouterr().out
    assert "edge_attention" in out and "activation memory saved for backward" in out
    assert (tmp_path / "g.dot").read_text().startswith("digraph TPGraph")


def test_measured_timeline_picture(sbm: gc.Graph, tmp_path) -> None:
    from gnncompile.viz.timeline import instruction_kind

    assert [instruction_kind(s) for s in ("F0c1", "B2c0", "R1c0", "HALO h c0", "HALO^T grad h c0", "AR grads",
                                          "OPT", "SEND h c0 ->1", "A2A h c0 rows->cols")] == [
        "forward", "backward", "recompute", "halo", "halo", "all-reduce", "optimizer", "send/recv", "all-to-all"]
    res = gc.plan(model_for("gcn", sbm), sbm, gpus=2, partitioner="random").run(epochs=2)
    out = res.timeline(tmp_path / "timeline.png")
    assert out.exists() and out.stat().st_size > 1000
    with pytest.raises(ValueError, match="step 7"):
        res.timeline(tmp_path / "x.png", step=7)


def test_run_result_repr_is_one_line(sbm: gc.Graph) -> None:
    """repr(result) was a dataclass dump of every rank's timeline (45 KB after 2 epochs, growing
    with each): now one line saying what ran and how it went."""
    res = gc.plan(model_for("gcn", sbm), sbm, gpus=2, strategy="data").run(3, progress=False)
    text = repr(res)
    assert "\n" not in text and len(text) < 300, text
    assert text.startswith("RunResult(strategy='data', ranks=2, epochs=3, loss=") and "gloo" in text
    assert repr(res.ranks[0]).endswith(f"timeline=<{len(res.ranks[0].timeline)} events>)")
