"""Worked numbers for the closed forms of :mod:`gnncompile.cost_models.formulas`."""

from __future__ import annotations

import math

import pytest

from gnncompile.cost_models import formulas as f
from gnncompile.errors import PlanningError

approx = pytest.approx


# --------------------------------------------------------------------------- NeutronTask Eq. 5-8
# A 2-layer GCN, |V| = 1000, |E| = 10000 (d̄ = 10), embedding widths d^(1..3) = (16, 8, 4).
V, E, DIMS, DBAR = 1000, 10_000, (16, 8, 4), 10.0


def test_eq5_t_task_time():
    # vertex T tasks: 2*1000*16*8 + 2*1000*8*4 = 256000 + 64000 = 320000 FLOP; at 1e9 FLOP/s: 3.2e-4 s
    assert f.t_task_time(V, E, DIMS, None, 1e9) == approx(3.2e-4)
    # edge T task with d_e = d_v^(L) = d^(2) = 8: + 2*10000*8*8 = 1280000 -> 1600000 FLOP = 1.6e-3 s
    assert f.t_task_time(V, E, DIMS, DIMS[-2], 1e9) == approx(1.6e-3)
    assert f.t_task_time(V, E, DIMS, 0, 1e9) == approx(3.2e-4)


def test_eq6_p_task_time():
    # P widths d^(1..L) = (16, 8); FLOPS 1e9, Bandwidth 1e8 B/s, float32 (4 B per element)
    # l=1, d=16: compute 2*1000*10*16 = 320000 FLOP -> 3.2e-4 s;
    #            memory 1000*10*(1+32) + 1000 = 331000 el = 1324000 B -> 1.324e-2 s
    # l=2, d=8:  compute 160000 FLOP -> 1.6e-4 s; memory 1000*10*17 + 1000 = 171000 el = 684000 B -> 6.84e-3 s
    # gamma = 0.5: (1.6e-4 + 6.62e-3) + (0.8e-4 + 3.42e-3) = 6.78e-3 + 3.5e-3 = 1.028e-2 s
    assert f.p_task_time(V, DBAR, DIMS[:-1], 1e9, 1e8, 0.5) == approx(1.028e-2)
    assert f.p_task_time(V, DBAR, DIMS[:-1], 1e9, 1e8, 1.0) == approx(4.8e-4)      # 3.2e-4 + 1.6e-4
    assert f.p_task_time(V, DBAR, DIMS[:-1], 1e9, 1e8, 0.0) == approx(2.008e-2)    # 1.324e-2 + 6.84e-3
    # elsize=1 counts elements: the memory term is the paper's raw element count over Bandwidth
    assert f.p_task_time(V, DBAR, [16], 1e9, 1e8, 0.0, elsize=1) == approx(331000 / 1e8)
    assert f.p_task_time(V, DBAR, [], 1e9, 1e8, 0.5) == 0.0
    # layers add up
    assert f.p_task_time(V, DBAR, [16, 8], 1e9, 1e8, 0.3) == approx(
        f.p_task_time(V, DBAR, [16], 1e9, 1e8, 0.3) + f.p_task_time(V, DBAR, [8], 1e9, 1e8, 0.3))


def test_eq7_8_worked_split():
    t_t = f.t_task_time(V, E, DIMS, None, 1e9)                  # 3.2e-4
    t_p = f.p_task_time(V, DBAR, DIMS[:-1], 1e9, 1e8, 0.5)      # 1.028e-2
    # N_p = 4 * 1.028e-2 / (1.028e-2 + 3.2e-4) = 4 * 0.96981 = 3.879 -> 4, clamped to 3
    assert f.task_gpu_split_exact(4, t_t, t_p) == approx(4 * 1.028e-2 / 1.06e-2)
    assert f.task_gpu_split(4, t_t, t_p) == (1, 3)
    # gamma = 1: T_p = 4.8e-4; N_p = 4 * 4.8 / 8 = 2.4 -> 2
    t_p1 = f.p_task_time(V, DBAR, DIMS[:-1], 1e9, 1e8, 1.0)
    assert f.task_gpu_split_exact(4, t_t, t_p1) == approx(2.4)
    assert f.task_gpu_split(4, t_t, t_p1) == (2, 2)
    # with the edge T task: T_t = 1.6e-3; N_p = 4 * 0.48 / 2.08 = 0.923 -> 1
    t_te = f.t_task_time(V, E, DIMS, 8, 1e9)
    assert f.task_gpu_split(4, t_te, t_p1) == (3, 1)


@pytest.mark.parametrize("gpus, t_t, t_p, expected", [
    (4, 1.0, 3.0, (1, 3)),      # exact 3
    (3, 1.0, 1.0, (1, 2)),      # 1.5: halves round up (towards P)
    (5, 1.0, 1.0, (2, 3)),      # 2.5 -> 3
    (10, 1.0, 3.0, (2, 8)),     # 7.5 -> 8
    (10, 3.0, 1.0, (7, 3)),     # 2.5 -> 3
    (8, 2.0, 1.0, (5, 3)),      # 2.667 -> 3
    (4, 1.0, 0.0, (3, 1)),      # exact 0, clamped to 1
    (4, 0.0, 1.0, (1, 3)),      # exact 4, clamped to 3
    (8, 1.0, 1e9, (1, 7)),      # extreme ratios keep one GPU per kind
    (8, 1e9, 1.0, (7, 1)),
    (2, 0.0, 0.0, (1, 1)),      # no information: even split
    (2, 5.0, 7.0, (1, 1)),
    (1, 1.0, 3.0, (1, 1)),      # one GPU runs both kinds
])
def test_task_gpu_split_rounding(gpus, t_t, t_p, expected):
    assert f.task_gpu_split(gpus, t_t, t_p) == expected
    if gpus >= 2:
        assert sum(expected) == gpus


def test_task_gpu_split_exact_sums():
    assert f.task_gpu_split_exact(8, 1.0, 3.0) == approx(6.0)
    assert f.task_gpu_split_exact(6, 0.0, 0.0) == 3.0
    assert f.task_gpu_split_exact(1, 2.0, 2.0) == approx(0.5)


# --------------------------------------------------------------------------- closed forms
def test_intermediate_data_dp():
    assert f.intermediate_data_dp(1000, 2, 16) == 2 * 1000 * 2 * 16 * 4 == 256_000
    assert f.intermediate_data_dp(1000, 2, 16, elsize=2) == 128_000


def test_comm_data():
    # alpha = 1.5: 500 halo rows. L = 2, d = 16, default grad_layers = 1:
    # forward 500*(16+16) = 16000 el, backward 500*16 = 8000 el -> 24000 el = 96000 B
    assert f.comm_data(1000, 1.5, 2, 16) == approx(96_000)
    assert f.comm_data(1000, 1.5, 2, 16, grad_layers=0) == approx(64_000)     # the paper's forward volume
    assert f.comm_data(1000, 1.5, 2, 16, grad_layers=2) == approx(128_000)
    # per-layer widths (16, 8): forward 500*24 = 12000, backward (last layer) 500*8 = 4000 -> 64000 B
    assert f.comm_data(1000, 1.5, 2, (16, 8)) == approx(64_000)
    assert f.comm_data(1000, 1.0, 3, 16) == 0.0                                  # one partition
    assert f.comm_data(1000, 1.5, 2, 16, elsize=8) == approx(192_000)


def test_comm_task_forms():
    # (2L - 1)|V||d| = 5 * 1000 * 16 = 80000 el forward = 320000 B; gradients back: twice
    assert f.comm_task(1000, 3, 16, backward=False) == 320_000
    assert f.comm_task(1000, 3, 16) == 640_000
    # (M - 1)|V||d| = 3 * 16000 = 48000 el = 192000 B forward, independent of L
    assert f.comm_task_decoupled(1000, 4, 16, backward=False) == 192_000
    assert f.comm_task_decoupled(1000, 4, 16) == 384_000
    assert f.comm_task_decoupled(1000, 1, 16) == 0


def test_comm_layer_hybrid():
    # 2*0.5*4*1000*16 = 64000 el + 2*(2-1)*1000*16 = 32000 el -> 96000 el = 384000 B
    assert f.comm_layer_hybrid(0.5, 4, 1000, 16, 2) == approx(384_000)
    assert f.comm_layer_hybrid(0.5, 4, 1000, 16, 2, backward=False) == approx(192_000)
    # special cases: graph parallelism (S = 1) and pure layer pipeline (alpha_h = 0)
    assert f.comm_layer_hybrid(0.5, 4, 1000, 16, 1) == approx(2 * 0.5 * 4 * 1000 * 16 * 4)
    assert f.comm_layer_hybrid(0.0, 4, 1000, 16, 4) == approx(2 * 3 * 1000 * 16 * 4)


def test_comm_tensor():
    # paper's forward load 2VDL = 2*1000*16*3 = 96000 el = 384000 B; with gradients 768000 B
    assert f.comm_tensor(1000, 16, 3, backward=False) == approx(384_000)
    assert f.comm_tensor(1000, 16, 3) == approx(768_000)
    # exact N x 2(N-1)(V/N)(D/N)L with N = 4: 0.75 * 96000 = 72000 el = 288000 B
    assert f.comm_tensor(1000, 16, 3, num_workers=4, backward=False) == approx(288_000)
    # decoupled: 4 collectives in all, 4 * 0.75 * 1000 * 16 = 48000 el = 192000 B, for any L
    assert f.comm_tensor(1000, 16, 3, num_workers=4, decoupled=True) == approx(192_000)
    assert f.comm_tensor(1000, 16, 30, num_workers=4, decoupled=True) == approx(192_000)
    assert f.comm_tensor(1000, 16, 3, num_workers=4, decoupled=True, backward=False) == approx(96_000)
    assert f.comm_tensor(1000, 16, 3, num_workers=1) == 0.0


def test_comm_mop():
    # dims (16, 8, 4), L = 2: forward Z0 (16) + Z1 (8) + H1 (8) = 32; backward H1, Z1 = 16; 48 el per node
    # m = 4: 0.75 * 1000 * 48 = 36000 el = 144000 B
    assert f.comm_mop(1000, (16, 8, 4), num_workers=4) == approx(144_000)
    assert f.comm_mop(1000, (16, 8, 4), num_workers=4, backward=False) == approx(96_000)
    assert f.comm_mop(1000, (16, 4)) == approx(1000 * 16 * 4)                       # one layer: one all-to-all
    # O(N), independent of the worker count (bounded by the m -> infinity value), unlike data parallelism
    bound = f.comm_mop(1000, (16, 8, 4))
    vols = [f.comm_mop(1000, (16, 8, 4), num_workers=m) for m in (2, 4, 8, 64, 1024)]
    assert all(v <= bound for v in vols) and vols[-1] == approx(bound, rel=1e-3)


# --------------------------------------------------------------------------- collectives
def test_collective_times():
    assert f.p2p_time(1000, 100.0, 0.5) == approx(10.5)
    assert f.p2p_time(0, 100.0, 0.5) == 0.0
    for fn in (f.ring_allreduce_time, f.ring_allgather_time, f.ring_reduce_scatter_time):
        assert fn(1e6, 1, 1e9, 1e-5) == 0.0
    # n = 2: 2 (lat + b / 2 / bw) = 2 (0.5 + 1000 / 200) = 11
    assert f.ring_allreduce_time(1000, 2, 100.0, 0.5) == approx(11.0)
    # n = 4: 3 (0.1 + 4000 / 4 / 1000) = 3.3
    assert f.ring_allgather_time(4000, 4, 1000.0, 0.1) == approx(3.3)
    assert f.ring_reduce_scatter_time(4000, 4, 1000.0, 0.1) == approx(3.3)
    assert f.ring_allreduce_time(4000, 4, 1000.0, 0.1) == approx(
        f.ring_allgather_time(4000, 4, 1000.0, 0.1) + f.ring_reduce_scatter_time(4000, 4, 1000.0, 0.1))


def test_all_to_all_and_halo():
    # peers 1 (send), 2 (recv), 3 (both) -> 3 latencies; max(150, 250) / 100 = 2.5
    assert f.all_to_all_time([0, 100, 0, 50], [0, 0, 200, 50], 100.0, 1.0) == approx(5.5)
    assert f.all_to_all_time([0, 0], [0, 0], 100.0, 1.0) == 0.0
    assert f.all_to_all_time([0], [0], 100.0, 1.0) == 0.0
    # halo: rows * width * 4 bytes per peer
    t = f.halo_exchange_time([0, 10, 5], [0, 3, 0], 8, 100.0, 1.0)
    assert t == approx(f.all_to_all_time([0, 320, 160], [0, 96, 0], 100.0, 1.0)) == approx(2 + 480 / 100)
    assert f.halo_exchange_time([0, 10, 5], [0, 3, 0], 8, 100.0, 1.0, grad=True) == approx(t)


def test_ring_bytes_match_runtime_convention():
    assert f.ring_allreduce_bytes(976, 4) == 2 * 3 * 976 // 4 == 1464
    assert f.ring_allreduce_bytes(1001, 3) == 4004 // 3 == 1334      # floor, as the runtime
    assert f.ring_allreduce_bytes(1000, 1) == 0
    assert f.ring_allgather_bytes(1001, 3) == 2002 // 3
    assert f.ring_reduce_scatter_bytes(1001, 3) == 2002 // 3


# --------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("call", [
    lambda: f.t_task_time(-1, E, DIMS, None, 1e9),
    lambda: f.t_task_time(V, E, (16,), None, 1e9),
    lambda: f.t_task_time(V, E, DIMS, None, 0.0),
    lambda: f.t_task_time(V, E, DIMS, -3, 1e9),
    lambda: f.p_task_time(V, DBAR, [16], 1e9, 1e8, 1.5),
    lambda: f.p_task_time(V, DBAR, [16], 1e9, 1e8, -0.1),
    lambda: f.p_task_time(V, -1.0, [16], 1e9, 1e8, 0.5),
    lambda: f.p_task_time(V, DBAR, [16], 1e9, 0.0, 0.5),
    lambda: f.p_task_time(V, DBAR, [-16], 1e9, 1e8, 0.5),
    lambda: f.p_task_time(V, math.nan, [16], 1e9, 1e8, 0.5),
    lambda: f.task_gpu_split(0, 1.0, 1.0),
    lambda: f.task_gpu_split(2.0, 1.0, 1.0),
    lambda: f.task_gpu_split_exact(4, -1.0, 1.0),
    lambda: f.intermediate_data_dp(1000, -1, 16),
    lambda: f.intermediate_data_dp(1000, 2, 16, elsize=0),
    lambda: f.comm_data(1000, 0.5, 2, 16),
    lambda: f.comm_data(1000, 1.5, 2, 16, grad_layers=3),
    lambda: f.comm_data(1000, 1.5, 2, (16, 8, 4)),
    lambda: f.comm_task(1000, 0, 16),
    lambda: f.comm_task_decoupled(1000, 0, 16),
    lambda: f.comm_layer_hybrid(-0.5, 4, 1000, 16, 2),
    lambda: f.comm_layer_hybrid(0.5, 4, 1000, 16, 0),
    lambda: f.comm_tensor(1000, 16, 3, num_workers=0),
    lambda: f.comm_mop(1000, (16,)),
    lambda: f.ring_allreduce_time(100, 0, 1.0, 0.0),
    lambda: f.ring_allgather_time(100, 2, 0.0, 0.0),
    lambda: f.p2p_time(-1, 1.0, 0.0),
    lambda: f.all_to_all_time([1, 2], [1], 1.0, 0.0),
    lambda: f.all_to_all_time([1, -2], [1, 2], 1.0, 0.0),
    lambda: f.ring_allreduce_bytes(100, 0),
])
def test_bad_inputs_raise_planning_error(call):
    with pytest.raises(PlanningError):
        call()


# --------------------------------------------------------------------------- cross-check with a data plan
@pytest.fixture(scope="module")
def sbm():
    from gnncompile import datasets
    return datasets.synthetic("sbm", num_nodes=600, avg_degree=6, num_features=16, num_classes=4, seed=0)


@pytest.mark.parametrize("make, grad_layers", [
    # GIN propagates the raw features in layer 1 (no gradient): the default grad_layers = L - 1
    (lambda gc: gc.nn.GIN(16, 8, 4, num_layers=3), None),
    # GCN propagates X W (needs a gradient) in every layer: grad_layers = L
    (lambda gc: gc.nn.GCN(16, 32, 4, num_layers=3), 3),
])
def test_comm_data_matches_data_plan(sbm, make, grad_layers):
    import gnncompile as gc
    from gnncompile.ir.plan import HaloExchange

    n = 4
    model = make(gc)
    p = gc.plan(model, sbm, gpus=n, strategy="data", partitioner="metis")
    alpha = p.info["partition"]["replication_factor"]
    halos = [i for i in p.ranks[0].instructions if isinstance(i, HaloExchange)]
    widths = [i.width for i in halos if not i.grad]
    L = len(widths)
    assert L == 3
    g = L - 1 if grad_layers is None else grad_layers
    assert sorted(i.width for i in halos if i.grad) == sorted(widths[L - g:])
    # the halo rows of all ranks are (alpha - 1)|V|
    assert round((alpha - 1) * sbm.num_nodes) == sum(p.info["halo_rows"])
    # predicted bytes of all ranks, less each rank's ring all-reduce of the float32 gradients
    ring = f.ring_allreduce_bytes(p.info["params"] * 4, n)
    halo_bytes = sum(p.predictions["bytes_sent"]) - n * ring
    predicted = f.comm_data(sbm.num_nodes, alpha, L, widths, grad_layers=grad_layers)
    assert round(predicted) == halo_bytes
    assert predicted == approx(halo_bytes, rel=1e-12)


def test_sampled_sizes_and_split_remote_rows() -> None:
    """A mini-batch's expected layers: the seeds, then each layer's destinations keep min(d, f)
    in-edges whose sources add distinct vertices, never more than the graph."""
    from gnncompile.cost_models.formulas import sampled_sizes, split_remote_rows

    layers = sampled_sizes(1000, 8.0, 100, [5, 3])
    assert layers[-1] == (100.0, 0.0)
    assert layers[1][1] == 100 * 3 and layers[0][1] == layers[1][0] * 5
    assert 1000 >= layers[0][0] >= layers[1][0] >= 100
    # sources of 300 draws over 1000 vertices: 100 + 900 (1 - exp(-0.3))
    assert math.isclose(layers[1][0], 100 + 900 * (1 - math.exp(-0.3)), rel_tol=1e-12)
    assert sampled_sizes(1000, 8.0, 100, [-1])[0][1] == 800  # -1: every in-edge
    assert sampled_sizes(50, 8.0, 100, [2])[-1][0] == 50  # no more seeds than vertices
    assert split_remote_rows(1000, 400, 1, 0.5) == 0.0
    assert split_remote_rows(1000, 400, 4, 0.0) == 0.0
    r = split_remote_rows(1000, 400, 4, 0.75)
    assert 0 < r <= 75 and math.isclose(r, 750 * (1 - math.exp(-75 / 750)), rel_tol=1e-12)
    with pytest.raises(PlanningError):
        sampled_sizes(1000, 8.0, 100, [0])
    with pytest.raises(PlanningError):
        split_remote_rows(1000, 400, 4, 1.5)
