"""Differentiable communication on real ranks (gloo): halo exchange, rows<->cols all-to-all, send/recv.

Each rank holds its block of a global tensor drawn from a shared seed; the results and gradients of
the communication functions are compared with slicing the global tensor, and the byte counters with
the volumes the layouts imply.
"""

from __future__ import annotations

import pytest
import torch

from gnncompile.graph.shard import build_shards
from gnncompile.runtime.comm import Communicator, HaloSpec, cols_to_rows, halo_exchange, offsets, rows_to_cols
from gnncompile.runtime.launcher import RankContext, launch

ROWS = (3, 0, 5)      # an empty rank too
COLS = (2, 3, 1)


def _global(seed: int, n: int, d: int) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _all_to_all_worker(ctx: RankContext) -> dict:
    comm = Communicator(ctx.rank, ctx.world_size)
    n, d = sum(ROWS), sum(COLS)
    x, up = _global(0, n, d), _global(1, n, d)
    r, c = offsets(ROWS), offsets(COLS)
    mine_rows = x[r[ctx.rank]:r[ctx.rank + 1]].clone().requires_grad_(True)
    cols = rows_to_cols(mine_rows, comm, ROWS, COLS)
    ok_fwd = torch.equal(cols, x[:, c[ctx.rank]:c[ctx.rank + 1]])
    # loss = <up, x> over the whole tensor: d loss / d rows = up's rows
    (cols * up[:, c[ctx.rank]:c[ctx.rank + 1]]).sum().backward()
    ok_bwd = torch.equal(mine_rows.grad, up[r[ctx.rank]:r[ctx.rank + 1]])
    back = cols_to_rows(cols.detach(), comm, ROWS, COLS)
    ok_round_trip = torch.equal(back, x[r[ctx.rank]:r[ctx.rank + 1]])
    return dict(ok=(ok_fwd, ok_bwd, ok_round_trip), sent=comm.stats.total_sent(), recv=comm.stats.total_received())


def test_rows_cols_all_to_all_and_gradients() -> None:
    out = launch(_all_to_all_worker, 3, timeout=60)
    for rank, o in enumerate(out):
        assert o["ok"] == (True, True, True), f"rank {rank}: {o['ok']}"
        # rows->cols sends this rank's rows of the others' columns ("own") and receives the others'
        # rows of its columns ("other"); cols->rows (the backward, then the round trip) the reverse.
        # 8 bytes per element.
        own = ROWS[rank] * (sum(COLS) - COLS[rank]) * 8
        other = (sum(ROWS) - ROWS[rank]) * COLS[rank] * 8
        assert o["sent"] == own + other + other
        assert o["recv"] == other + own + own


def _halo_worker(ctx: RankContext) -> dict:
    import gnncompile as gc

    g = gc.datasets.synthetic("er", num_nodes=40, avg_degree=4, num_features=3, num_classes=2, seed=3)
    parts = torch.arange(g.num_nodes) % ctx.world_size
    shard = build_shards(g, parts, ctx.world_size)[ctx.rank]
    comm = Communicator(ctx.rank, ctx.world_size)
    spec = HaloSpec(tuple(shard.send_index), tuple(shard.recv_count), shard.num_owned)
    x = _global(0, g.num_nodes, 4)
    mine = x[shard.owned].clone().requires_grad_(True)
    ext = halo_exchange(mine, comm, spec)
    ok_fwd = torch.equal(ext, x[torch.cat([shard.owned, shard.halo])])
    # gradient of sum(ext * w): each owned row collects w of its own row and of every rank holding it as halo
    w = _global(1, g.num_nodes, 4)
    (ext * w[torch.cat([shard.owned, shard.halo])]).sum().backward()
    return dict(ok=ok_fwd, grad=mine.grad, owned=shard.owned, halo=shard.halo)


def test_halo_exchange_forward_and_backward() -> None:
    out = launch(_halo_worker, 3, timeout=60)
    w = _global(1, 40, 4)
    count = torch.ones(40)
    for o in out:
        assert o["ok"]
        count[o["halo"]] += 1  # every replica of a vertex sends its gradient home
    for o in out:
        torch.testing.assert_close(o["grad"], w[o["owned"]] * count[o["owned"], None], rtol=0, atol=1e-12)


def _lone_halo_worker(ctx: RankContext) -> dict:
    comm = Communicator(ctx.rank, ctx.world_size)
    spec = HaloSpec((torch.empty(0, dtype=torch.long),), (0,), 5)
    h = torch.randn(5, 3)
    ext = comm.halo_forward(h, spec)
    g = torch.randn(5, 3)
    return dict(same=ext.untyped_storage().data_ptr() == h.untyped_storage().data_ptr() and torch.equal(ext, h),
                grad_same=comm.halo_backward(g, spec) is not None and
                comm.halo_backward(g, spec).untyped_storage().data_ptr() == g.untyped_storage().data_ptr())


def test_a_rank_without_halo_rows_gets_its_value_not_a_copy() -> None:
    """One rank alone (the single-device plan's halo exchanges): the exchange hands back the value
    and the gradient themselves, as the cost model assumes (no allocation)."""
    (o,) = launch(_lone_halo_worker, 1, timeout=60)
    assert o["same"] and o["grad_same"]


def _send_recv_worker(ctx: RankContext) -> dict:
    comm = Communicator(ctx.rank, ctx.world_size)
    if ctx.rank == 0:
        comm.send(torch.arange(6, dtype=torch.float32).reshape(2, 3), peer=1)
        got = comm.recv((1,), torch.int64, peer=1)
    else:
        got = comm.recv((2, 3), torch.float32, peer=0)
        comm.send(torch.tensor([7]), peer=0)
    return dict(got=got, stats=comm.stats.as_dict())


def test_send_recv_counts_bytes() -> None:
    a, b = launch(_send_recv_worker, 2, timeout=60)
    assert a["got"].tolist() == [7]
    assert b["got"].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
    assert a["stats"]["sent"]["train"] == {1: 24} and a["stats"]["received"]["train"] == {1: 8}
    assert b["stats"]["sent"]["train"] == {0: 8} and b["stats"]["received"]["train"] == {0: 24}


def _crossing_worker(ctx: RankContext) -> dict:
    """Both ranks send to the other first, then receive, through a group per direction."""
    comm = Communicator(ctx.rank, ctx.world_size)
    comm.directional_groups([(0, 1), (1, 0), (0, 2)])   # (rank 1 is not in the last: it gets none)
    peer = 1 - ctx.rank if ctx.rank < 2 else 0
    if ctx.rank == 2:
        return {"keys": sorted(comm.p2p), "got": comm.recv((3,), torch.float32, 0)}
    work = comm.isend(torch.full((3,), float(ctx.rank)), peer)
    got = comm.recv((3,), torch.float32, peer)
    work.wait()
    if ctx.rank == 0:
        comm.send(torch.full((3,), 7.0), 2)
    return {"keys": sorted(comm.p2p), "got": got}


def test_directional_groups_carry_each_direction() -> None:
    a, b, c = launch(_crossing_worker, 3, timeout=60)
    assert a["keys"] == [(0, 1), (0, 2), (1, 0)] and b["keys"] == [(0, 1), (1, 0)] and c["keys"] == [(0, 2)]
    assert a["got"].tolist() == [1.0] * 3 and b["got"].tolist() == [0.0] * 3 and c["got"].tolist() == [7.0] * 3


# --------------------------------------------------------------------------- waiting by polling
class _FakeWork:
    """A work handle that completes after ``polls`` calls of ``is_completed`` (never: ``None``)."""

    def __init__(self, polls) -> None:
        self.polls, self.checked, self.waited = polls, 0, False

    def is_completed(self) -> bool:
        self.checked += 1
        return self.polls is not None and self.checked > self.polls

    def wait(self) -> bool:
        self.waited = True
        return True


def test_complete_polls_until_the_work_completes_then_waits(monkeypatch) -> None:
    from gnncompile.runtime import comm

    monkeypatch.setattr(comm, "POLL_SECONDS", 60.0)  # a loaded machine must not end the loop first
    w = _FakeWork(polls=5)
    comm.complete(w, poll=True)
    assert w.checked == 6 and w.waited
    sleeping = _FakeWork(polls=5)
    comm.complete(sleeping)  # without poll: straight to the library's wait
    assert sleeping.checked == 0 and sleeping.waited


def test_complete_stops_polling_after_poll_seconds(monkeypatch) -> None:
    import time

    from gnncompile.runtime import comm

    monkeypatch.setattr(comm, "POLL_SECONDS", 0.02)
    w = _FakeWork(polls=None)  # a peer that never answers: the library's wait (and its timeout) takes over
    t0 = time.perf_counter()
    comm.complete(w, poll=True)
    assert w.waited and 0.02 <= time.perf_counter() - t0 < 1.0 and w.checked > 1


def test_ranks_poll_on_cpu_gloo_only() -> None:
    from gnncompile.runtime.comm import polls_by_default

    assert polls_by_default("gloo", torch.device("cpu"))
    assert not polls_by_default("nccl", torch.device("cuda", 0))
    assert not polls_by_default("gloo", torch.device("cuda", 0))


def _polling_worker(ctx: RankContext) -> dict:
    comm = Communicator(ctx.rank, ctx.world_size, poll=True)
    n = sum(ROWS)
    x = _global(3, n, 2)
    r = offsets(ROWS)
    rows = x[r[ctx.rank]:r[ctx.rank + 1]]
    back = cols_to_rows(rows_to_cols(rows, comm, ROWS, (1, 1, 0)), comm, ROWS, (1, 1, 0))
    total = comm.sum_(torch.full((3,), float(ctx.rank + 1), dtype=torch.float64))
    if ctx.rank == 0:
        comm.send(torch.arange(4.0), 1)
        got = None
    elif ctx.rank == 1:
        got = comm.recv((4,), torch.float32, 0)
    else:
        got = None
    return dict(round_trip=torch.equal(back, rows), total=total.tolist(), got=None if got is None else got.tolist())


def test_a_polling_communicator_gives_the_same_results() -> None:
    out = launch(_polling_worker, 3, backend="gloo", timeout=60)
    assert all(o["round_trip"] for o in out)
    assert all(o["total"] == [6.0, 6.0, 6.0] for o in out)
    assert out[1]["got"] == [0.0, 1.0, 2.0, 3.0]


def _crossing_sends(plan) -> list[tuple[int, int]]:
    """Pairs of ranks that reach a point where each one's next message with the other is a send
    (the messages of a pair matched in program order, as they are)."""
    from gnncompile.ir.plan import Recv, Send

    progs = [p.instructions for p in plan.program]
    out = []
    for a in range(len(progs)):
        for b in range(a + 1, len(progs)):
            qa = [isinstance(i, Send) for i in progs[a] if isinstance(i, (Send, Recv)) and i.peer == b]
            qb = [isinstance(i, Send) for i in progs[b] if isinstance(i, (Send, Recv)) and i.peer == a]
            if any(x and y for x, y in zip(qa, qb)):
                out.append((a, b))
    return out


@pytest.mark.parametrize("strategy,options", [("mop", {"chunks": 2, "reorder": "rcm"}), ("task", {})])
def test_directional_groups_run_plans_whose_ranks_send_to_each_other_first(
        strategy: str, options: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """In these plans two ranks each send to the other before receiving from it. Under NCCL a
    pair's messages in one group run in order on one stream, so they would wait on each other once
    messages outgrow NCCL's buffers: the ranks send through a group per direction there
    (``directional_p2p``). Forced on gloo, the same code path is exact and equals the shared group."""
    import gnncompile as gc
    from gnncompile.runtime.executor import p2p_pairs
    from gnncompile.testing import check_plan

    g = gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=5, num_features=6, num_classes=3, seed=1)
    g = g.replace(x=g.x.double())
    torch.manual_seed(0)
    model = gc.nn.GCN(6, 16, 3, num_layers=3, dropout=0.0).double()
    plan = gc.plan(model, g, gpus=2, strategy=strategy, **options)
    assert _crossing_sends(plan) == [(0, 1)]   # the hazard is there
    assert {(0, 1), (1, 0)} <= set(p2p_pairs(plan.program))
    shared = check_plan(model, g, 2, strategy=strategy, rtol=1e-9, atol=1e-11, timeout=60, **options)
    monkeypatch.setenv("GNNCOMPILE_P2P_GROUPS", "directional")
    directional = check_plan(model, g, 2, strategy=strategy, rtol=1e-9, atol=1e-11, timeout=60, **options)
    assert directional.history.loss == shared.history.loss
    assert [r.bytes_sent for r in directional.ranks] == [r.bytes_sent for r in shared.ranks]
    monkeypatch.setenv("GNNCOMPILE_P2P_GROUPS", "sideways")
    with pytest.raises(gc.ArgumentError, match="GNNCOMPILE_P2P_GROUPS"):
        plan.run(1, progress=False)
