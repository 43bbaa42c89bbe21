"""The ``task`` strategy (NeutronTask): T and P tasks on different ranks, chunks pipelined; exact.

One training step equals the single-device reference in the three regimes of NeutronTask §4.1
(fewer ranks than tasks, one task per rank, hybrid groups), for GCN, GraphSAGE, GIN and GAT
(attention dropout included), with any chunk count; bytes per step follow the closed form.
"""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile import PlanningError
from gnncompile.cost_models.formulas import task_gpu_split
from gnncompile.ir.plan import Forward, Recv, Send
from gnncompile.passes.chunked import contiguous_runs
from gnncompile.passes.task import _spread, place_tasks
from gnncompile.testing import check_plan, reference_step
from graph_strategies import DT, sbm_graph, seeded_model, small_graphs

MODELS: dict[str, Callable[[int, int], torch.nn.Module]] = {
    "gcn": lambda f, c: gc.nn.GCN(f, 5, c, num_layers=2, dropout=0.5),
    "gcn3": lambda f, c: gc.nn.GCN(f, 4, c, num_layers=3, dropout=0.5),
    "sage": lambda f, c: gc.nn.GraphSAGE(f, 5, c, num_layers=2, dropout=0.0),
    "gin": lambda f, c: gc.nn.GIN(f, 5, c, num_layers=2, dropout=0.0),
    "gat": lambda f, c: gc.nn.GAT(f, 3, c, heads=2, num_layers=2, dropout=0.5),
}


def model_for(name: str, g: gc.Graph) -> torch.nn.Module:
    return seeded_model(MODELS[name], g)


@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    return sbm_graph(90)


# --------------------------------------------------------------------------- exactness
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(g=small_graphs(), name=st.sampled_from(sorted(MODELS)), ranks=st.integers(2, 4), chunks=st.integers(1, 4))
def test_one_step_matches_single_device(g: gc.Graph, name: str, ranks: int, chunks: int) -> None:
    check_plan(model_for(name, g), g, ranks, strategy="task", chunks=min(chunks, g.num_nodes), rtol=1e-9,
               atol=1e-11, timeout=60)


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("ranks", [2, 5, 7])
def test_every_regime(sbm: gc.Graph, name: str, ranks: int) -> None:
    """2 ranks: every T task on one, every P task on the other; 5: about one task per rank; 7: hybrid
    groups dealing the 6 chunks round robin (with a gradient all-reduce inside the group)."""
    res = check_plan(model_for(name, sbm), sbm, ranks, strategy="task", chunks=6, rtol=1e-9, atol=1e-11,
                     timeout=60)
    assert res.plan.info["regime"] in ("shared", "one per rank", "hybrid")


@pytest.mark.parametrize("name, make", [
    ("sgc", lambda: gc.nn.SGC(6, 3, K=2)),                              # chained propagations: a task each
    ("appnp", lambda: gc.nn.APPNP(6, 5, 3, K=3, dropout=0.0)),
])
@pytest.mark.parametrize("ranks", [2, 5])
def test_chained_propagations_are_tasks_of_their_own(sbm: gc.Graph, name: str, make: Callable, ranks: int) -> None:
    torch.manual_seed(0)
    res = check_plan(make().to(DT), sbm, ranks, strategy="task", chunks=4, rtol=1e-9, atol=1e-11, timeout=60)
    labels = [s.kinds for dp in res.plan.ranks for s in dp.stages]
    assert sum(k.startswith("P") for k in labels) >= 2


@pytest.mark.parametrize("name", ["gcn", "gat", "gcn3"])
def test_recomputation(sbm: gc.Graph, name: str) -> None:
    """T intermediates recomputed in backward (NeutronTask §5.1, Fig. 8c): dropout masks replay."""
    res = check_plan(model_for(name, sbm), sbm, 3, strategy="task", chunks=4, recompute=True, rtol=1e-9,
                     atol=1e-11, timeout=60)
    assert res.plan.options["recompute"]


def _decoupled_step(sbm: gc.Graph, layers: int, strategy: str, n: int, **kw):
    """The plan and one captured step of a decoupled GCN (dropout 0.5, float64) under ``strategy`` on ``n`` ranks."""
    torch.manual_seed(0)
    model = gc.nn.GCN(6, 5, 3, num_layers=layers, dropout=0.5).to(DT)
    p = gc.plan(model, sbm, n, strategy=strategy, decouple=True, semantics="relaxed", **kw)
    return p, p.run(epochs=1, seed=0, capture=True, update_model=False, timeout=60)


def test_task_decoupled_equals_the_decoupled_model_on_one_rank(sbm: gc.Graph) -> None:
    """Task-decoupled training (§5.1, Fig. 8b): all T tasks, then the propagations, each a P task;
    4 ranks train the decoupled model exactly as one rank of the decoupled tensor plan does."""
    _, one = _decoupled_step(sbm, 3, "tensor", 1)
    plan, four = _decoupled_step(sbm, 3, "task", 4, chunks=4)
    assert plan.relaxations and "decoupled" in plan.relaxations[0]
    kinds = [s.kinds.split()[0][0] for dp in plan.ranks for s in sorted(dp.stages, key=lambda s: s.index)]
    assert kinds.count("P") == 3  # one P task per propagation
    torch.testing.assert_close(torch.tensor(four.history.loss[0]), torch.tensor(one.history.loss[0]),
                               rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(four.captured["logits"], one.captured["logits"], rtol=1e-9, atol=1e-11)
    for name, g in one.captured["grads"].items():
        torch.testing.assert_close(four.captured["grads"][name], g, rtol=1e-9, atol=1e-11)


def test_decoupled_bytes(sbm: gc.Graph) -> None:
    """Task-decoupled traffic (NeutronTask §5.1): the MLP's output crosses to the first P task and
    each P task hands its output to the next: (M - 1) |V| d per direction for a chain of M ranks
    (d = classes after decoupling), whatever the depth."""
    torch.manual_seed(0)
    model = gc.nn.GCN(6, 5, 3, num_layers=3, dropout=0.0).to(DT)
    for ranks, chain in ((2, 2), (4, 4)):  # T | P1 P2 P3 on one rank;  T | P1 | P2 | P3
        plan = gc.plan(model, sbm, ranks, strategy="task", decouple=True, semantics="relaxed", chunks=2)
        assert len(plan.info["groups"]) == chain
        assert sum(plan.predictions["bytes_sent"]) == (chain - 1) * sbm.num_nodes * 3 * 8 * 2



@pytest.mark.parametrize("recompute", [False, True])
def test_a_hybrid_t_group_in_the_shared_regime_trains_the_decoupled_model(sbm: gc.Graph, recompute: bool) -> None:
    """Task-decoupled GCN-4 on 4 ranks (5 tasks) with one P rank: the single T task (the MLP) runs on a group of
    3 ranks dealing the chunks round robin, each keeping only its chunks' rows of the dropout masks
    (one byte per entry), with or without recomputation: the step equals one rank's."""
    _, one = _decoupled_step(sbm, 4, "tensor", 1)
    plan, four = _decoupled_step(sbm, 4, "task", 4, chunks=6, p_ranks=1, recompute=recompute)
    assert plan.info["regime"] == "shared" and plan.info["groups"] == {"T[0]": [0, 1, 2], "P[1,2,3,4]": [3]}
    torch.testing.assert_close(torch.tensor(four.history.loss[0]), torch.tensor(one.history.loss[0]),
                               rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(four.captured["logits"], one.captured["logits"], rtol=1e-9, atol=1e-11)
    for name, g in one.captured["grads"].items():
        torch.testing.assert_close(four.captured["grads"][name], g, rtol=1e-9, atol=1e-11)

# --------------------------------------------------------------------------- placement
def test_regimes_and_groups(sbm: gc.Graph) -> None:
    m = model_for("gcn", sbm)  # tasks: T0 P1 T2 P3 T4
    two = gc.plan(m, sbm, 2, strategy="task")
    assert two.info["regime"] == "shared" and two.info["groups"] == {"T[0,2,4]": [0], "P[1,3]": [1]}
    five = gc.plan(m, sbm, 5, strategy="task")
    assert five.info["regime"] == "one per rank" and len(five.info["groups"]) == 5
    eight = gc.plan(m, sbm, 8, strategy="task", chunks=8)
    assert eight.info["regime"] == "hybrid"
    sizes = sorted(len(v) for v in eight.info["groups"].values())
    assert sum(sizes) == 8 and sizes[0] >= 1 and len(sizes) == 5
    # a hybrid group deals the chunks to its ranks: each runs its share, once
    for dp in eight.ranks:
        for s in dp.stages:
            runs = s.runs or tuple(range(8))
            assert [i.chunk for i in dp.instructions if isinstance(i, Forward) and i.stage == s.index] == list(runs)
    # messages go between ranks of different tasks only
    for dp in two.ranks:
        assert all(i.peer != dp.rank for i in dp.instructions if isinstance(i, (Send, Recv)))


def test_eq7_split_and_override(sbm: gc.Graph) -> None:
    labels = {0: "rows", 1: "cols", 2: "rows", 3: "cols", 4: "rows"}
    times = {0: 1.0, 1: 6.0, 2: 1.0, 3: 6.0, 4: 0.5}
    place, regime, (n_t, n_p) = place_tasks(labels, times, 4)
    # Eq. 7 asks for 3 P ranks, but with fewer ranks than tasks no kind gets more ranks than tasks
    assert task_gpu_split(4, 2.5, 12.0) == (1, 3)
    assert regime == "shared" and (n_t, n_p) == (2, 2)
    assert [(g.name, g.members) for g in place.groups] == [("T[0]", (0,)), ("T[2,4]", (1,)), ("P[1]", (2,)),
                                                           ("P[3]", (3,))]
    _, _, (n_t, n_p) = place_tasks(labels, times, 4, p_ranks=1)
    assert (n_t, n_p) == (3, 1)
    # hybrid: 12 ranks spread by time (P tasks are 6x heavier)
    place, regime, (n_t, n_p) = place_tasks(labels, times, 12)
    # Eq. 7 asks for 10 P ranks; the 3 T tasks need a rank each, so P gets 9
    assert task_gpu_split(12, 2.5, 12.0) == (2, 10)
    assert regime == "hybrid" and (n_t, n_p) == (3, 9)
    assert [len(g.members) for g in place.groups] == [1, 5, 1, 4, 1]
    with pytest.raises(PlanningError, match="p_ranks must be in 1..3"):
        place_tasks(labels, times, 4, p_ranks=4)


def test_shared_regime_gives_a_kind_with_few_tasks_hybrid_groups() -> None:
    """Fewer ranks than tasks, but one heavy T task (a decoupled model's MLP): Eq. 7 asks for 3 T
    ranks, which beats giving the T task one rank (the P tasks' 3 runs would idle), so the T task
    gets a group of 3 ranks; with p_ranks the split is the user's, the groups the same rule's."""
    labels = {0: "rows", 1: "cols", 2: "cols", 3: "cols", 4: "cols"}
    times = {0: 10.0, 1: 0.1, 2: 0.1, 3: 0.1, 4: 0.1}
    place, regime, (n_t, n_p) = place_tasks(labels, times, 4)
    assert regime == "shared" and (n_t, n_p) == (3, 1)
    assert [(g.name, g.members, g.layout) for g in place.groups] == [("T[0]", (0, 1, 2), "chunks"),
                                                                     ("P[1,2,3,4]", (3,), "chunks")]
    place, _, (n_t, n_p) = place_tasks(labels, times, 4, p_ranks=2)
    assert (n_t, n_p) == (2, 2) and [g.members for g in place.groups] == [(0, 1), (2,), (3,)]
    # light T work: the P tasks keep their ranks (the old rule, on a tie too)
    place, _, (n_t, n_p) = place_tasks(labels, {0: 0.1, 1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0}, 4)
    assert (n_t, n_p) == (1, 3) and all(len(g.members) == 1 for g in place.groups)


def test_balanced_runs_and_spread() -> None:
    assert contiguous_runs([1, 1, 1, 3], 2) == [(0, 3), (3, 4)]
    assert contiguous_runs([5, 1, 1, 1], 3) == [(0, 1), (1, 2), (2, 4)]
    assert _spread([1.0, 3.0], 4) == [1, 3]
    assert sum(_spread([2.0, 2.0, 1.0], 7)) == 7


# --------------------------------------------------------------------------- communication
def test_bytes_follow_the_closed_form(sbm: gc.Graph) -> None:
    """Each task boundary moves every vertex's row once forward and once backward: GCN, 2 layers,
    hidden h, c classes: |V| (h + h + c + c) elements each way, whatever the rank count (no hybrid
    group, so no all-reduce)."""
    h, c = 5, sbm.num_classes
    expected = sbm.num_nodes * (2 * h + 2 * c) * 2 * 8
    for ranks in (2, 3, 5):
        plan = gc.plan(model_for("gcn", sbm), sbm, ranks, strategy="task", chunks=3)
        assert sum(plan.predictions["bytes_sent"]) == expected
    res = gc.plan(model_for("gcn", sbm), sbm, 3, strategy="task", chunks=3).run(epochs=1, timeout=60)
    assert [r.bytes_sent for r in res.ranks] == res.plan.predictions["bytes_sent"]
    assert [r.bytes_received for r in res.ranks] == res.plan.predictions["bytes_received"]


def test_pipeline_overlaps_tasks() -> None:
    """With chunks the tasks' ranks work at the same time: less idle time than one chunk (on a graph
    large enough that per-task launch overheads do not dominate)."""
    g = gc.datasets.synthetic("sbm", num_nodes=200_000, avg_degree=8, num_features=64, num_classes=8, seed=0)
    m = gc.nn.GCN(64, 64, 8, num_layers=2, dropout=0.0)
    one = gc.plan(m, g, "5xA100", strategy="task", chunks=1).prediction.simulation
    many = gc.plan(m, g, "5xA100", strategy="task", chunks=4).prediction.simulation
    assert many.step_time < one.step_time and many.bubble_fraction < one.bubble_fraction


# --------------------------------------------------------------------------- refusals and the planner
def test_refusals(sbm: gc.Graph) -> None:
    with pytest.raises(PlanningError, match="at least 2 ranks"):
        gc.plan(model_for("gcn", sbm), sbm, 1, strategy="task")
    with pytest.raises(PlanningError, match="leave ranks idle"):
        gc.plan(model_for("gcn", sbm), sbm, 8, strategy="task", chunks=1)


def test_planner_considers_task(sbm: gc.Graph) -> None:
    p = gc.plan(model_for("gcn", sbm), sbm, "4xA5000")
    assert "task" in {e.candidate.strategy for e in p.search.ranked}


def test_plan_from_statistics() -> None:
    stats = gc.datasets.stats("ogbn-products")
    m = gc.nn.GCN(stats.num_features, 128, stats.num_classes, num_layers=3)
    plan = gc.plan(m, stats, "8xA100", strategy="task")
    assert plan.info["regime"] == "hybrid" and plan.prediction.step_time > 0


# --------------------------------------------------------------------------- relaxed dependencies
def test_skip_later_with_one_chunk_is_exact(sbm: gc.Graph) -> None:
    """With one chunk there is no later chunk to skip: the relaxed plan is the exact one."""
    res = check_plan(model_for("gcn", sbm), sbm, 2, strategy="task", chunks=1, dependencies="skip-later",
                     semantics="relaxed", rtol=1e-9, atol=1e-11, timeout=60)
    assert not res.plan.relaxations


def test_skip_later_drops_edges_from_later_chunks(sbm: gc.Graph) -> None:
    plan = gc.plan(model_for("gat", sbm), sbm, 3, strategy="task", chunks=4, dependencies="skip-later",
                   semantics="relaxed")
    assert plan.relaxations and "Algorithm 1" in plan.relaxations[0] and plan.semantics == "relaxed"
    for dp in plan.ranks:  # a chunk reads its own and earlier chunks only
        for s in dp.stages:
            for _, per_chunk in s.reads:
                assert all(max(r) == j for j, r in enumerate(per_chunk))
    res = plan.run(epochs=2, timeout=60)  # runs (a different model: no single-device reference)
    assert all(math.isfinite(x) for x in res.history.loss)
    with pytest.raises(PlanningError, match="semantics='relaxed'"):
        gc.plan(model_for("gcn", sbm), sbm, 2, strategy="task", dependencies="skip-later")


@pytest.mark.parametrize("name", ["gcn", "gat", "gin"])
def test_regrouped_with_one_subgraph_is_exact(sbm: gc.Graph, name: str) -> None:
    """One subgraph of three shuffled chunks reads every edge: the step is single-device training's,
    dropout masks (vertex and attention) included, though its rows come in a shuffled order."""
    res = check_plan(model_for(name, sbm), sbm, 3, strategy="task", chunks=1, dependencies="regrouped",
                     subgraph_chunks=3, semantics="relaxed", rtol=1e-9, atol=1e-11, timeout=60)
    assert not res.plan.relaxations and res.plan.options["subgraph_chunks"] == 3
    assert res.plan.program[0].step.regroup is not None


@pytest.mark.parametrize("name, ranks", [("gcn", 3), ("sage", 4), ("gin", 5), ("gat", 2)])
def test_regrouped_step_trains_on_the_kept_edges(sbm: gc.Graph, name: str, ranks: int) -> None:
    """NeutronTask Algorithm 1: a regrouped step is single-device training on the graph of the edges
    whose source's subgraph is not after its destination's, normalized over them (GCN's and
    SAGE's degrees count the kept edges; GCN's dropout masks are the reference's). Training reads
    subgraphs 0..j, evaluation every edge."""
    # GAT without attention dropout: the reference's mask would be over the kept edges only
    make = {**MODELS, "gat": lambda f, c: gc.nn.GAT(f, 3, c, heads=2, num_layers=2, dropout=0.0)}[name]
    model = seeded_model(make, sbm)
    ref_model = seeded_model(make, sbm)
    plan = gc.plan(model, sbm, ranks, strategy="task", chunks=4, dependencies="regrouped", semantics="relaxed")
    assert "Algorithm 1" in plan.relaxations[0] and "8 chunks are shuffled into 4 subgraphs" in plan.relaxations[0]
    for dp, prog in zip(plan.ranks, plan.program):  # training: subgraph j reads 0..j; evaluation: exact
        for s in dp.stages:
            for _, per_chunk in s.reads:
                assert per_chunk == tuple(tuple(range(j + 1)) for j in range(4))
        for s in prog.eval_stages:
            for _, per_chunk in s.reads:
                assert any(max(r) > j for j, r in enumerate(per_chunk))
    rg = next(p.step.regroup for p in plan.program if p.step.regroup is not None).regrouping
    kept = rg.kept_edges(0)
    assert 0 < int(kept.sum()) < sbm.num_edges
    src, dst = sbm.indices[kept], sbm.dst[kept]
    reduced = gc.Graph.from_edge_index(torch.stack([src, dst]), sbm.num_nodes)
    reduced = reduced.replace(x=sbm.x, y=sbm.y, train_mask=sbm.train_mask, val_mask=sbm.val_mask,
                              test_mask=sbm.test_mask, num_classes=sbm.num_classes)
    ref = reference_step(ref_model, reduced)
    res = plan.run(epochs=1, seed=0, capture=True, timeout=60)
    torch.testing.assert_close(torch.tensor(res.history.loss[0], dtype=DT), torch.tensor(ref.loss, dtype=DT),
                               rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(res.captured["logits"], ref.logits, rtol=1e-9, atol=1e-11)
    for n, g in ref.grads.items():
        torch.testing.assert_close(res.captured["grads"][n], g, rtol=1e-9, atol=1e-11)


def test_regrouped_plan_round_trips(sbm: gc.Graph, tmp_path) -> None:
    p = gc.plan(model_for("gcn", sbm), sbm, 3, strategy="task", chunks=3, dependencies="regrouped",
                subgraph_chunks=3, semantics="relaxed")
    p.save(tmp_path / "plan.json")
    q = gc.load_plan(tmp_path / "plan.json", model_for("gcn", sbm), sbm)
    assert q.options["subgraph_chunks"] == 3 and q.relaxations == p.relaxations
    assert [r.step.regroup.regrouping.base_bounds for r in q.program if r.step.regroup is not None][0] == \
        tuple(round(90 * i / 9) for i in range(10))


def test_regrouped_options_are_checked(sbm: gc.Graph) -> None:
    with pytest.raises(PlanningError, match="semantics='relaxed'"):
        gc.plan(model_for("gcn", sbm), sbm, 2, strategy="task", dependencies="regrouped")
    with pytest.raises(PlanningError, match="subgraph_chunks applies to dependencies='regrouped'"):
        gc.plan(model_for("gcn", sbm), sbm, 2, strategy="task", dependencies="skip-later", subgraph_chunks=2,
                semantics="relaxed")
    with pytest.raises(PlanningError, match="base chunks, more than the graph's 90 vertices"):
        gc.plan(model_for("gcn", sbm), sbm, 2, strategy="task", chunks=30, dependencies="regrouped",
                subgraph_chunks=4, semantics="relaxed")


def test_recomputed_stage_with_several_dropouts(sbm: gc.Graph) -> None:
    """A decoupled 3-layer GCN's MLP task draws three masks inside recomputed segments; the replay
    in backward takes each from its own position."""
    def run(strategy: str, n: int, **kw):
        torch.manual_seed(0)
        model = gc.nn.GCN(6, 5, 3, num_layers=3, dropout=0.5).to(DT)
        p = gc.plan(model, sbm, n, strategy=strategy, decouple=True, semantics="relaxed", **kw)
        return p.run(epochs=1, seed=0, capture=True, update_model=False, timeout=60)

    one = run("tensor", 1)
    four = run("task", 4, chunks=4, recompute=True)
    torch.testing.assert_close(torch.tensor(four.history.loss[0]), torch.tensor(one.history.loss[0]),
                               rtol=1e-12, atol=1e-14)
    for name, g in one.captured["grads"].items():
        torch.testing.assert_close(four.captured["grads"][name], g, rtol=1e-9, atol=1e-11)


def test_edge_values_do_not_cross_tasks(sbm: gc.Graph) -> None:
    torch.manual_seed(0)
    gat = gc.nn.GAT(6, 3, 3, heads=2, num_layers=2, dropout=0.0).to(DT)
    with pytest.raises(PlanningError, match="edge values cannot cross tasks"):
        gc.plan(gat, sbm, 2, strategy="task", decouple=True, semantics="relaxed")


@pytest.mark.parametrize("name", ["gcn", "gat", "gin"])
def test_cached_dependencies_with_one_chunk_are_exact(sbm: gc.Graph, name: str) -> None:
    """NeutronTask's cached neighbours: with one chunk nothing is read from a previous step."""
    res = check_plan(model_for(name, sbm), sbm, 3, strategy="task", chunks=1, dependencies="cached",
                     semantics="relaxed", rtol=1e-9, atol=1e-11, timeout=60)
    assert not res.plan.relaxations


def test_cached_dependencies_read_later_chunks_stale(sbm: gc.Graph) -> None:
    plan = gc.plan(model_for("gcn", sbm), sbm, 2, strategy="task", chunks=4, dependencies="cached",
                   semantics="relaxed")
    assert "previous step" in plan.relaxations[0]
    p_stages = [s for dp in plan.ranks for s in dp.stages if s.stale]
    assert p_stages
    for s in p_stages:
        for name, stale in s.stale:
            fresh = dict(s.reads)[name]
            for j in range(4):  # earlier chunks fresh, later ones stale, together every chunk read
                assert all(k <= j for k in fresh[j]) and all(k > j for k in stale[j])
    # the pipeline no longer waits for later chunks: chunk 0's propagation starts before the T task
    # has produced chunk 3
    order = plan.info["task_order"]
    assert order.index("F1c0") < order.index("F0c3")
    res = plan.run(epochs=3, timeout=60)
    assert all(math.isfinite(x) for x in res.history.loss)
    with pytest.raises(PlanningError, match="semantics='relaxed'"):
        gc.plan(model_for("gcn", sbm), sbm, 2, strategy="task", dependencies="cached")


def test_free_keeps_a_stage_output_another_op_of_its_stage_saved(sbm: gc.Graph) -> None:
    """ResGCN: a residual sum is a stage output (sent to the next task) and LayerNorm's saved input in
    the same stage; FREE after its send must not release the storage the LayerNorm backward reads."""
    model = seeded_model(lambda f, c: gc.nn.ResGCN(f, 6, c, num_layers=3, norm="layer"), sbm)
    res = check_plan(model, sbm, 4, strategy="task", chunks=4, rtol=1e-9, atol=1e-11, timeout=120)
    assert any(type(i).__name__ == "Free" for dp in res.plan.ranks for i in dp.instructions)
