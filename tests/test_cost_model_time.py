"""Time models of the cost models: calibrated linear-layer products by output width, sparse-input
linear layers as propagations, old profiles without those measurements, and the label of a
prediction made from the uncalibrated CPU placeholder."""

from __future__ import annotations

import dataclasses
import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import gnncompile as gc
from gnncompile.cost_models.hardware import (DATASHEET_LABEL, DEVICES, LINKS, UNCALIBRATED_LABEL, Cluster,
                                             DeviceSpec)
from gnncompile.cost_models.model import op_time
from gnncompile.errors import PlanningError
from gnncompile.ir.plan import OpCost, RankSizes
from gnncompile.ir.symbolic import Lin

#: (width, forward, weight gradient, input gradient) FLOP/s: narrow products slower
CURVE = ((4.0, 1e9, 2e9, 4e9), (16.0, 4e9, 8e9, 16e9), (64.0, 8e9, 16e9, 32e9))


def _device(**kw) -> DeviceSpec:
    base = dict(name="test", flops={"float32": 100e9}, mem_bandwidth=1e15, memory=2**30, kind="cpu",
                launch_overhead=0.0)
    return DeviceSpec(**{**base, **kw})


def _linear(inputs: int, width: int, backward: int = 2, bias: bool = False) -> OpCost:
    """A linear layer on dense rows as the tracer annotates it: ``2 K w`` FLOPs per row, the weight
    (and bias) as size-independent bytes."""
    weight = 4 * inputs * width + (4 * width if bias else 0)
    return OpCost("lin", "T", flops=Lin.of(v=2 * inputs * width), bytes=Lin.of(v=4 * (inputs + width), c=weight),
                  width=width, backward=backward)


# --- DeviceSpec.gemm_rates -----------------------------------------------------------------------------

def test_gemm_rates_interpolate_in_log_width_and_clamp() -> None:
    d = _device(gemm_curve=CURVE)
    assert d.gemm_rates(16) == (4e9, 8e9, 16e9)
    assert d.gemm_rates(8) == pytest.approx((2.5e9, 5e9, 10e9))        # halfway between 4 and 16 in log
    assert d.gemm_rates(1) == (1e9, 2e9, 4e9)                           # clamped at the ends
    assert d.gemm_rates(1024) == (8e9, 16e9, 32e9)
    assert _device().gemm_rates(16) is None                            # presets: no curve
    assert DEVICES["A100"].gemm_rates(16) is None


def test_gemm_curve_is_sorted_checked_and_round_trips() -> None:
    d = _device(gemm_curve=tuple(reversed(CURVE)))
    assert d.gemm_curve == CURVE
    assert DeviceSpec.from_dict(json.loads(json.dumps(d.to_dict()))) == d
    with pytest.raises(PlanningError, match="gemm_curve"):
        _device(gemm_curve=((16, 1e9, 2e9),))
    with pytest.raises(PlanningError, match="gemm_curve forward"):
        _device(gemm_curve=((16, -1.0, 2e9, 3e9),))


def test_profiles_saved_before_the_curve_still_load(tmp_path: Path) -> None:
    """A profile written before ``gemm_curve`` existed (no such key in the device or the raw
    calibration) loads, scales per rank and predicts at the square-GEMM rate."""
    c = Cluster(1, 1, _device(), LINKS["shm"], cores=2,
                calibration={"rates": {"flops": {"float32": [50e9, 100e9]}, "mem_bandwidth": [1e15, 1e15],
                                       "spmm_bandwidth": [1e10, 2e10]}})
    data = c.to_dict()
    del data["device"]["gemm_curve"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = Cluster.load(path)
    dev = Cluster.parse("2xcpu", profile=old).rank_device(0)
    assert dev.gemm_curve == () and dev.flops_for("float32") == pytest.approx(50e9)
    op = _linear(512, 16)
    sizes = RankSizes(nodes=1000, edges=0)
    assert op_time(op, sizes, dev) == pytest.approx(2 * 512 * 16 * 1000 / 50e9)


def test_rank_device_scales_the_curve_like_the_other_rates() -> None:
    point = {"width": 16, "forward": [4e9, 6e9], "weight_grad": [8e9, 12e9], "input_grad": [16e9, 24e9]}
    rates = {"flops": {"float32": [10e9, 15e9]}, "mem_bandwidth": [1e10, 1e10], "spmm_bandwidth": [1e9, 1e9]}
    c = Cluster(1, 1, _device(), LINKS["shm"], cores=2, calibration={"rates": rates, "gemm_curve": [point]})
    one_thread = dataclasses.replace(c, devices_per_node=2).rank_device(0)
    assert one_thread.gemm_curve == ((16.0, 4e9, 8e9, 16e9),)
    all_cores = c.rank_device(0)
    assert all_cores.gemm_curve == ((16.0, 6e9, 12e9, 24e9),)
    four = dataclasses.replace(c, devices_per_node=4).rank_device(0)      # 4 ranks time-share 2 cores
    assert four.gemm_curve == ((16.0, 2e9, 4e9, 8e9),)


def test_rank_device_interpolates_the_runtime_costs_in_threads() -> None:
    """Fixed costs calibrated at one thread and at all cores: a rank pays those of its threads, and
    ranks time-sharing the cores pay them stretched; costs measured once stay as they are."""
    rates = {"flops": {"float32": [10e9, 15e9]}, "mem_bandwidth": [1e10, 1e10], "spmm_bandwidth": [1e9, 1e9]}
    dev = _device(runtime={"op_forward": 10e-6, "stage": 50e-6})
    c = Cluster(1, 1, dev, LINKS["shm"], cores=2,
                calibration={"rates": rates, "runtime": {"op_forward": [10e-6, 30e-6]}})
    assert c.rank_device(0).runtime["op_forward"] == pytest.approx(30e-6)          # one rank, 2 threads
    assert c.rank_device(0).runtime["stage"] == pytest.approx(50e-6)               # measured at one thread only
    two = dataclasses.replace(c, devices_per_node=2).rank_device(0)                 # 2 ranks x 1 thread
    assert two.runtime["op_forward"] == pytest.approx(10e-6)
    four = dataclasses.replace(c, devices_per_node=4).rank_device(0)                # 4 ranks share 2 cores
    assert four.runtime["op_forward"] == pytest.approx(20e-6)
    one_core = dataclasses.replace(c, cores=1, threads_per_rank=2).rank_device(0)   # 2 threads on 1 core
    assert one_core.runtime["op_forward"] == pytest.approx(20e-6)


#: the same products with a deep input (K = 4096): a quarter of CURVE's rates
DEEP = tuple((w, f / 4, g / 4, i / 4) for w, f, g, i in CURVE)


def test_gemm_rates_fall_with_the_input_width_between_the_two_curves() -> None:
    d = _device(gemm_curve=CURVE, gemm_inner=512, gemm_deep_curve=DEEP, gemm_deep_inner=4096)
    assert d.gemm_rates(16) == d.gemm_rates(16, 512) == d.gemm_rates(16, 64) == (4e9, 8e9, 16e9)
    assert d.gemm_rates(16, 4096) == pytest.approx((1e9, 2e9, 4e9))
    assert d.gemm_rates(16, 1 << 20) == pytest.approx((1e9, 2e9, 4e9))      # clamped at the deep curve
    # geometric in log K: one of three octaves from 512 to 4096 costs a third of the factor 4
    assert d.gemm_rates(16, 1024) == pytest.approx(tuple(r * 4 ** (-1 / 3) for r in (4e9, 8e9, 16e9)))
    assert DeviceSpec.from_dict(json.loads(json.dumps(d.to_dict()))) == d
    with pytest.raises(PlanningError, match="gemm_deep_curve needs"):
        _device(gemm_curve=CURVE, gemm_deep_curve=DEEP)
    with pytest.raises(PlanningError, match="gemm_deep_curve needs"):
        _device(gemm_curve=CURVE, gemm_inner=4096, gemm_deep_curve=DEEP, gemm_deep_inner=512)
    with pytest.raises(PlanningError, match="gemm_deep_curve forward"):
        _device(gemm_curve=CURVE, gemm_inner=512, gemm_deep_curve=((16, -1.0, 1.0, 1.0),), gemm_deep_inner=4096)


def test_rank_device_scales_the_deep_curve_and_a_deep_first_layer_costs_more() -> None:
    point = {"width": 16, "forward": [4e9, 6e9], "weight_grad": [8e9, 12e9], "input_grad": [16e9, 24e9]}
    deep = {"width": 16, "forward": [1e9, 1.5e9], "weight_grad": [2e9, 3e9], "input_grad": [4e9, 6e9]}
    rates = {"flops": {"float32": [10e9, 15e9]}, "mem_bandwidth": [1e15, 1e15], "spmm_bandwidth": [1e9, 1e9]}
    dev = _device(gemm_curve=((16.0, 6e9, 12e9, 24e9),), gemm_inner=512,
                  gemm_deep_curve=((16.0, 1.5e9, 3e9, 6e9),), gemm_deep_inner=4096)
    c = Cluster(1, 1, dev, LINKS["shm"], cores=2,
                calibration={"rates": rates, "gemm_curve": [point], "gemm_deep_curve": [deep]})
    one_thread = dataclasses.replace(c, devices_per_node=2).rank_device(0)
    assert one_thread.gemm_deep_curve == ((16.0, 1e9, 2e9, 4e9),)
    assert one_thread.gemm_inner == 512 and one_thread.gemm_deep_inner == 4096
    sizes = RankSizes(nodes=1000, edges=0)
    shallow, wide = _linear(512, 16, backward=1), _linear(4096, 16, backward=1)
    assert op_time(shallow, sizes, one_thread) == pytest.approx(2 * 512 * 16 * 1000 / 4e9)
    assert op_time(wide, sizes, one_thread) == pytest.approx(2 * 4096 * 16 * 1000 / 1e9)
    assert op_time(wide, sizes, one_thread, backward=True) == pytest.approx(2 * 4096 * 16 * 1000 / 2e9)


# --- op_time ---------------------------------------------------------------------------------------------

def test_linear_layer_runs_at_its_widths_rates() -> None:
    dev = _device(gemm_curve=CURVE)
    sizes = RankSizes(nodes=1000, edges=0)
    flops = 2 * 512 * 16 * 1000
    hidden = _linear(512, 16, backward=2)
    assert op_time(hidden, sizes, dev) == pytest.approx(flops / 4e9)
    # backward: the weights' gradient and the input's
    assert op_time(hidden, sizes, dev, backward=True) == pytest.approx(flops / 8e9 + flops / 16e9)
    first = _linear(512, 16, backward=1)        # raw features need no gradient: the weights' only
    assert op_time(first, sizes, dev, backward=True) == pytest.approx(flops / 8e9)
    assert op_time(_linear(512, 16, bias=True), sizes, dev) == pytest.approx(flops / 4e9)
    # without a curve: the square-GEMM rate
    assert op_time(hidden, sizes, _device()) == pytest.approx(flops / 100e9)
    # other dtypes and elementwise ops keep the roofline at the dtype's FLOP/s
    relu = OpCost("relu", "T", flops=Lin.of(v=16), bytes=Lin.of(v=128), width=16, backward=1)
    assert op_time(relu, sizes, dev) == pytest.approx(16 * 1000 / 100e9)
    bias = OpCost("add", "T", flops=Lin.of(v=16), bytes=Lin.of(v=128, c=64), width=16, backward=2)
    assert op_time(bias, sizes, dev) == pytest.approx(16 * 1000 / 100e9)


def test_linear_layer_on_sparse_rows_is_a_propagation() -> None:
    """``x @ W^T`` with sparse CSR rows (33 entries per row of 8415 columns): the forward gathers rows
    of the weight (a small working set), and the weight's gradient ``x^T @ g``, scattered from x's
    structure into rows of the weight's size, makes the same accesses: both cost the propagation at
    the small working set's rates, not the rank's rows'."""
    entries, inputs, width, rows = 33, 8415, 64, 30000
    op = OpCost("lin", "T", flops=Lin.of(v=2 * entries * width), bytes=Lin.of(v=4 * (2 * entries + width),
                                                                              c=4 * inputs * width),
                width=width, backward=1)
    small, large = 4 * inputs * width, 4 * rows * width
    dev = _device(spmm_bandwidth=1e10, spmm_curve=((small, 4e10, 1e12), (large, 1e10, 1e12)), gamma=0.0)
    sizes = RankSizes(nodes=rows, edges=0)
    nnz = entries * rows
    fwd = op_time(op, sizes, dev)
    back = op_time(op, sizes, dev, backward=True)
    # Eq. 6 bytes of the propagation, at the small working set's bandwidth, plus the per-entry term
    assert fwd == pytest.approx(4 * (nnz * (1 + 2 * width) + rows) / 4e10 + nnz / 1e12)
    assert back == pytest.approx(fwd)
    # a device without measured propagation rates (a preset) keeps the roofline
    preset = _device(spmm_bandwidth=1e10, gamma=0.0)
    assert op_time(op, sizes, preset) == pytest.approx(2 * entries * width * rows / 100e9)
    assert op_time(op, sizes, preset, backward=True) == pytest.approx(2 * entries * width * rows / 100e9)
    # a dense linear layer of the same weight is not taken for a sparse one
    assert op_time(_linear(inputs, width, backward=1), sizes, dev) == pytest.approx(2 * inputs * width * rows / 100e9)


def test_calibrated_profile_predicts_a_slower_narrow_layer(tmp_path: Path) -> None:
    """The same plan on a profile whose narrow products are slow predicts a longer step."""
    graph = gc.datasets.synthetic("sbm", num_nodes=400, avg_degree=4, num_features=256, num_classes=4, seed=0)
    torch.manual_seed(0)
    model = gc.nn.GCN(graph.num_features, 16, graph.num_classes, num_layers=2, dropout=0.0)
    rates = {"flops": {"float32": [100e9, 100e9]}, "mem_bandwidth": [1e10, 1e10], "spmm_bandwidth": [1e9, 1e9]}
    flat = Cluster(1, 1, _device(), LINKS["shm"], cores=1, calibration={"rates": rates})
    slow = {"width": 4, "forward": [1e9, 1e9], "weight_grad": [1e9, 1e9], "input_grad": [1e9, 1e9]}
    fast = {"width": 256, "forward": [100e9, 100e9], "weight_grad": [100e9, 100e9], "input_grad": [100e9, 100e9]}
    narrow = dataclasses.replace(flat, calibration={**flat.calibration, "gemm_curve": [slow, fast]})
    steps = [gc.plan(model, graph, Cluster.parse("1xcpu", profile=c), strategy="data",
                     verify=False).prediction.step_time for c in (flat, narrow)]
    assert steps[1] > steps[0]


def test_a_sparse_features_dropout_draws_one_number_per_stored_value() -> None:
    """GAT drops out its (sparse) input features: the mask is one draw per stored value, not one per
    element of the dense width (which predicted a 9 s step for a 0.2 s one on coauthor_physics)."""
    import scipy.sparse as sp

    g = gc.datasets.synthetic("sbm", num_nodes=200, avg_degree=4, num_features=8, num_classes=3, seed=0)
    g = g.replace(x=sp.random(g.num_nodes, 300, density=0.05, random_state=0, format="csr", dtype="float32"))
    torch.manual_seed(0)
    plan = gc.plan(gc.nn.GAT(300, 4, 3, heads=2, num_layers=2, dropout=0.5), g, 1, strategy="data", verify=False)
    first = next(op for st in plan.ranks[0].stages for op in st.costs if op.name.startswith("dropout_rows"))
    assert first.width == 300 and first.random.v == 0 and first.random.e == 0
    assert first.random.c == g.x.values().numel()


def test_a_propagation_with_trained_edge_values_costs_their_gradient() -> None:
    """GAT's propagation differentiates its attention values too (an SDDMM: backward == 2, and its
    ``values`` are the [E + V, heads] coefficients); GCN's fixed normalization is not trained. The
    pulled backward also permutes the values, which a push backward does not."""
    g = gc.datasets.synthetic("sbm", num_nodes=200, avg_degree=4, num_features=8, num_classes=3, seed=0)
    torch.manual_seed(0)
    gat = gc.plan(gc.nn.GAT(8, 4, 3, heads=2, num_layers=2, dropout=0.5), g, 1, strategy="data", verify=False)
    gcn = gc.plan(gc.nn.GCN(8, 4, 3, num_layers=2), g, 1, strategy="data", verify=False)

    def propagation(plan: gc.Plan) -> OpCost:
        return next(op for st in plan.ranks[0].stages for op in st.costs if op.kind == "P")
    att, fixed = propagation(gat), propagation(gcn)
    assert att.backward == 2 and att.values == Lin.of(v=8, e=8)  # 2 heads x float32 per edge and self loop
    assert fixed.backward == 1 and fixed.values == Lin()
    dev = Cluster.parse("1xcpu").rank_device(0)
    sizes = RankSizes(nodes=10_000, edges=200_000, src=10_000)
    pulled = op_time(att, sizes, dev, backward=True)
    unvalued = op_time(dataclasses.replace(att, values=Lin(), backward=1), sizes, dev, backward=True)
    assert pulled > 2 * unvalued - dev.runtime.get("op_backward", dev.launch_overhead)
    assert op_time(att, sizes, dev, backward=True, push=True) < pulled or dev.push_factor is None


# --- labels ----------------------------------------------------------------------------------------------

def test_uncalibrated_predictions_are_labelled() -> None:
    placeholder = Cluster.parse("2xcpu")
    assert not placeholder.calibrated
    assert placeholder.prediction_label == f" {UNCALIBRATED_LABEL}" and "uncalibrated" in str(placeholder)
    gpus = Cluster.parse("2xA100")  # datasheet rates: labelled as such
    assert not gpus.calibrated and gpus.prediction_label == f" {DATASHEET_LABEL}"
    measured = dataclasses.replace(placeholder, calibration={"quick": True})  # calibrated: a record
    assert measured.calibrated and measured.prediction_label == ""
    graph = gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=4, num_features=8, num_classes=3, seed=0)
    torch.manual_seed(0)
    model = gc.nn.GCN(graph.num_features, 8, graph.num_classes, num_layers=2, dropout=0.0)
    p = gc.plan(model, graph, placeholder, strategy="data", verify=False)
    chosen = next(line for line in p.explanation().splitlines() if line.startswith("Chosen plan"))
    assert UNCALIBRATED_LABEL in chosen
    on_gpus = gc.plan(model, graph, "2xA100", strategy="data", verify=False).explanation()
    assert UNCALIBRATED_LABEL not in on_gpus
    assert DATASHEET_LABEL in next(line for line in on_gpus.splitlines() if line.startswith("Chosen plan"))
    assert "datasheet peak rates" in on_gpus


def test_fraction_forms_are_detected_exactly() -> None:
    """The tracer's forms hold :class:`Fraction` coefficients; detection works on them."""
    op = OpCost("lin", "T", flops=Lin(Fraction(2 * 7 * 16), Fraction(0), Fraction(0)),
                bytes=Lin(Fraction(92), Fraction(0), Fraction(448)), width=7, backward=2)
    dev = _device(gemm_curve=CURVE)
    assert op_time(op, RankSizes(nodes=100, edges=0), dev) == pytest.approx(2 * 16 * 7 * 100 / dev.gemm_rates(7)[0])


# --- compute after a wait for peers ----------------------------------------------------------------------

def test_compute_after_a_wait_for_peers_pays_the_switch() -> None:
    """``runtime["switch"]`` is charged to each compute instruction (and the optimizer step) that follows a
    communication with peers, FREEs between them aside; a one-rank plan's exchanges have no peers."""
    from gnncompile.cost_models.model import PlanCost, _RankWalk
    from gnncompile.ir.plan import AllReduce, Backward, Forward, Free, HaloExchange, OptimizerStep
    from gnncompile.ir.rules import rule

    g = gc.datasets.synthetic("sbm", num_nodes=80, avg_degree=4, num_features=8, num_classes=3, seed=0)
    torch.manual_seed(0)
    model = gc.nn.GCN(8, 8, 3, num_layers=2, dropout=0.0)
    base = Cluster.parse("2xcpu")
    device = dataclasses.replace(base.device, runtime={"stage": 1e-5, "switch": 7e-3})
    for ranks in (1, 2):
        cluster = dataclasses.replace(Cluster.parse(f"{ranks}xcpu"), device=device)
        plan = gc.plan(model, g, cluster, strategy="data")
        walk = _RankWalk(PlanCost(plan, cluster), plan.ranks[0])
        insts = plan.ranks[0].instructions
        if ranks == 1:
            assert not walk.after_wait
            continue
        expected = set()
        waited = False
        for i, inst in enumerate(insts):
            if isinstance(inst, Free):
                continue
            if waited and isinstance(inst, (Forward, Backward, OptimizerStep)):
                expected.add(i)
            waited = isinstance(inst, (HaloExchange, AllReduce))
        assert walk.after_wait == expected and expected
        assert any(isinstance(insts[i], OptimizerStep) for i in expected)  # after the gradients' all-reduce
        for i in range(len(insts)):
            if rule(insts[i]).kind in ("compute", "optimizer"):
                cost = rule(insts[i]).cost_rule().cost
                no_switch = dataclasses.replace(device, runtime={"stage": 1e-5})
                plain = _RankWalk(PlanCost(plan, dataclasses.replace(cluster, device=no_switch)), plan.ranks[0])
                extra = cost(walk, i, insts[i])[0] - cost(plain, i, insts[i])[0]
                assert extra == pytest.approx(7e-3 if i in expected else 0.0, abs=1e-9)


def test_checkpointed_segments_cost_the_runtime_segment_each_way() -> None:
    from gnncompile.cost_models.model import checkpointed_segments, stage_ops_time

    g = gc.datasets.synthetic("sbm", num_nodes=80, avg_degree=4, num_features=8, num_classes=3, seed=0)
    torch.manual_seed(0)
    model = gc.nn.GCN(8, 8, 3, num_layers=3, dropout=0.5)
    plan = gc.plan(model, g, 1, strategy="data", recompute=True)
    dp = plan.ranks[0]
    counts = [checkpointed_segments(st) for st in dp.stages]
    assert sum(counts) >= 1 and 0 in counts  # the ops before the first propagation are not checkpointed
    device = Cluster.parse("1xcpu").device
    with_segment = dataclasses.replace(device, runtime={"stage": 1e-5, "segment": 3e-3})
    without = dataclasses.replace(device, runtime={"stage": 1e-5})
    for st, n in zip(dp.stages, counts):
        for back in (False, True):
            extra = stage_ops_time(st, dp.sizes, with_segment, back) - stage_ops_time(st, dp.sizes, without, back)
            assert extra == pytest.approx(3e-3 * n)


def test_optimizer_step_costs_the_parameters_a_rank_holds() -> None:
    """Adam steps a rank's own parameters: mop's sparse ranks hold none and a task rank some, but
    every rank's OPT was charged the whole model's (169 us on each of four cora ranks)."""
    g = gc.datasets.synthetic("sbm", num_nodes=200, avg_degree=5, num_features=32, num_classes=4, seed=0)
    for strategy in ("mop", "task", "data"):
        plan = gc.plan(gc.nn.GCN(32, 16, 4), g, gpus=4, strategy=strategy)
        held = [s.parameters for s in plan.prediction.static]
        opt = [sum(b.end - b.start for b in bars if b.instruction == "OPT") for bars in plan.prediction.simulation.bars()]
        most = max(held)
        for r, (h, t) in enumerate(zip(held, opt)):
            if h == most:
                assert t == pytest.approx(max(opt)), (strategy, r, held, opt)
            else:   # fewer parameters: less of Adam's traffic
                assert t < max(opt), (strategy, r, held, opt)
        assert (strategy == "data") == (len(set(held)) == 1)
