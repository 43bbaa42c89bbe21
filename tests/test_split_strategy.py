"""Sampled mini-batch plans: ``split`` (GSPLIT) is exact with respect to the sample; mini-batch
``data`` equals single-device training on its ranks' micro-batches (dropout included: replicated
masks are the mini-batch's); bytes, errors, search."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile.errors import PlanningError
from gnncompile.graph.minibatch import SampledSteps
from gnncompile.graph.presample import split_stats
from gnncompile.ir.plan import HaloExchange
from gnncompile.ir.plan import Plan as PlanData
from gnncompile.testing import check_plan
from graph_strategies import DT, sbm_graph, seeded_model

# with dropout: the plans replicate the mini-batch's masks (GAT's attention dropout: its edges')
MODELS = {
    "sage": lambda f, c: gc.nn.GraphSAGE(f, 5, c, num_layers=2, dropout=0.5),
    "gcn": lambda f, c: gc.nn.GCN(f, 4, c, num_layers=2, dropout=0.5),
    "gat": lambda f, c: gc.nn.GAT(f, 3, c, heads=2, num_layers=2, dropout=0.5),
    "gcnii": lambda f, c: gc.nn.GCNII(f, 6, c, num_layers=3, dropout=0.5),
    "gin": lambda f, c: gc.nn.GIN(f, 5, c, num_layers=2, dropout=0.5),
}
FANOUTS = {"gcnii": [3, 2, 2]}


@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    return sbm_graph(80)


def _one_step_batch(g: gc.Graph) -> int:
    """A batch size covering every training vertex: one step per epoch."""
    return int(g.train_mask.sum())


@pytest.mark.parametrize("name", sorted(MODELS))
def test_split_step_equals_single_device_on_the_same_sample(sbm: gc.Graph, name: str) -> None:
    fanouts = FANOUTS.get(name, [3, 2])
    res = check_plan(seeded_model(MODELS[name], sbm), sbm, 3, strategy="split", batch_size=_one_step_batch(sbm),
                     fanouts=fanouts, rtol=1e-9, atol=1e-11, timeout=120, device="cpu")
    assert res.plan.strategy == "split" and res.plan.semantics == "exact"


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=st.integers(12, 60), ranks=st.integers(2, 4), fanout=st.integers(1, 4),
       partitioner=st.sampled_from(["presampled", "metis", "random"]), seed=st.integers(0, 3))
def test_split_is_exact_for_any_partition_and_sample(nodes: int, ranks: int, fanout: int, partitioner: str,
                                                     seed: int) -> None:
    g = sbm_graph(nodes)
    check_plan(seeded_model(MODELS["sage"], g), g, ranks, strategy="split", batch_size=_one_step_batch(g),
               fanouts=[fanout, -1], split_partitioner=partitioner, seed=seed, rtol=1e-9, atol=1e-11,
               timeout=120, device="cpu")


def test_minibatch_data_step_equals_single_device_on_the_ranks_micro_batches(sbm: gc.Graph) -> None:
    # GAT: feature and attention dropout; each rank keeps its micro-batch's masks of the step's
    res = check_plan(seeded_model(MODELS["gat"], sbm), sbm, 3, strategy="data", batch_size=_one_step_batch(sbm),
                     fanouts=[3, 2], rtol=1e-9, atol=1e-11, timeout=120, device="cpu")
    assert res.plan.options["dropout"] == "replicated" and len(res.plan.program[1].dropout_draws) == 3 * 4
    # no exchange: the only traffic is the gradient all-reduce
    assert not any(isinstance(i, HaloExchange) for dp in res.plan.ranks for i in dp.instructions)


def test_split_trains_like_the_minibatch_reference_over_several_steps_and_epochs() -> None:
    g = gc.datasets.synthetic("sbm", num_nodes=300, avg_degree=8, num_features=12, num_classes=3, seed=4)
    torch.manual_seed(0)
    model = gc.nn.GraphSAGE(g.num_features, 8, g.num_classes, num_layers=2, dropout=0.5).to(DT)
    g = g.replace(x=g.x.to(DT))
    # the run's seed draws the mini-batches, as gc.train's does (not the plan's seed, which was used)
    ref = gc.train(copy.deepcopy(model), g, epochs=2, lr=0.01, batch_size=40, fanouts=[4, 3], verbose=False, seed=3)
    plan = gc.plan(copy.deepcopy(model), g, gpus=2, strategy="split", batch_size=40, fanouts=[4, 3])
    assert plan.info["steps_per_epoch"] == -(-int(g.train_mask.sum()) // 40) > 1
    res = plan.run(epochs=2, lr=0.01, timeout=120, seed=3)
    torch.testing.assert_close(torch.tensor(res.history.loss), torch.tensor(ref.loss), rtol=1e-9, atol=1e-12)
    assert res.history.val_acc == ref.val_acc and res.history.test_acc == ref.test_acc


class _ChainedDropouts(torch.nn.Module):
    """A dropout of a dropout's output (a block ending in dropout feeding one starting with
    nn.Dropout), the first written as torch.dropout."""

    def __init__(self, fin: int, fout: int) -> None:
        super().__init__()
        self.l1, self.l2, self.drop = torch.nn.Linear(fin, 6), torch.nn.Linear(6, fout), torch.nn.Dropout(0.3)

    def forward(self, g, x):
        h = torch.relu(gc.ops.propagate(g, self.l1(x), "gcn", add_self_loops=True))
        h = self.drop(torch.dropout(h, 0.5, self.training))
        return gc.ops.propagate(g, self.l2(h), "gcn", add_self_loops=True)


@pytest.mark.parametrize("strategy", ["split", "data"])
def test_chained_dropouts_read_their_value_s_depth(sbm: gc.Graph, strategy: str) -> None:
    """The second dropout read the first one's replacement, whose depth was unknown: it took the
    input layer's row positions and every rank failed."""
    res = check_plan(seeded_model(_ChainedDropouts, sbm), sbm, 2, strategy=strategy, batch_size=_one_step_batch(sbm),
                     fanouts=[3, 2], rtol=1e-9, atol=1e-11, timeout=120, device="cpu")
    assert [n for n in res.plan.info["inputs"] if n.startswith("dropout_index")] == ["dropout_index_v1"]


def test_split_replicates_the_masks_of_sparse_input_features() -> None:
    """GCNII drops out its (CSR) input features: a rank's mask entries are the stored values of its
    input rows, at their positions among the mini-batch's values."""
    g = sbm_graph(60)
    gen = torch.Generator().manual_seed(0)
    x = (torch.rand(g.num_nodes, 30, generator=gen) < 0.1).to(DT)
    x[:, 0] = 1.0
    g = g.replace(x=x.to_sparse_csr())
    res = check_plan(seeded_model(lambda f, c: gc.nn.GCNII(f, 6, c, num_layers=2, dropout=0.5), g), g, 3,
                     strategy="split", batch_size=_one_step_batch(g), fanouts=[3, 2], rtol=1e-9, atol=1e-11,
                     timeout=120, device="cpu")
    assert "dropout_index_nnz0" in res.plan.info["inputs"] and res.plan.options["features"] == "csr"


def test_sampled_replicated_masks_need_the_counter_based_generator(sbm: gc.Graph,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """GNNCOMPILE_DROPOUT_MASKS=torch draws whole masks, which a rank of a sampled plan cannot: refused
    when planning, and by the ranks of a plan made without it (not silently other masks)."""
    model = seeded_model(MODELS["sage"], sbm)
    plan = gc.plan(copy.deepcopy(model), sbm, gpus=2, strategy="split", batch_size=16, fanouts=[2, 2])
    monkeypatch.setenv("GNNCOMPILE_DROPOUT_MASKS", "torch")
    with pytest.raises(PlanningError, match="GNNCOMPILE_DROPOUT_MASKS=torch draws whole masks: unset it, or pass "
                                            "dropout='local'"):
        gc.plan(copy.deepcopy(model), sbm, gpus=2, strategy="split", batch_size=16, fanouts=[2, 2])
    assert gc.plan(copy.deepcopy(model), sbm, gpus=2, strategy="split", batch_size=16, fanouts=[2, 2],
                   dropout="local").options["dropout"] == "local"
    with pytest.raises(gc.RuntimeFailure, match="GNNCOMPILE_DROPOUT_MASKS=torch draws whole masks"):
        plan.run(epochs=1, timeout=120)


def test_split_bytes_of_a_step_are_the_shuffle_of_its_sample(sbm: gc.Graph) -> None:
    """One step: every rank sends, per layer, the rows of the sample's shuffle index (features forward;
    gradients backward for every layer above the input), plus its share of the gradient all-reduce."""
    model = seeded_model(MODELS["sage"], sbm)
    b = _one_step_batch(sbm)
    plan = gc.plan(copy.deepcopy(model), sbm, gpus=3, strategy="split", batch_size=b, fanouts=[3, 2])
    res = plan.run(epochs=1, timeout=120)
    src = plan.program[0].step.sampled
    shuffles = split_stats(src.sample(0, 0), src.parts, 3).send
    ar = [i for i in plan.ranks[0].instructions if type(i).__name__ == "AllReduce"][0]
    ar_bytes = 2 * 2 * ar.numel * 8 / 3  # ring all-reduce of float64 gradients over 3 ranks
    exchanges = [i for i in plan.ranks[0].instructions if isinstance(i, HaloExchange)]
    # one forward exchange per layer (SAGE projects 6 -> 5 features before aggregating, so layer 1's
    # exchanged value needs a gradient too); a backward one for each that needs a gradient
    assert sorted((i.halo, i.grad) for i in exchanges) == [("g_0", False), ("g_0", True), ("g_1", False),
                                                            ("g_1", True)]
    ring = (0, 1, 2)  # the all-reduce's neighbours: r -> r + 1
    for r in range(3):
        for q in range(3):
            if q == r:
                continue
            # forward: the rows r owns that q needs; backward: the gradients of the rows r received from q
            want = sum(int(shuffles[int(i.halo[2:])][(q, r) if i.grad else (r, q)]) * i.width * 8 for i in exchanges)
            got = res.ranks[r].sent_to.get(q, 0)
            if q == ring[(r + 1) % 3]:
                got -= ar_bytes
            assert abs(got - want) <= 8, (r, q, got, want)


def test_sampled_plans_refuse_what_they_cannot_do(sbm: gc.Graph) -> None:
    model = seeded_model(MODELS["sage"], sbm)
    with pytest.raises(PlanningError, match="split: needs batch_size and fanouts"):
        gc.plan(model, sbm, gpus=2, strategy="split")
    with pytest.raises(PlanningError, match="fanouts has 3 entries but GraphSAGE has 2 GNN layers"):
        gc.plan(model, sbm, gpus=2, strategy="split", batch_size=16, fanouts=[2, 2, 2])
    with pytest.raises(PlanningError, match="needs both batch_size and fanouts"):
        gc.plan(model, sbm, gpus=2, strategy="data", batch_size=16)
    # no strategy named: the message was split's ("split: needs ...")
    with pytest.raises(PlanningError, match="^fanouts without batch_size: sampled mini-batch training needs both"):
        gc.plan(model, sbm, gpus=2, fanouts=[2, 2])
    with pytest.raises(PlanningError, match="fanouts"):
        gc.plan(model, sbm, gpus=2, strategy="split", batch_size=16, fanouts=[0, 2])
    with pytest.raises(PlanningError):
        gc.plan(model, sbm, gpus=2, strategy="tensor", batch_size=16, fanouts=[2, 2])
    for strategy in ("split", "data", None):
        assert gc.plan(model, sbm, gpus=2, strategy=strategy, batch_size=16,
                       fanouts=[2, 2]).options["dropout"] == "replicated"
    assert gc.plan(model, sbm, gpus=2, strategy="split", batch_size=16, fanouts=[2, 2],
                   dropout="local").options["dropout"] == "local"

    class Weighted(torch.nn.Module):  # gcn-normalized attention-like weights: needs whole-block out-degrees
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(sbm.num_features, sbm.num_classes).to(DT)

        def forward(self, g, x):
            h = self.lin(x)
            w = torch.sigmoid((gc.ops.gather_src(g, h) * gc.ops.gather_dst(g, h)).sum(-1))
            return gc.ops.propagate(g, h, "gcn", edge_weight=w)

    with pytest.raises(PlanningError, match="norm='gcn'"):
        gc.plan(Weighted(), sbm, gpus=2, strategy="split", batch_size=16, fanouts=[2])
    gc.plan(Weighted(), sbm, gpus=2, strategy="data", batch_size=16, fanouts=[2])  # whole blocks: fine


def test_the_planner_chooses_between_minibatch_data_and_split(sbm: gc.Graph) -> None:
    model = seeded_model(MODELS["sage"], sbm)
    plan = gc.plan(model, sbm, gpus=2, batch_size=16, fanouts=[3, 2])
    assert plan.strategy in ("data", "split") and plan.options["batch_size"] == 16
    assert {e.candidate.strategy for e in plan.search.ranked + plan.search.rejected} == {"data", "split"}
    full = gc.plan(model, sbm, gpus=2)
    assert full.options.get("batch_size") is None


def test_split_steps_are_a_partition_of_the_sample(sbm: gc.Graph) -> None:
    """Every seed is scored by exactly one rank; every sampled input vertex is loaded by exactly one."""
    targets = torch.nonzero(sbm.train_mask).flatten()
    parts = torch.arange(sbm.num_nodes) % 3
    sources = [SampledSteps(sbm, targets, 20, (3, 2), 1, (("mean", False),), r, 3, parts) for r in range(3)]
    batch = sources[0].sample(0, 1)
    steps = [s.step(0, 1) for s in sources]
    seeds = torch.cat([s.seeds for s in steps])
    assert sorted(seeds.tolist()) == sorted(batch.seed_ids.tolist())
    assert sum(s.x.shape[0] for s in steps) == batch.input_ids.numel()
    assert all(s.batch_size == batch.seed_ids.numel() for s in steps)


def test_sampled_plans_are_costed_layer_by_layer_and_split_computes_less_than_data() -> None:
    """The plans' sizes are per layer (vertex sets shrink toward the seeds); with overlapping
    micro-batches, mini-batch data computes more rows and edges in all than split (GSPLIT Table 1),
    and the cost model sees it."""
    g = gc.datasets.synthetic("sbm", num_nodes=2000, avg_degree=12, num_features=32, num_classes=4, seed=0)
    model = gc.nn.GraphSAGE(g.num_features, 16, g.num_classes, num_layers=2, dropout=0.0)
    plans = {s: gc.plan(copy.deepcopy(model), g, gpus=4, strategy=s, batch_size=512, fanouts=[10, 5])
             for s in ("split", "data")}
    for p in plans.values():
        for dp in p.ranks:
            layers = dp.sizes.layers
            assert len(layers) == 3  # two GNN layers, then the trailing T ops
            assert [t[1] for t in layers[:2]] == [layers[1][0], layers[2][0]]  # a layer's outputs feed the next
            assert layers[0][0] >= layers[1][0] >= layers[2][0]  # V_0 ⊇ V_1 ⊇ V_2
            assert dp.sizes.at_layer(1, True).nodes == layers[0][1]
            assert dp.sizes.at_layer(1, False).nodes == layers[0][0]
    rows = {s: sum(sum(t[1] for t in dp.sizes.layers[:2]) for dp in p.ranks) for s, p in plans.items()}
    inputs = {s: sum(dp.sizes.feature_rows for dp in p.ranks) for s, p in plans.items()}
    assert rows["data"] > 1.2 * rows["split"] and inputs["data"] > 1.5 * inputs["split"]
    compute = {s: sum(r.compute for r in p.prediction.simulation.ranks) for s, p in plans.items()}
    assert compute["data"] > compute["split"]
    # the per-layer sizes survive the plan's JSON
    again = PlanData.from_dict(json.loads(plans["split"].to_json()))
    assert again.ranks[0].sizes == plans["split"].ranks[0].sizes


def test_sampled_plans_from_statistics_estimate_the_layers_a_sample_measures() -> None:
    """From GraphStats alone the per-layer sizes are formulas.sampled_sizes's expectations: on a
    graph of near-uniform degrees they are within a third of the presampled means."""
    g = gc.datasets.synthetic("sbm", num_nodes=2000, avg_degree=12, num_features=32, num_classes=4, seed=0)
    g = g.replace(train_mask=torch.ones(g.num_nodes, dtype=torch.bool))  # statistics hold no training mask
    model = gc.nn.GraphSAGE(g.num_features, 16, g.num_classes, num_layers=2, dropout=0.0)
    for strategy in ("split", "data"):
        measured = gc.plan(copy.deepcopy(model), g, gpus=4, strategy=strategy, batch_size=512, fanouts=[10, 5])
        planned = gc.plan(copy.deepcopy(model), g.stats(), gpus=4, strategy=strategy, batch_size=512,
                          fanouts=[10, 5])
        assert planned.info["estimated"] and planned.program is None
        assert planned.info["steps_per_epoch"] == measured.info["steps_per_epoch"] == 4
        for est, got in zip(planned.ranks[0].sizes.layers, measured.ranks[0].sizes.layers):
            for a, b in zip(est[:2] + est[3:], got[:2] + got[3:]):  # rows, destinations, edges
                assert abs(a - b) <= max(0.34 * b, 2), (strategy, est, got)
    stats = gc.GraphStats(num_nodes=111_059_956, num_edges=1_615_685_872, num_features=128, num_classes=172)
    plan = gc.plan(gc.nn.GraphSAGE(128, 256, 172, num_layers=3), stats, gpus=8, strategy="split",
                   batch_size=1024, fanouts=[15, 10, 5])
    assert plan.info["partition"]["estimated"] and plan.info["shuffle_rows"][0] > 0


def test_sampled_plans_pay_for_loading_their_input_rows() -> None:
    """A sampled step's first Forward includes moving the step's input feature rows onto the device
    (over the host link), so mini-batch data pays for its micro-batches' overlap."""
    from gnncompile.cost_models.model import load_seconds

    stats = gc.GraphStats(num_nodes=2_000_000, num_edges=30_000_000, num_features=128, num_classes=10)
    model = gc.nn.GraphSAGE(128, 64, 10, num_layers=2)
    cluster = gc.Cluster.parse("4xA100")
    loads = {}
    for s in ("split", "data"):
        plan = gc.plan(copy.deepcopy(model), stats, gpus=cluster, strategy=s, batch_size=4096, fanouts=[10, 5])
        dp = plan.ranks[0]
        dev = cluster.rank_device(0)
        loads[s] = load_seconds(plan, dp, dev)
        assert loads[s] == pytest.approx(dp.sizes.feature_rows * 128 * 4 / dev.host_bandwidth)
    assert loads["data"] > loads["split"] > 0
    assert load_seconds(gc.plan(copy.deepcopy(model), stats, gpus=cluster, strategy="data"), dp, dev) == 0.0


def test_fanouts_as_a_string_as_gc_train_takes_them() -> None:
    """``gc.plan(fanouts="3,2")`` is ``fanouts=(3, 2)``, as ``gc.train`` and the CLI take them; an
    empty entry or a fraction is refused, in ``gc.plan`` and in ``gc.train`` alike (``"3,,2"`` was
    silently ``3,2`` in ``gc.train``; ``gc.plan`` refused strings)."""
    g = gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=5, num_features=6, num_classes=3, seed=0)
    sage = gc.nn.GraphSAGE(6, 8, 3)
    plan = gc.plan(sage, g, 2, strategy="split", batch_size=np.int64(32), fanouts="3, 2")
    assert plan.options["fanouts"] == (3, 2)
    assert type(plan.options["batch_size"]) is int  # a NumPy int, as gc.train takes one (it was refused)
    for bad, why in (("3,,2", "fanouts '3,,2': an empty entry"), ("3.5,2", r"fanouts\[0\]: expected an int, got '3.5'"),
                     ("0,2", r"fanouts\[0\] = 0: each fanout is"), ([2, 2.5], r"fanouts\[1\]: expected an int, got 2.5"),
                     ([float("inf"), 2], r"fanouts\[0\]: expected an int, got inf"),
                     (b"\x03\x02", r"fanouts must be a sequence of ints .* got b'\\x03\\x02'"),
                     ({3, 2}, r"fanouts must be a sequence of ints .* got \{2, 3\}"),
                     # (an int past int64 overflowed in the sampler: OverflowError)
                     ([2**63, 2], r"fanouts\[0\] = 9223372036854775808: each fanout is a number of in-edges in "
                                  r"\[1, 2\^63\)")):
        with pytest.raises(PlanningError, match=why):
            gc.plan(sage, g, 2, strategy="split", batch_size=32, fanouts=bad)
    with pytest.raises(gc.ArgumentError, match="an empty entry"):
        gc.train(sage, g, epochs=1, batch_size=32, fanouts="3,,2")
