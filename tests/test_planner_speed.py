"""The planner's shortcuts: a pipeline's step outline is the step it lowers to, its bound never
exceeds the simulated step, and pruning by it never changes the plan the search returns."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import gnncompile as gc
from gnncompile.cost_models.hardware import Cluster
from gnncompile.ir.plan import AllReduce, Backward, DevicePlan, Forward, Free, OptimizerStep, Send
from gnncompile.passes import schedule as schedule_mod
from gnncompile.passes import search as search_mod
from gnncompile.passes.schedule import RankOutline
from gnncompile.passes.search import evaluate, search

STATS = gc.GraphStats(num_nodes=50_000, num_edges=800_000, num_features=64, num_classes=8)


@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    return gc.datasets.synthetic("sbm", num_nodes=400, avg_degree=6, num_features=12, num_classes=3, seed=1)


def gcn(features: int, classes: int, layers: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    return gc.nn.GCN(features, 16, classes, num_layers=layers)


def outlined(monkeypatch, model, graph, cluster, overlap, **options):
    """Evaluate a mop candidate, recording the outlines its lowering hands the search's check, with
    their bounds."""
    seen = []
    real = search_mod.checking_outlines

    def recording(check):
        def both(outline):
            seen.append((outline, search_mod.step_bound(outline, cluster, overlap)))
            check(outline)
        return real(both)

    monkeypatch.setattr(search_mod, "checking_outlines", recording)
    ev = evaluate(model, graph, cluster, "mop", overlap=overlap, **options)
    return ev, seen


@pytest.mark.parametrize("spec", ["2x2xA100-ib200", "4x2xA100-ib200"])
@pytest.mark.parametrize("chunks", [1, 2, 4])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("on", ["stats", "graph"])
def test_outline_is_the_step_and_bounds_its_simulation(monkeypatch, sbm, spec, chunks, overlap, on):
    graph = STATS if on == "stats" else sbm
    model = gcn(graph.num_features, graph.num_classes)
    cluster = Cluster.parse(spec)
    ev, seen = outlined(monkeypatch, model, graph, cluster, overlap, chunks=chunks,
                        reorder="rcm" if chunks > 1 else "none")
    assert ev.plan is not None and len(seen) == 1
    outline, (bound, rank) = seen[0]
    for dp in ev.plan.ranks:
        # the outline's messages are the step's Sends, its tasks the rank's compute, in order
        sends = Counter((i.peer, i.shape, i.dtype) for i in dp.instructions if isinstance(i, Send))
        assert Counter(outline.sends[dp.rank]) == sends
        assert list(outline.tasks[dp.rank]) == [i for i in dp.instructions if isinstance(i, (Forward, Backward))]
        assert outline.sizes[dp.rank] == dp.sizes
    step = ev.prediction.step_time
    assert 0 < bound <= step * (1 + 1e-9)
    # the bound is the rank's own busy time in the simulation, or less
    sim = ev.prediction.simulation.ranks[rank]
    busy = [e.duration for e in sim.events if e.kind in ("F", "B", "SEND")]
    assert bound <= sum(busy) * (1 + 1e-9) + 1e-12


@pytest.mark.parametrize("strategies", [("tensor", "mop"), ("data", "tensor", "task")])
@pytest.mark.parametrize("spec", ["2x2xA100-ib200", "4x2xA100-ib200", "4x4xA100-ib200"])
def test_pruning_never_changes_the_winner(monkeypatch, spec, strategies):
    """The search with pruning returns the plan (and prediction) that evaluating every candidate
    in full ranks first; a pruned candidate's full simulation is slower than the winner (pruned
    from a step outline, from one rank of ranks alike, or from the plan's instruction lists)."""
    monkeypatch.setattr(search_mod, "PRUNE_FROM", 0)  # prune small candidates too
    model = gcn(STATS.num_features, STATS.num_classes, layers=3)
    cluster = Cluster.parse(spec)
    result = search(model, STATS, cluster, strategies=list(strategies))
    pruned = [e for e in result.rejected if e.rejected.startswith("pruned")]
    full = []
    for cand in search_mod.candidates(cluster, strategies=list(strategies)):
        ev = evaluate(model, STATS, cluster, cand.strategy, num_ranks=cand.num_ranks,
                      **{k: v for k, v in cand.options.items() if k != "semantics"})
        if ev.ok:
            full.append(ev)
    full.sort(key=lambda e: (e.step_time, e.candidate.num_ranks, e.max_bytes))
    best = result.best
    assert best.candidate == full[0].candidate
    assert best.step_time == full[0].step_time
    assert best.peak_memory == full[0].peak_memory
    for e in pruned:
        same = next(f for f in full if f.candidate == e.candidate)
        assert same.step_time > best.step_time
    if spec == "4x4xA100-ib200" and "mop" in strategies:
        assert pruned, "the 16-rank mop pipelines are slower than tensor's and are pruned"
    if spec == "4x4xA100-ib200" and "data" in strategies:
        assert pruned, "data's recomputing variant is slower than data's and is pruned"


def test_a_pruned_candidate_says_by_how_much(monkeypatch):
    monkeypatch.setattr(search_mod, "PRUNE_FROM", 0)
    model = gcn(STATS.num_features, STATS.num_classes, layers=3)
    result = search(model, STATS, Cluster.parse("4x4xA100-ib200"), strategies=["tensor", "mop"])
    pruned = [e for e in result.rejected if e.rejected.startswith("pruned")]
    assert pruned and all("at least" in e.rejected and "found before" in e.rejected for e in pruned)
    assert "pruned" in result.report()


def test_small_candidates_are_simulated_even_when_they_cannot_win():
    """Below PRUNE_FROM instructions every candidate is simulated (explain compares them)."""
    model = gcn(STATS.num_features, STATS.num_classes, layers=3)
    result = search(model, STATS, Cluster.parse("2x2xA100-ib200"), strategies=["tensor", "mop"])
    assert not [e for e in result.rejected if e.rejected.startswith("pruned")]
    assert {e.candidate.strategy for e in result.ranked} == {"tensor", "mop"}


TENSOR = {"recompute": False, "decouple": False}
CASES = [("data", {"partitioner": "metis", "recompute": False}), ("tensor", {"chunks": 1, **TENSOR}),
         ("tensor", {"chunks": 4, **TENSOR}), ("mop", {"chunks": 2, "reorder": "rcm"}),
         ("task", {"recompute": False, "decouple": False}),
         ("layer", {"stages": 2, "chunks": 4, "recompute": False, "history": False})]


@pytest.mark.parametrize("spec", ["2x2xA100-ib200", "4x2xA100-ib200"])
@pytest.mark.parametrize("strategy,options", CASES)
@pytest.mark.parametrize("overlap", [False, True])
def test_plan_bound_never_exceeds_the_simulated_step(sbm, spec, strategy, options, overlap):
    model = gcn(sbm.num_features, sbm.num_classes)
    cluster = Cluster.parse(spec)
    ev = evaluate(model, sbm, cluster, strategy, overlap=overlap, **options)
    assert ev.prediction is not None, ev.rejected
    bound, rank = search_mod.plan_bound(ev.plan, cluster, overlap)
    assert 0 < bound <= ev.prediction.step_time * (1 + 1e-9)
    assert 0 <= rank < ev.plan.num_ranks


@pytest.mark.parametrize("spec", ["2x2xA100-ib200", "4x2xA100-ib200"])
@pytest.mark.parametrize("strategy,options", CASES)
def test_plan_bound_decides_against_a_beat_as_its_full_replay(sbm, spec, strategy, options):
    """plan_bound with a ``beat`` skips a rank's dependency replay where its queues' totals already
    decide: it exceeds the beat exactly when the full bound does, and never exceeds the step."""
    model = gcn(sbm.num_features, sbm.num_classes)
    cluster = Cluster.parse(spec)
    ev = evaluate(model, sbm, cluster, strategy, **options)
    full, _ = search_mod.plan_bound(ev.plan, cluster)
    step = ev.prediction.step_time
    for beat in (0.0, full * 0.5, full * 0.999, full, full * 1.001, step, step * 2):
        bound, rank = search_mod.plan_bound(ev.plan, cluster, beat=beat)
        assert (bound > beat) == (full > beat)
        assert bound <= full * (1 + 1e-12) and 0 <= rank < ev.plan.num_ranks


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("on", ["stats", "graph"])
def test_rank_outline_bounds_the_simulated_step(monkeypatch, sbm, chunks, overlap, on):
    """tensor hands the planner its first rank's step before making the others' (RankOutline): the
    bound of that rank alone is the rank's own instructions and never exceeds the simulated step."""
    graph = STATS if on == "stats" else sbm
    model = gcn(graph.num_features, graph.num_classes)
    cluster = Cluster.parse("4x2xA100-ib200")
    seen = []
    real = search_mod.checking_outlines

    def recording(check):
        def both(outline):
            seen.append(outline)
            check(outline)
        return real(both)

    monkeypatch.setattr(search_mod, "checking_outlines", recording)
    ev = evaluate(model, graph, cluster, "tensor", overlap=overlap, chunks=chunks, **TENSOR)
    assert len(seen) == 1 and isinstance(seen[0], RankOutline)
    outline = seen[0]
    dp = ev.plan.ranks[outline.rank]
    # the driver appends the gradient reduction and the optimizer step; tensor has no FREE before them
    body = [i for i in dp.instructions if not isinstance(i, (AllReduce, OptimizerStep, Free))]
    assert list(outline.instructions) == [i for i in body]
    assert outline.sizes == dp.sizes and outline.stages == dp.stages
    partial = DevicePlan(outline.rank, outline.stages, outline.instructions, outline.sizes)
    bound = search_mod.rank_bound(partial, search_mod._Bounds(cluster), outline.inputs, overlap)
    assert 0 < bound <= ev.prediction.step_time * (1 + 1e-9)


@pytest.mark.parametrize("strategy,options", [("mop", {"chunks": 2, "reorder": "rcm"}),
                                              ("task", {"recompute": False, "decouple": False}),
                                              ("layer", {"stages": 2, "chunks": 4, "recompute": False,
                                                         "history": False})])
def test_messages_are_counted_before_the_step_is_scheduled(monkeypatch, sbm, strategy, options):
    """The point-to-point lowerings count their messages before scheduling (count_messages): the
    count is the step's Sends, and a step over MAX_MESSAGES is refused before any task is scheduled."""
    import importlib

    mod = importlib.import_module(f"gnncompile.passes.{strategy}")
    counted = []
    real = mod.count_messages
    monkeypatch.setattr(mod, "count_messages", lambda *a, **k: counted.append(real(*a, **k)) or counted[-1])
    model = gcn(sbm.num_features, sbm.num_classes)
    cluster = Cluster.parse("2x2xA100-ib200")
    ev = evaluate(model, sbm, cluster, strategy, **options)
    assert ev.plan is not None, ev.rejected
    train, evaluation = counted
    assert train == sum(isinstance(i, Send) for dp in ev.plan.ranks for i in dp.instructions) > 0
    assert evaluation == sum(isinstance(i, Send) for p in ev.plan.program for i in p.eval_instructions)

    def never(*a, **k):
        raise AssertionError("scheduled a step that was too large")

    monkeypatch.setattr(schedule_mod, "MAX_MESSAGES", train - 1)
    monkeypatch.setattr(mod, "list_schedule", never)
    ev = evaluate(model, sbm, cluster, strategy, **options)
    assert ev.plan is None and "point-to-point messages" in ev.rejected


@pytest.mark.parametrize("chunks", [1, 4])
def test_plan_bytes_counts_what_the_instruction_rules_count(chunks):
    """plan_bytes' shortcut for all-to-alls (shape tuples shared by ranks) is the rules' volume."""
    from gnncompile.ir.rules import rule
    from gnncompile.ir.verify_plan import plan_bytes

    model = gcn(STATS.num_features, STATS.num_classes)
    plan = evaluate(model, STATS, Cluster.parse("4x2xA100-ib200"), "tensor", chunks=chunks, **TENSOR).plan
    sent, recv = plan_bytes(plan)
    for dp in plan.ranks:
        vols = [rule(i).volume(i, dp.rank) for i in dp.instructions]
        assert sent[dp.rank] == sum(v[0] for v in vols)
        assert recv[dp.rank] == sum(v[1] for v in vols)


def _reference_list_schedule(deps, resource, cost, delay, priority):
    """The list scheduler as it was first written (a linear scan of the ready tasks per step)."""
    res = resource
    tasks = list(deps)
    remaining = {t: len(set(deps[t])) for t in tasks}
    users = {t: [] for t in tasks}
    for t in tasks:
        for d in set(deps[t]):
            users[d].append(t)
    end, free, out = {}, {}, []
    ready = [(0.0, priority(t), t) for t in tasks if not remaining[t]]
    while ready:
        i = min(range(len(ready)), key=lambda i: (max(ready[i][0], free.get(res(ready[i][2]), 0.0)), ready[i][1]))
        at, _, t = ready.pop(i)
        start = max(at, free.get(res(t), 0.0))
        end[t] = start + cost.get(t, 1.0)
        free[res(t)] = end[t]
        out.append((start, t))
        for u in users[t]:
            remaining[u] -= 1
            if not remaining[u]:
                ready.append((max(end[d] + delay(d, u) for d in deps[u]), priority(u), u))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_list_schedule_is_the_linear_scan_one(seed):
    """The heap-based list scheduler starts the same tasks at the same times as a linear scan."""
    import random

    from gnncompile.passes.schedule import gpipe, list_schedule, one_f_one_b

    rnd = random.Random(seed)
    stages, chunks, groups = rnd.randint(1, 5), rnd.randint(1, 9), rnd.randint(1, 3)
    tasks = [kind(s, k) for s in range(stages) for k in range(chunks) for kind in (Forward, Backward)]
    deps = {t: set() for t in tasks}
    for s in range(stages):
        for k in range(chunks):
            deps[Backward(s, k)].add(Forward(s, k))
            for s2 in range(s + 1, stages):  # later stages read random chunks of earlier ones
                for j in range(chunks):
                    if rnd.random() < 0.3:
                        deps[Forward(s2, j)].add(Forward(s, k))
                        deps[Backward(s, k)].add(Backward(s2, j))
    cost = {t: rnd.choice([0.5, 1.0, 1.0, 2.0, 3.0]) for t in tasks}

    def delay(d, t):
        return 0.5 if (d.stage + t.stage) % 3 == 0 else 0.0

    def resource(t):
        return t.stage % groups

    for priority in (gpipe, one_f_one_b):
        got = list_schedule(deps, resource, cost, delay, priority)
        assert got == _reference_list_schedule(deps, resource, cost, delay, priority)


def test_search_collects_only_new_objects_and_restores_the_collector(monkeypatch, sbm):
    """During a search the objects that existed before are frozen (full collections skip them);
    afterwards nothing is frozen, also when a candidate raised; a caller's own freeze is left alone."""
    import gc as pygc

    frozen_during = []
    real = search_mod._evaluate

    def watching(*args, **kwargs):
        frozen_during.append(pygc.get_freeze_count())
        return real(*args, **kwargs)

    monkeypatch.setattr(search_mod, "_evaluate", watching)
    model = gcn(sbm.num_features, sbm.num_classes)
    assert pygc.get_freeze_count() == 0
    search(model, sbm, Cluster.local(2))
    assert frozen_during and min(frozen_during) > 0 and pygc.get_freeze_count() == 0

    def failing(*args, **kwargs):
        raise RuntimeError("candidate failed")

    monkeypatch.setattr(search_mod, "_evaluate", failing)
    with pytest.raises(RuntimeError, match="candidate failed"):
        search(model, sbm, Cluster.local(2))
    assert pygc.get_freeze_count() == 0

    # the caller's freeze is kept as it is: neither frozen further nor released (the count itself
    # may drop meanwhile: a frozen object whose last reference goes is freed as usual)
    calls = []
    monkeypatch.setattr(pygc, "freeze", lambda real=pygc.freeze: (calls.append("freeze"), real())[1])
    monkeypatch.setattr(pygc, "unfreeze", lambda real=pygc.unfreeze: (calls.append("unfreeze"), real())[1])
    pygc.freeze()
    try:
        with search_mod.collecting_only_new_objects():
            assert pygc.get_freeze_count() > 0
        assert calls == ["freeze"] and pygc.get_freeze_count() > 0
    finally:
        pygc.unfreeze()


def test_planning_uses_a_thread_per_million_edges_and_restores_the_count(monkeypatch, sbm):
    """Planning's index work runs on one torch thread per EDGES_PER_THREAD edges (at least one, at
    most the caller's count), also when a candidate raises; the caller's count is restored after."""
    threads_during = []
    real = search_mod._evaluate

    def watching(*args, **kwargs):
        threads_during.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(search_mod, "_evaluate", watching)
    model = gcn(sbm.num_features, sbm.num_classes)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        search(model, sbm, Cluster.local(2))
        assert set(threads_during) == {1} and torch.get_num_threads() == 2
        monkeypatch.setattr(search_mod, "EDGES_PER_THREAD", max(1, sbm.num_edges // 5))  # 5 threads' worth
        threads_during.clear()
        search(model, sbm, Cluster.local(2))
        assert set(threads_during) == {2} and torch.get_num_threads() == 2  # never more than the caller's

        def failing(*args, **kwargs):
            raise RuntimeError("candidate failed")

        monkeypatch.setattr(search_mod, "EDGES_PER_THREAD", 1 << 40)
        monkeypatch.setattr(search_mod, "_evaluate", failing)
        with pytest.raises(RuntimeError, match="candidate failed"):
            search(model, sbm, Cluster.local(2))
        assert torch.get_num_threads() == 2
        stats = sbm.stats()  # no index work on a graph: the caller's count
        with search_mod.planning_threads(stats):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_stage_modules_generate_their_code_when_first_needed(sbm):
    """The search lowers every candidate into stage modules it only costs: their Python code is
    generated when a module is first called or shown, and then runs like an eager GraphModule's."""
    import torch.fx

    from gnncompile.ir.tpgraph import graph_module

    model = gcn(sbm.num_features, sbm.num_classes)
    tp = gc.trace(model, sbm)
    pytest.importorskip("torch.fx._lazy_graph_module", reason="this torch has no deferred fx code generation")
    lazy = graph_module(tp, tp.graph, "Check")
    assert "_code" not in lazy.__dict__
    eager = torch.fx.GraphModule(tp, tp.graph, "Check")
    outs = []
    for gm in (lazy, eager):
        torch.manual_seed(1)  # the same dropout masks
        outs.append(gm(sbm, sbm.x))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert lazy.code == eager.code


@pytest.mark.parametrize("backward", ["push", "transposed"])
def test_the_bound_holds_where_a_profile_measured_pushing_faster(backward):
    """A calibrated ``push_factor`` below 1 (a busy host's calibration measured one) makes pushed
    backward products cheaper than pulled ones: the pruning bound, which costed pulled products
    only, then exceeded a pushed candidate's simulated step and could prune the winner."""
    import dataclasses

    from gnncompile.cost_models.model import predict

    base = Cluster.parse("2x2xA100-ib200")
    cluster = dataclasses.replace(base, device=dataclasses.replace(base.device, push_factor=0.3))
    ev = evaluate(gcn(STATS.num_features, STATS.num_classes), STATS, cluster, "data", backward=backward,
                  partitioner="random", recompute=False)
    bound, _ = search_mod.plan_bound(ev.plan, cluster)
    assert 0 < bound <= predict(ev.plan, cluster).step_time * (1 + 1e-9)
