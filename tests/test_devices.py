"""Devices and backends of a run, on any machine: the placement decision (pure), the run header, the
host-staging path of the communicator forced on the CPU, progress lines, and refusals of impossible
requests before any rank starts.

The staging path is the one ranks sharing a GPU take (gloo cannot send/recv CUDA tensors): here it
is forced on the CPU for every communication operation, and a data, tensor and task plan must still
give single-device training's step and the predicted bytes.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
import torch.distributed as dist

import gnncompile as gc
from gnncompile import RuntimeFailure
from gnncompile.runtime import comm as comm_module
from gnncompile.runtime.comm import STAGEABLE_OPS, Communicator, HaloSpec, host_staged_ops
from gnncompile.runtime.executor import describe_run
from gnncompile.runtime.launcher import Placement, RankContext, launch, resolve_placement
from gnncompile.runtime.trainer import ProgressLines
from gnncompile.testing import reference_step
from graph_strategies import DT, sbm_graph, seeded_model

SR = frozenset({"send", "recv"})


# --------------------------------------------------------------------------- the placement decision
@pytest.mark.parametrize("ranks, gpus, device, backend, want_backend, want_devices, want_staged", [
    (2, 0, None, None, "gloo", ("cpu", "cpu"), frozenset()),
    (2, 4, "cpu", None, "gloo", ("cpu", "cpu"), frozenset()),
    (2, 4, "cpu", "gloo", "gloo", ("cpu", "cpu"), frozenset()),
    (1, 1, None, None, "nccl", ("cuda:0",), frozenset()),
    (2, 2, None, None, "nccl", ("cuda:0", "cuda:1"), frozenset()),
    (2, 4, "cuda", None, "nccl", ("cuda:0", "cuda:1"), frozenset()),
    (2, 2, None, "nccl", "nccl", ("cuda:0", "cuda:1"), frozenset()),
    # ranks outnumber GPUs: they share them round-robin over gloo, send/recv staged through host memory
    (4, 1, None, None, "gloo", ("cuda:0",) * 4, SR),
    (5, 2, "cuda", None, "gloo", ("cuda:0", "cuda:1", "cuda:0", "cuda:1", "cuda:0"), SR),
    # gloo forced with a GPU per rank: no sharing, still staged
    (2, 2, "cuda", "gloo", "gloo", ("cuda:0", "cuda:1"), SR),
    # one named GPU
    (3, 2, "cuda:1", None, "gloo", ("cuda:1",) * 3, SR),
    (1, 2, "cuda:1", None, "nccl", ("cuda:1",), frozenset()),
])
def test_placement_cases(ranks: int, gpus: int, device, backend, want_backend: str, want_devices: tuple,
                         want_staged: frozenset) -> None:
    p = resolve_placement(ranks, gpus, device, backend)
    assert (p.backend, p.devices, p.stage_through_host) == (want_backend, want_devices, want_staged)
    assert p.num_ranks == ranks and p.num_gpus == gpus
    assert p.shared == (len(set(want_devices)) < ranks and want_devices[0] != "cpu")
    assert p.device(ranks - 1) == torch.device(want_devices[-1])


@pytest.mark.parametrize("ranks, gpus, device, backend, match", [
    (2, 0, "cuda", None, r"device='cuda' requested but no CUDA GPU is visible.*device='cpu'"),
    (1, 0, "cuda:0", None, "no CUDA GPU is visible"),
    (2, 0, None, "nccl", r"backend='nccl' needs the ranks on GPUs, but no GPU is visible; use backend='gloo'"),
    (2, 4, "cpu", "nccl", r"backend='nccl' needs the ranks on GPUs, but device='cpu' was asked for"),
    (4, 1, None, "nccl", r"one GPU per rank \(NCCL refuses two ranks on one GPU\): 4 ranks, 1 GPU\(s\); "
                         r"use backend='gloo' \(or None\) to let ranks share GPUs, or at most 1 rank"),
    (2, 4, "cuda:3", "nccl", r"4 GPU|one GPU per rank.*cuda:3"),
    (2, 2, "cuda:2", None, r"device='cuda:2' requested but this machine has 2 GPU\(s\) \(cuda:0..cuda:1\)"),
    (2, 1, "tpu", None, r"device must be 'cpu', 'cuda', 'cuda:N' or None \(auto\), got 'tpu'"),
    (2, 1, None, "mpi", r"backend must be 'gloo', 'nccl' or None \(auto\), got 'mpi'"),
    (0, 1, None, None, "at least one rank"),
])
def test_impossible_placements_are_refused(ranks: int, gpus: int, device, backend, match: str) -> None:
    with pytest.raises(RuntimeFailure, match=match):
        resolve_placement(ranks, gpus, device, backend)


def test_forced_staging() -> None:
    assert resolve_placement(2, 0, stage_through_host={"all"}).stage_through_host == STAGEABLE_OPS
    assert resolve_placement(2, 2, stage_through_host=()).stage_through_host == frozenset()
    assert resolve_placement(2, 0, stage_through_host={"recv"}).stage_through_host == {"recv"}
    with pytest.raises(RuntimeFailure, match=r"unknown operation\(s\) \['broadcast'\]"):
        resolve_placement(2, 0, stage_through_host={"broadcast"})
    with pytest.raises(ValueError, match="unknown operation"):
        Communicator(0, 1, stage_through_host={"gather"})
    assert host_staged_ops("gloo", "cuda") == SR
    assert host_staged_ops("nccl", "cuda") == host_staged_ops("gloo", "cpu") == frozenset()


def test_placement_descriptions() -> None:
    assert resolve_placement(2, 0).describe() == "2 ranks on CPU, gloo"
    assert resolve_placement(4, 1).describe() == \
        "4 ranks sharing 1 GPU (cuda:0: ranks 0-3), gloo; recv, send staged through host memory"
    assert resolve_placement(5, 2, "cuda").describe() == \
        "5 ranks sharing 2 GPUs (cuda:0: ranks 0, 2, 4; cuda:1: ranks 1, 3), gloo; recv, send staged through host memory"
    assert resolve_placement(2, 2).describe() == "2 ranks on 2 GPUs (one per rank: 0->cuda:0, 1->cuda:1), nccl"
    assert resolve_placement(1, 1).describe() == "1 rank on 1 GPU (one per rank: 0->cuda:0), nccl"


# --------------------------------------------------------------------------- the run header
@pytest.fixture(scope="module")
def sbm() -> gc.Graph:
    return sbm_graph(60)


def _gcn(g: gc.Graph, dropout: float = 0.0) -> torch.nn.Module:
    return seeded_model(lambda f, c: gc.nn.GCN(f, 6, c, num_layers=2, dropout=dropout), g)


def test_header_says_where_the_plan_was_planned_for_and_where_it_runs(sbm: gc.Graph) -> None:
    on_a100 = gc.plan(_gcn(sbm), sbm, gpus="4xA100")
    assert on_a100.info["devices"] == {"nodes": 1, "per_node": 4, "kind": "gpu", "name": on_a100.info["devices"]["name"]}
    assert "A100" in on_a100.info["devices"]["name"]
    text = describe_run(on_a100, resolve_placement(4, 0))
    assert text.startswith("4 ranks on CPU, gloo; planned for 1 node x 4 A100")
    assert "runs on this machine's CPU instead (predicted times and memory are for the planned devices)" in text
    text = describe_run(on_a100, resolve_placement(4, 1))
    assert text.startswith("4 ranks sharing 1 GPU (cuda:0: ranks 0-3), gloo;")
    assert "runs on 1 GPU instead of 4" in text
    assert "instead" not in describe_run(on_a100, resolve_placement(4, 4))
    local = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data")
    text = describe_run(local, resolve_placement(2, 0))
    assert text.startswith("2 ranks on CPU, gloo; planned for 1 node x 2 cpu") and "instead" not in text
    assert "runs on 2 GPUs instead" in describe_run(local, resolve_placement(2, 2))
    assert "\n" not in text
    # a plan for CPU hosts on 2 nodes runs its 4 ranks on this machine (it said nothing of it)
    two_hosts = gc.plan(_gcn(sbm), sbm, gpus="2x2xcpu", strategy="data")
    assert "runs on this machine alone instead of 2 nodes" in describe_run(two_hosts, resolve_placement(4, 0))
    assert "instead" not in describe_run(two_hosts, resolve_placement(2, 0))  # torchrun: this host's 2 of 4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusals of a CPU-only machine")
def test_impossible_runs_are_refused_before_any_rank_starts(sbm: gc.Graph) -> None:
    plan = gc.plan(_gcn(sbm), sbm, gpus=2, strategy="data")
    with pytest.raises(RuntimeFailure, match="no CUDA GPU is visible"):
        plan.run(epochs=1, device="cuda")
    with pytest.raises(RuntimeFailure, match="backend='nccl' needs the ranks on GPUs"):
        plan.run(epochs=1, backend="nccl")
    with pytest.raises(RuntimeFailure, match="no CUDA GPU is visible"):
        gc.train(_gcn(sbm), sbm, epochs=1, device="cuda")
    with pytest.raises(RuntimeFailure, match="no CUDA GPU is visible"):
        launch(_never_runs, 2, device="cuda")
    with pytest.raises(RuntimeFailure, match="backend='nccl' needs the ranks on GPUs"):
        launch(_never_runs, 2, backend="nccl")


def _never_runs(ctx: RankContext) -> None:
    raise AssertionError("a refused launch started a rank")


def test_launch_placement_arguments() -> None:
    with pytest.raises(ValueError, match="either placement or backend/device"):
        launch(_never_runs, 2, backend="gloo", placement=resolve_placement(2, 0))
    with pytest.raises(ValueError, match="the placement has 3 ranks, world_size is 2"):
        launch(_never_runs, 2, placement=resolve_placement(3, 0))
    with pytest.raises(ValueError, match="inline=True runs one rank with gloo on the CPU"):
        launch(_never_runs, 1, device="cuda", inline=True)


# --------------------------------------------------------------------------- staging forced on the CPU
class _Recorder:
    """Stands in for ``torch.distributed`` inside the communicator: records the storage of every
    tensor handed to a point-to-point call, then makes the call."""

    def __init__(self) -> None:
        self.ptrs: list[int] = []
        self.held: list[torch.Tensor] = []  # alive, so no later tensor reuses a recorded address

    def __getattr__(self, name: str):
        real = getattr(dist, name)
        if name not in ("send", "isend", "recv", "irecv"):
            return real

        def call(t: torch.Tensor, *args, **kwargs):
            self.ptrs.append(t.data_ptr())
            self.held.append(t)
            return real(t, *args, **kwargs)
        return call


def _staging_worker(ctx: RankContext) -> dict:
    """Every communicator operation, once with every operation staged and once without: results must
    be identical and byte counts equal; staged point-to-point calls never hand the library the
    caller's tensors."""
    n, r = ctx.world_size, ctx.rank
    gen = torch.Generator().manual_seed(r)
    out: dict = {}
    for staged in (frozenset(), STAGEABLE_OPS):
        comm = Communicator(r, n, stage_through_host=staged)
        recorder = _Recorder()
        comm_module.dist = recorder
        try:
            res = []
            h = torch.randn(4, 3, generator=gen.manual_seed(r), dtype=torch.float64)
            # halo: rank r sends its row 1 to every other rank
            spec = HaloSpec(tuple(torch.tensor([1]) if q != r else torch.tensor([], dtype=torch.long)
                                  for q in range(n)), tuple(1 if q != r else 0 for q in range(n)), 4)
            ext = comm.halo_forward(h, spec)
            res += [ext, comm.halo_backward(ext * 2, spec)]
            rows, cols = [4] * n, [1, 2][:n] if n == 2 else [1] * n
            wide = torch.randn(4, sum(cols), generator=gen, dtype=torch.float64)
            c = comm.rows_to_cols_async(wide, rows, cols)
            res += [c.wait(), comm.cols_to_rows(c.wait(), rows, cols)]
            res += [comm.all_gather_rows(h, rows), comm.reduce_scatter_rows(torch.cat([h] * n), rows)]
            t = h.clone()
            comm.all_reduce_([t])
            res.append(t)
            mine = h + 0
            peer = (r + 1) % n
            if r == 0:
                comm.send(mine, peer)
                got = comm.recv((4, 3), torch.float64, n - 1)
                work = comm.isend(mine * 3, peer)
                work.wait()
            else:
                got = comm.recv((4, 3), torch.float64, r - 1)
                comm.send(mine, peer)
                got3 = comm.recv((4, 3), torch.float64, r - 1)
                res.append(got3)
            res.append(got)
            p2p_mine = mine.data_ptr() in recorder.ptrs
            p2p_got = got.data_ptr() in recorder.ptrs
        finally:
            comm_module.dist = dist
        out["staged" if staged else "direct"] = dict(results=res, sent=comm.stats.total_sent(),
                                                   recv=comm.stats.total_received(),
                                                   caller_tensors_handed=(p2p_mine, p2p_got))
    return out


def test_staging_forced_on_cpu_changes_no_result() -> None:
    out = launch(_staging_worker, 2, timeout=60)
    for rank, o in enumerate(out):
        direct, staged = o["direct"], o["staged"]
        assert len(direct["results"]) == len(staged["results"]) >= 8
        for i, (a, b) in enumerate(zip(direct["results"], staged["results"])):
            assert torch.equal(a, b), f"rank {rank}, result {i}"
        assert (direct["sent"], direct["recv"]) == (staged["sent"], staged["recv"]) and direct["sent"] > 0
        assert direct["caller_tensors_handed"] == (True, True), rank
        assert staged["caller_tensors_handed"] == (False, False), rank
    # what rank 1 received from rank 0 is rank 0's tensor
    assert torch.equal(out[1]["staged"]["results"][-1], out[0]["staged"]["results"][0][:4])


@pytest.mark.parametrize("strategy, options, ranks", [
    ("data", dict(partitioner="metis"), 2),                      # halo exchanges, gradient all-reduce
    ("tensor", dict(chunks=2), 2),                               # posted all-to-alls per chunk
    ("task", dict(chunks=2), 3),                                 # send/recv between task groups
])
def test_plans_with_every_operation_staged_give_the_single_device_step(sbm: gc.Graph, strategy: str,
                                                                      options: dict, ranks: int) -> None:
    model = _gcn(sbm, dropout=0.5)
    ref = reference_step(copy.deepcopy(model), sbm)
    plan = gc.plan(copy.deepcopy(model), sbm, ranks, strategy=strategy, **options)
    res = plan.run(epochs=1, capture=True, stage_through_host={"all"}, device="cpu", timeout=60)
    assert res.placement.stage_through_host == STAGEABLE_OPS and res.placement.backend == "gloo"
    tol = dict(rtol=1e-9, atol=1e-11)
    torch.testing.assert_close(torch.tensor(res.history.loss[0], dtype=DT), torch.tensor(ref.loss, dtype=DT), **tol)
    torch.testing.assert_close(res.captured["logits"], ref.logits, **tol)
    for name, g in ref.grads.items():
        torch.testing.assert_close(res.captured["grads"][name], g, **tol, msg=lambda m, name=name: f"{name}: {m}")
    assert [r.bytes_sent for r in res.ranks] == plan.predictions["bytes_sent"]
    assert [r.bytes_received for r in res.ranks] == plan.predictions["bytes_received"]
    assert "staged through host memory" in res.describe_placement()


def test_run_records_its_placement(sbm: gc.Graph) -> None:
    res = gc.plan(_gcn(sbm), sbm, 2, strategy="data").run(epochs=1, device="cpu", timeout=60)
    assert res.placement == Placement("gloo", ("cpu", "cpu"), res.placement.num_gpus, frozenset())
    assert res.describe_placement().startswith("2 ranks on CPU, gloo; planned for 1 node x 2 cpu")


# --------------------------------------------------------------------------- progress lines
def test_progress_lines() -> None:
    buf = io.StringIO()
    lines = ProgressLines(3, "train GCN on sbm", every_s=0.0, stream=buf)
    lines.update(0, 1.25, math.nan)
    lines.update(1, 0.5, 0.75)
    lines.close()
    text = buf.getvalue().splitlines()
    assert len(text) == 2
    assert text[0].startswith("train GCN on sbm: epoch 1/3 loss 1.2500 val - (")
    assert text[1].startswith("train GCN on sbm: epoch 2/3 loss 0.5000 val 0.750 (") and text[1].endswith(" s)")
    quiet = io.StringIO()
    short = ProgressLines(3, "x", every_s=3600.0, stream=quiet)
    for e in range(3):
        short.update(e, 1.0, 0.5)
    short.close()
    assert quiet.getvalue() == ""   # a short run prints nothing
    # a long run's last epoch is printed at the end even between two lines' times
    late = io.StringIO()
    slow = ProgressLines(5, "x", every_s=0.0, stream=late)
    slow.update(0, 1.0)
    slow.every_s = 3600.0
    slow.update(4, 0.5, 0.8)
    slow.close()
    assert late.getvalue().splitlines()[-1].startswith("x: epoch 5/5 loss 0.5000 val 0.800")


def test_train_prints_no_progress_lines_for_a_short_run(sbm: gc.Graph, capsys: pytest.CaptureFixture) -> None:
    gc.train(_gcn(sbm), sbm, epochs=2)
    assert "epoch" not in capsys.readouterr().err


def test_gnncompile_device_sets_the_default_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``$GNNCOMPILE_DEVICE`` is the device of a run that names none (tests set it to cpu)."""
    from gnncompile.runtime.executor import plan_placement

    g = sbm_graph(40)
    plan = gc.plan(gc.nn.GCN(g.num_features, 4, g.num_classes), g, gpus=2, strategy="data",
                   partitioner="contiguous")
    monkeypatch.setenv("GNNCOMPILE_DEVICE", "cpu")
    assert plan_placement(plan).device_type == "cpu"
    monkeypatch.setenv("GNNCOMPILE_DEVICE", "cuda:7")
    if torch.cuda.device_count() <= 7:
        # the message names where the device came from (it said "use device='cpu'", never given)
        with pytest.raises(RuntimeFailure, match=r"^\$GNNCOMPILE_DEVICE='cuda:7' .*unset GNNCOMPILE_DEVICE"):
            plan_placement(plan)
    assert plan_placement(plan, device="cpu").device_type == "cpu"   # a named device wins
    monkeypatch.delenv("GNNCOMPILE_DEVICE")
    assert plan_placement(plan).device_type == ("cuda" if torch.cuda.is_available() else "cpu")
