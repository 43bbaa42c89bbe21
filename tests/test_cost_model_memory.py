"""The cost model's liveness walk against what the runtime allocates (``benchmarks/memory_fidelity.py``).

Each test pins one accounting rule of :mod:`gnncompile.cost_models.model` that the benchmark's
per-instruction comparison with the runtime's allocation events showed: gradients live from their
backward to the optimizer step, the first step allocates Adam's moments, unfreed values live to
the end of the step, ``relu`` saves its result, an unsaved concatenation is dropped after its last
forward, received gradients are held, an all-to-all keeps its send buffer until waited for, and a
linear layer on sparse features copies its weight and indices on a CPU.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import gnncompile as gc
from gnncompile import datasets
from gnncompile.cost_models.hardware import Cluster
from gnncompile.cost_models.model import (PlanCost, _RankWalk, _saved_per_op, _op_temporaries,
                                          _saves_result, op_value,
                                          _sparse_product_temporaries,
                                          _stage_gradients, predict, static_memory)
from gnncompile.frontend import ops as fops
from gnncompile.ir.plan import AllToAll, Backward, Forward, Free, OpCost, OptimizerStep, Recv
from gnncompile.runtime.memory import PeakMemory

N, F, H = 600, 32, 16
GPU = Cluster.parse("4xA5000")


@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    return datasets.synthetic("sbm", num_nodes=N, avg_degree=8, num_features=F, num_classes=4, seed=3)


def model(kind: str, g: gc.Graph, dropout: float = 0.5) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "GCN":
        return gc.nn.GCN(g.num_features, H, g.num_classes, num_layers=2, dropout=dropout)
    return gc.nn.GAT(g.num_features, 4, g.num_classes, heads=4, num_layers=2, dropout=dropout)


def test_gradients_live_from_their_backward_to_the_optimizer_step(sbm: gc.Graph) -> None:
    """``zero_grad(set_to_none=True)``: a steady step starts without gradients; each stage's first
    backward makes its weights' (GCN's first stage: the ``F x H`` weight), the optimizer step ends them."""
    plan = gc.plan(model("GCN", sbm), sbm, 2, strategy="data")
    cost = PlanCost(plan, GPU)
    s = cost.static[0]
    assert s.gradients == s.parameters > 0
    assert cost.base_memory()[0] == s.total - s.gradients == s.resident
    shares = _stage_gradients(plan.ranks[0], s.gradients)
    assert sum(shares.values()) == pytest.approx(s.gradients)
    assert shares[0] == pytest.approx(4 * F * H)  # the first linear layer's weight, no bias
    w = _RankWalk(cost, plan.ranks[0])
    opt = next(i for i, inst in enumerate(plan.ranks[0].instructions) if isinstance(inst, OptimizerStep))
    assert w.optimizer_at == opt
    c = cost(0, plan.ranks[0].instructions[opt])
    assert c.free >= c.alloc + s.gradients


def test_the_first_step_allocates_adams_moments_in_its_optimizer_step(sbm: gc.Graph) -> None:
    """The runtime measures the first step: Adam's two moments are created by its optimizer step,
    so before it the rank holds ``2 * params`` bytes less than in a steady step."""
    plan = gc.plan(model("GCN", sbm), sbm, 2, strategy="data")
    steady, first = PlanCost(plan, GPU), PlanCost(plan, GPU, first_step=True)
    s = steady.static[0]
    assert [a - b for a, b in zip(steady.base_memory(), first.base_memory())] == [x.optimizer for x in steady.static]
    opt = next(i for i in plan.ranks[0].instructions if isinstance(i, OptimizerStep))
    assert first(0, opt).alloc - steady(0, opt).alloc == s.optimizer == 2 * s.parameters
    pred = predict(plan, GPU)
    assert all(f <= p for f, p in zip(pred.first_step_peak_memory(), pred.peak_memory))


def test_data_plans_free_stage_outputs_after_their_last_use(sbm: gc.Graph) -> None:
    """``data`` plans ``Free`` a stage output after the last instruction that reads it: the first
    layer's output is released before the step ends, and the next stage's input leaf is not held
    until its backward (no op of that stage saves it: a propagation first)."""
    plan = gc.plan(model("GCN", sbm), sbm, 2, strategy="data")
    dp = plan.ranks[0]
    frees = {(i.value, i.chunk): k for k, i in enumerate(dp.instructions) if isinstance(i, Free)}
    w = _RankWalk(PlanCost(plan, GPU), dp)
    last = len(dp.instructions) - 1
    f0 = next(i for i, inst in enumerate(dp.instructions) if isinstance(inst, Forward))
    for o in w.stages[dp.instructions[f0].stage].outputs:
        assert (o, 0) in frees
        assert w.gone((o, 0), f0) == frees[o, 0] < last
    f1 = next(i for i, inst in enumerate(dp.instructions) if isinstance(inst, Forward) and i > f0)
    st = w.stages[dp.instructions[f1].stage]
    assert st.costs[0].kind == "P"
    assert not any((v, 0) in w.held for v in st.inputs)


def test_relu_saves_its_result_not_its_input() -> None:
    """PyTorch's ``relu``, ``sigmoid``, ``tanh``, ``exp``, ``softmax`` and gnncompile's
    ``edge_softmax`` save their output; ``elu``, ``leaky_relu`` are counted as saving their input.
    ``edge_softmax`` also holds one temporary of its output's size each way in its torch
    formulation (off the CPU); the CPU's native edge reductions hold none. ``edge_attention`` saves
    its result; its backward holds the scores' gradient (one temporary natively, two off the CPU)."""
    def op(name: str) -> OpCost:
        return OpCost(name=name, kind="T")
    assert all(_saves_result(op(n)) for n in ("relu", "relu_1", "seg.relu_12", "sigmoid", "log_softmax_3",
                                              "edge_softmax_1"))
    assert not any(_saves_result(op(n)) for n in ("elu", "leaky_relu_1", "relu6", "dropout_rows"))
    gpu, cpu = GPU.rank_device(0), Cluster.parse("1xcpu").rank_device(0)
    for backward in (False, True):
        assert _op_temporaries(op("seg.edge_softmax_2"), 100.0, gpu, backward) == 100.0
        assert _op_temporaries(op("relu"), 100.0, gpu, backward) == 0
        assert _op_temporaries(op("seg.edge_softmax_2"), 100.0, cpu, backward) == 0
    assert _saves_result(op("edge_attention_1"))
    assert [_op_temporaries(op("edge_attention"), 100.0, d, b) for d in (cpu, gpu) for b in (False, True)] \
        == [0, 100.0, 100.0, 200.0]


def test_a_pulled_attention_backward_frees_its_permuted_values_before_their_gradient() -> None:
    """A propagation with edge values that need a gradient (GAT's) pulls its input's gradient through
    the transposed structure with the values permuted (an edge tensor), then makes the values'
    gradient (another): the model counts one of the two at a time, as the backward holds them."""
    g = datasets.synthetic("rmat", num_nodes=2000, avg_degree=8, num_features=1, num_classes=2, seed=3).compact()
    heads, width = 4, 8
    values = torch.rand(g.num_edges, heads, requires_grad=True)
    x = torch.randn(g.num_nodes, heads, width, requires_grad=True)
    out = gc.ops.propagate(g, x, "none", edge_weight=values)
    grad = torch.randn_like(out)
    fops.prepare_graph(g, [], torch.float32)
    _ = fops._csr_t(g, True)  # the transposed structure and permutation exist before the measurement
    edge, vertex = values.numel() * 4, x.numel() * 4
    with PeakMemory("cpu") as pm:
        gv, gx = torch.autograd.grad(out, (values, x), grad)
    assert gv.shape == values.shape and gx.shape == x.shape
    assert edge > vertex / 2  # (an edge tensor more would show)
    assert pm.peak_bytes <= vertex + edge + 64 * 1024, (pm.peak_bytes, vertex, edge)


def test_edge_softmax_saves_only_its_output() -> None:
    """What the model assumes of ``edge_softmax`` (with and without self loops): autograd saves its
    output (the same storage) and nothing else per edge."""
    g = datasets.synthetic("sbm", num_nodes=50, avg_degree=4, num_features=4, num_classes=2, seed=1)
    for loops in (False, True):
        e = torch.randn(g.num_edges + (g.num_nodes if loops else 0), 3, requires_grad=True)
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = gc.ops.edge_softmax(g, e, add_self_loops=loops)
        assert [t.untyped_storage().data_ptr() for t in saved] == [out.untyped_storage().data_ptr()]


def test_relu_output_is_counted_once_in_the_forward(sbm: gc.Graph) -> None:
    """GCN's hidden stage: ``propagate, add, relu, dropout, lin``. At the dropout, ``relu``'s output
    is both what ``relu`` saved and the dropout's input: one tensor. The dropout multiplies into its
    output's buffer (``keep`` cast, scaled, times ``x`` in place): no temporary, so the forward holds
    what its ops save (``relu``'s output, the bool ``keep`` of the rank's rows, one byte per entry;
    the linear layer's input, the dropout's output, is computed again in backward from those two)
    and the stage's output, nothing more."""
    plan = gc.plan(model("GCN", sbm), sbm, 2, strategy="data")
    cost = PlanCost(plan, GPU)
    w = _RankWalk(cost, plan.ranks[0])
    f1 = next(i for i in plan.ranks[0].instructions if isinstance(i, Forward) and i.stage == 1)
    st = w.stages[1]
    assert [op.name for op in st.costs][2:4] == ["relu", "dropout_rows"]
    rows = 4 * H * plan.ranks[0].sizes.nodes
    c = cost(0, f1)
    assert _saved_per_op(w, st)[2:] == pytest.approx([rows, rows / 4, 0], abs=1)
    assert op_value(st.costs[4], st.costs[4].replayed, w.sizes) == pytest.approx(rows, abs=1)
    # what stays until the backward, and the dropout's output: held only while the linear layer runs
    assert c.alloc - c.free == pytest.approx(rows + rows / 4 + w.value_bytes["convs_1_lin"], abs=8)
    assert c.free == pytest.approx(rows, abs=8)


def test_a_concatenation_no_op_saves_is_dropped_after_its_last_forward(sbm: gc.Graph) -> None:
    """``layer``: a rank propagating every chunk reads the whole previous layer (a concatenation of
    its chunks); GCN's propagation does not save its input, so the executor keeps only its shape
    after the last forward that reads it, not until the last backward."""
    plan = gc.plan(model("GCN", sbm, dropout=0.0), sbm, 4, strategy="layer", chunks=4)
    for dp in plan.ranks:
        w = _RankWalk(PlanCost(plan, GPU), dp)
        for (v, read, stale), (first, last) in w.concat_span.items():
            assert stale == ()  # (exact: no chunk is read from a previous step)
            assert isinstance(dp.instructions[last], Forward)
            assert last == max(i for i, inst in enumerate(dp.instructions) if isinstance(inst, Forward)
                               and st_reads(w, inst, v, read))
            return
    pytest.fail("no rank reads a concatenation")


def st_reads(w: _RankWalk, inst: Forward, v: str, read: tuple) -> bool:
    st = w.stages[inst.stage]
    return v in st.inputs and st.chunks_read(v, inst.chunk) == read


def test_received_gradients_are_held_until_consumed(sbm: gc.Graph) -> None:
    """A gradient received from the next stage's rank is stored (a block: added into a gradient of
    the value's size) until the backward that consumes it."""
    plan = gc.plan(model("GCN", sbm, dropout=0.0), sbm, 4, strategy="layer", chunks=4)
    for dp in plan.ranks:
        cost = PlanCost(plan, GPU)
        w = _RankWalk(cost, dp)
        recvs = [inst for inst in dp.instructions if isinstance(inst, Recv) and inst.grad]
        if not recvs:
            continue
        r = recvs[0]
        nbytes = math.prod(r.shape) * 4
        c = cost(dp.rank, r)
        if r.part:  # the block received is a temporary, added into the value-sized gradient kept
            assert (c.alloc, c.free) == (w.value_bytes[r.name] + nbytes, nbytes)
        else:
            assert (c.alloc, c.free) == (nbytes, 0)
        return
    pytest.fail("no rank receives a gradient")


def test_an_all_to_all_keeps_its_send_buffer_until_waited_for(sbm: gc.Graph) -> None:
    """``tensor``: a posted all-to-all copies what it sends per peer (a temporary) and into one
    buffer, kept until the next forward or backward waits for it, beside the received output."""
    plan = gc.plan(model("GCN", sbm), sbm, 4, strategy="tensor")
    dp = plan.ranks[0]
    cost = PlanCost(plan, GPU)
    w = _RankWalk(cost, dp)
    i, a2a = next((i, inst) for i, inst in enumerate(dp.instructions) if isinstance(inst, AllToAll)
                  and not inst.grad)
    sent, got = w.value_bytes[a2a.value], w.value_bytes[a2a.output]
    c = cost(0, a2a)
    assert c.alloc == pytest.approx(got + 2 * sent, abs=8)
    assert c.free >= sent


def test_a_linear_layer_on_sparse_features_copies_its_weight_on_a_cpu_and_keeps_int32_indices(sbm: gc.Graph) -> None:
    """The native CPU product makes the weight contiguous transposed, in forward and again in
    backward; the rows' int32 column indices are made before the first step and kept beside the
    features (resident). Neither is counted on a GPU."""
    gen = torch.Generator().manual_seed(0)
    cols = torch.stack([torch.randperm(F, generator=gen)[:3].sort().values for _ in range(N)])
    x = torch.sparse_csr_tensor(torch.arange(0, 3 * N + 1, 3), cols.reshape(-1), torch.rand(3 * N, generator=gen),
                                size=(N, F))
    g = sbm.replace(x=x)
    plan = gc.plan(model("GCN", g), g, 2, strategy="data")
    dp = plan.ranks[0]
    lin = dp.stages[0].costs[0]
    assert lin.name == "convs_0_lin"
    cpu = Cluster.parse("2xcpu")
    w = _RankWalk(PlanCost(plan, cpu), dp)
    assert _sparse_product_temporaries(w, lin) == pytest.approx(4 * F * H)
    assert _sparse_product_temporaries(_RankWalk(PlanCost(plan, GPU), dp), lin) == 0
    rows = dp.sizes.nodes if dp.sizes.feature_rows is None else dp.sizes.feature_rows
    plain = static_memory(plan, dp).features
    assert PlanCost(plan, cpu).static[0].features - plain == pytest.approx(4 * 3 * rows, abs=4)
    assert PlanCost(plan, GPU).static[0].features == plain
