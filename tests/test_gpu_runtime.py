"""Every strategy's runtime on CUDA tensors, with 2-4 ranks sharing one GPU (gloo, send/recv staged
through host memory; the path NCCL takes with a GPU per rank differs only in the process group and
the staging): one step equals single-device training on the GPU (float64, the CPU property tests'
tolerances), measured bytes equal the plan's prediction, ``Free`` releases CUDA storage, peak
memory comes from the CUDA allocator and timelines from CUDA events.

Skipped without CUDA. One GPU is enough (ranks share it); a machine with several GPUs spreads the
ranks over them.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch

import gnncompile as gc
from gnncompile.ir.verify_plan import verify_plan
from gnncompile.testing import reference_step
from graph_strategies import DT, sbm_graph, seeded_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() "
                                                                       "is False)")]

TOL = dict(rtol=1e-9, atol=1e-11)

MODELS: dict[str, Callable[[int, int], torch.nn.Module]] = {
    "gcn": lambda f, c: gc.nn.GCN(f, 6, c, num_layers=2, dropout=0.0),
    "gcn_dropout": lambda f, c: gc.nn.GCN(f, 6, c, num_layers=2, dropout=0.5),
    "sage": lambda f, c: gc.nn.GraphSAGE(f, 6, c, num_layers=2, dropout=0.0),
    "gat": lambda f, c: gc.nn.GAT(f, 3, c, num_layers=2, heads=2, dropout=0.0),
    "gin": lambda f, c: gc.nn.GIN(f, 6, c, num_layers=2, dropout=0.0),
}


@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    return sbm_graph(90)


def _cuda_reference(model: torch.nn.Module, graph: gc.Graph) -> Any:
    """Single-device training's step on the GPU; tensors brought back to the CPU for comparison."""
    ref = reference_step(copy.deepcopy(model).to("cuda"), graph.to("cuda"))
    ref.logits = ref.logits.cpu()
    ref.grads = {n: None if g is None else g.cpu() for n, g in ref.grads.items()}
    return ref


def _check_step(res: Any, ref: Any) -> None:
    torch.testing.assert_close(torch.tensor(res.history.loss[0], dtype=DT), torch.tensor(ref.loss, dtype=DT), **TOL)
    torch.testing.assert_close(res.captured["logits"], ref.logits, **TOL, msg=lambda m: f"logits: {m}")
    for name, g in ref.grads.items():
        got = res.captured["grads"].get(name)
        if g is None:
            assert got is None or not bool(got.any()), name
            continue
        torch.testing.assert_close(got, g, **TOL, msg=lambda m, name=name: f"gradient of {name}: {m}")


def _cluster(ranks: int) -> str:
    """A GPU cluster of ``ranks`` devices to plan for: the strategy and its options are forced, so
    the cluster changes predicted times only, and the plan does not depend on this machine's GPUs."""
    return f"{ranks}xA100"


def _run_on_gpu(model: torch.nn.Module, graph: gc.Graph, ranks: int, **options: Any) -> tuple[gc.Plan, Any]:
    plan = gc.plan(copy.deepcopy(model), graph, _cluster(ranks), **options)
    verify_plan(plan)
    res = plan.run(epochs=1, capture=True, device="cuda", timeout=120)
    gpus = torch.cuda.device_count()
    assert res.placement.device_type == "cuda"
    assert res.placement.backend == ("nccl" if ranks <= gpus else "gloo")
    if ranks > gpus:
        assert res.placement.shared and "sharing" in res.describe_placement()
    return plan, res


def _check_bytes(plan: gc.Plan, res: Any) -> None:
    assert [r.bytes_sent for r in res.ranks] == plan.predictions["bytes_sent"]
    assert [r.bytes_received for r in res.ranks] == plan.predictions["bytes_received"]


# --------------------------------------------------------------------------- every strategy
@pytest.mark.parametrize("name, ranks", [("gcn", 2), ("gcn_dropout", 4), ("gat", 3), ("sage", 4)])
def test_data(sbm: gc.Graph, name: str, ranks: int) -> None:
    model = seeded_model(MODELS[name], sbm)
    plan, res = _run_on_gpu(model, sbm, ranks, strategy="data", partitioner="metis")
    _check_step(res, _cuda_reference(model, sbm))
    _check_bytes(plan, res)


#: (strategy, model, ranks, options) of the chunked and tensor strategies' one-step checks
CHUNKED_CASES = [
    *[("tensor", name, ranks, {"chunks": chunks})
      for name, ranks, chunks in [("gcn", 2, 1), ("gin", 3, 1), ("gcn_dropout", 4, 3), ("sage", 3, 4)]],
    *[("mop", name, ranks, {"chunks": chunks, "sparse_ranks": 1, "reorder": "rcm"})
      for name, ranks, chunks in [("gcn", 3, 2), ("gcn_dropout", 4, 3), ("sage", 2, 1)]],
    *[("task", name, ranks, {"chunks": chunks})
      for name, ranks, chunks in [("gcn_dropout", 2, 2), ("gin", 3, 3), ("gcn", 4, 2)]],
]


@pytest.mark.parametrize("strategy, name, ranks, options", CHUNKED_CASES)
def test_strategy_step(sbm: gc.Graph, strategy: str, name: str, ranks: int, options: dict) -> None:
    model = seeded_model(MODELS[name], sbm)
    plan, res = _run_on_gpu(model, sbm, ranks, strategy=strategy, **options)
    _check_step(res, _cuda_reference(model, sbm))
    _check_bytes(plan, res)


def test_tensor_decoupled_equals_one_rank(sbm: gc.Graph) -> None:
    """Decoupled (relaxed): n ranks train the decoupled model exactly as one rank does, on the GPU."""
    model = seeded_model(lambda f, c: gc.nn.GCN(f, 5, c, num_layers=2, dropout=0.5), sbm)
    results = []
    for n in (1, 3):
        plan = gc.plan(copy.deepcopy(model), sbm, _cluster(n), strategy="tensor", decouple=True, semantics="relaxed")
        results.append(plan.run(epochs=1, seed=0, capture=True, update_model=False, device="cuda", timeout=120))
    one, three = results
    assert one.placement.backend == "nccl"  # one rank, one GPU
    _check_step(three, type("Ref", (), dict(loss=one.history.loss[0], logits=one.captured["logits"],
                                             grads=one.captured["grads"])))


def test_task_regrouped(sbm: gc.Graph) -> None:
    """dependencies='regrouped' with one subgraph reads every edge: exact, though rows come shuffled."""
    model = seeded_model(MODELS["gcn_dropout"], sbm)
    plan, res = _run_on_gpu(model, sbm, 3, strategy="task", chunks=1, dependencies="regrouped", subgraph_chunks=3,
                            semantics="relaxed")
    assert plan.program[0].step.regroup is not None
    _check_step(res, _cuda_reference(model, sbm))


def test_one_rank_runs_over_nccl(sbm: gc.Graph) -> None:
    model = seeded_model(MODELS["gcn"], sbm)
    plan = gc.plan(copy.deepcopy(model), sbm, _cluster(1), strategy="data")
    res = plan.run(epochs=1, capture=True, device="cuda", timeout=120)
    assert res.placement.backend == "nccl" and res.placement.devices == ("cuda:0",)
    _check_step(res, _cuda_reference(model, sbm))


# --------------------------------------------------------------------------- memory and timelines
def test_peak_memory_from_the_cuda_allocator_and_timelines_from_events(sbm: gc.Graph) -> None:
    model = seeded_model(MODELS["gcn"], sbm)
    plan = gc.plan(copy.deepcopy(model), sbm, _cluster(2), strategy="data")
    res = plan.run(epochs=3, device="cuda", timeout=120)
    for r in res.ranks:
        # the allocator's blocks are multiples of 512 bytes; the CPU profiler counts exact tensor bytes
        assert r.peak_memory > 0 and r.peak_memory % 512 == 0, r.peak_memory
        assert {e.step for e in r.timeline} == {0, 1, 2}
        assert [e.instruction for e in r.timeline if e.step == 0] == [str(i) for i in plan.ranks[r.rank].instructions]
        assert all(e.end >= e.start >= 0 for e in r.timeline)
        steps = [[e for e in r.timeline if e.step == s] for s in range(3)]
        assert steps[0][-1].end <= steps[1][0].start + 1e-3  # one clock across steps


def test_free_releases_cuda_storage() -> None:
    """The task plan's Free instructions lower the propagation rank's CUDA peak by at least the bytes
    of the stage outputs it sent, and change no result (as on the CPU, tests/test_task_memory.py;
    float64 and within rounding, not bit for bit: on an H200 the float32 logits of the two runs
    differed in their last bits; kernel choice or atomic order, the cause is not established)."""
    from test_task_memory import _released_output_bytes, _without_frees

    g = gc.datasets.synthetic("rmat", num_nodes=4096, avg_degree=8, num_features=32, num_classes=4, seed=0)
    torch.manual_seed(0)
    model = gc.nn.GCN(g.num_features, 64, g.num_classes, num_layers=2, dropout=0.5).to(DT)
    plan = gc.plan(copy.deepcopy(model), g, _cluster(4), strategy="task", chunks=4)
    bare = _without_frees(plan)
    with_free = plan.run(epochs=1, capture=True, update_model=False, device="cuda", timeout=120)
    without = bare.run(epochs=1, capture=True, update_model=False, device="cuda", timeout=120)
    torch.testing.assert_close(torch.tensor(with_free.history.loss), torch.tensor(without.history.loss), **TOL)
    torch.testing.assert_close(with_free.captured["logits"], without.captured["logits"], **TOL)
    p_ranks = [dp for dp in plan.ranks if any(s.kinds.startswith("P") for s in dp.stages)]
    dp = max(p_ranks, key=_released_output_bytes)
    released, r = _released_output_bytes(dp), dp.rank
    assert released > 0
    assert without.ranks[r].peak_memory - with_free.ranks[r].peak_memory >= released, \
        (r, without.ranks[r].peak_memory, with_free.ranks[r].peak_memory, released)


def test_split_with_dropout_on_cuda_trains_like_the_cpu_reference() -> None:
    """Sampled steps are drawn on the CPU and moved (blocks, exchange lists, the replicated masks'
    row positions); the masks are counter-based, so a CUDA run of split sees gc.train's masks."""
    g = gc.datasets.synthetic("sbm", num_nodes=300, avg_degree=8, num_features=12, num_classes=3, seed=4)
    g = g.replace(x=g.x.to(DT))
    torch.manual_seed(0)
    model = gc.nn.GAT(g.num_features, 4, g.num_classes, heads=2, num_layers=2, dropout=0.5).to(DT)
    ref = gc.train(copy.deepcopy(model), g, epochs=2, lr=0.01, batch_size=40, fanouts=[4, 3], verbose=False)
    plan = gc.plan(copy.deepcopy(model), g, gpus=2, strategy="split", batch_size=40, fanouts=[4, 3])
    res = plan.run(epochs=2, lr=0.01, timeout=180, device="cuda")
    torch.testing.assert_close(torch.tensor(res.history.loss), torch.tensor(ref.loss), **TOL)


# --------------------------------------------------------------------------- single device
def test_train_on_cuda_moves_everything(sbm: gc.Graph) -> None:
    model = seeded_model(MODELS["gcn_dropout"], sbm)
    hist = gc.train(model, sbm, epochs=3, device="cuda")
    assert len(hist.loss) == 3 and all(isinstance(x, float) for x in hist.loss)
    assert all(p.device.type == "cuda" for p in model.parameters())
    # one step on the GPU equals the CPU step (no dropout: the devices draw different masks)
    plain = seeded_model(MODELS["gcn"], sbm)
    cpu = reference_step(copy.deepcopy(plain), sbm)
    gpu = _cuda_reference(plain, sbm)
    torch.testing.assert_close(gpu.logits, cpu.logits, **TOL)
    for n, g in cpu.grads.items():
        torch.testing.assert_close(gpu.grads[n], g, **TOL)
