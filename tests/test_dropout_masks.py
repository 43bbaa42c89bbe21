"""Counter-based dropout masks (kernels.dropout): the generator, its two implementations, rows of a
mask, and how dropout_noise / plan_dropout_draws use it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile.errors import KernelError
from gnncompile.frontend import ops as fops
from gnncompile.kernels import available_backends
from gnncompile.kernels.dropout import dropout_mask, keep_threshold, philox4x32
from gnncompile.testing import count_host_syncs

NATIVE = "native" in available_backends("cpu")
needs_native = pytest.mark.skipif(not NATIVE, reason="the native CPU extension did not build here")

# Random123's known-answer vectors for Philox4x32-10: counter, key, output
KAT = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers_torch(counter, key, expected) -> None:
    assert philox4x32(counter, key) == expected


@needs_native
@pytest.mark.parametrize("counter,key,expected", KAT)
def test_philox_known_answers_native(counter, key, expected) -> None:
    assert philox4x32(counter, key, native=True) == expected


def test_mask_follows_the_documented_rule() -> None:
    """Element k of the mask is word k mod 4 of Philox(counter (k div 4, 0), key = the seed's halves)
    compared with floor(p 2^32)."""
    seed, p, rows, width = 0x0123456789ABCDEF, 0.4, 5, 3
    mask = dropout_mask(seed, p, rows, (width,), native=False).reshape(-1)
    key = [seed & 0xFFFFFFFF, seed >> 32]
    for k in range(rows * width):
        block = k // 4
        word = philox4x32([block & 0xFFFFFFFF, block >> 32, 0, 0], key)[k % 4]
        assert float(mask[k]) == (pytest.approx(1 / (1 - p)) if word >= keep_threshold(p) else 0.0)


@needs_native
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**64 - 1), p=st.floats(0.0, 0.99), num_rows=st.integers(0, 300),
       row_shape=st.lists(st.integers(0, 9), max_size=2), data=st.data())
def test_native_equals_torch_for_whole_masks_and_rows(seed, p, num_rows, row_shape, data) -> None:
    whole = dropout_mask(seed, p, num_rows, row_shape, native=True)
    assert torch.equal(whole, dropout_mask(seed, p, num_rows, row_shape, native=False))
    assert whole.shape == (num_rows, *row_shape)
    if num_rows:
        picks = data.draw(st.lists(st.integers(0, num_rows - 1), max_size=60))  # repeats and any order
        rows = torch.tensor(picks, dtype=torch.int64)
        for native in (True, False):
            assert torch.equal(dropout_mask(seed, p, num_rows, row_shape, rows=rows, native=native), whole[rows])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_dtypes_and_scale(dtype) -> None:
    a = dropout_mask(99, 0.3, 200, (5,), dtype=dtype, native=True)
    assert a.dtype == dtype and torch.equal(a, dropout_mask(99, 0.3, 200, (5,), dtype=dtype, native=False))
    scale = torch.tensor(1 / 0.7, dtype=torch.float64).to(dtype)
    assert set(a.unique().tolist()) == {0.0, float(scale)}


@needs_native
def test_independent_of_the_thread_count() -> None:
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = dropout_mask(5, 0.5, 70_000, (16,))
        rows = torch.randperm(70_000)[:9000]
        one_rows = dropout_mask(5, 0.5, 70_000, (16,), rows=rows)
        torch.set_num_threads(2)
        assert torch.equal(one, dropout_mask(5, 0.5, 70_000, (16,)))
        assert torch.equal(one_rows, dropout_mask(5, 0.5, 70_000, (16,), rows=rows))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_and_independence(p) -> None:
    n = 400_000
    mask = dropout_mask(2024, p, n, ()) != 0
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(mask.float().mean().item() - (1 - p)) < 5 * sigma
    # neighbouring elements (the four words of a block, and across blocks) are uncorrelated
    a, b = mask[:-1].float(), mask[1:].float()
    both = (a * b).mean().item()
    assert abs(both - (1 - p) ** 2) < 5 * (((1 - p) ** 2 * (1 - (1 - p) ** 2)) / n) ** 0.5
    # another seed gives another mask
    assert not torch.equal(mask, dropout_mask(2025, p, n, ()) != 0)


def test_errors() -> None:
    with pytest.raises(gc.KernelError, match="p must be in"):
        dropout_mask(0, 1.0, 3)
    with pytest.raises(gc.KernelError, match="rows must be in"):
        dropout_mask(0, 0.5, 3, (2,), rows=torch.tensor([0, 3]))
    with pytest.raises(gc.KernelError, match="1-d integer"):
        dropout_mask(0, 0.5, 3, (2,), rows=torch.tensor([0.0]))
    with pytest.raises(gc.KernelError, match="seed"):
        dropout_mask(-1, 0.5, 3)
    with pytest.raises(gc.KernelError, match="non-negative"):
        dropout_mask(0, 0.5, -1)
    with pytest.raises(gc.KernelError, match="native kernel"):
        dropout_mask(0, 0.5, 3, dtype=torch.int32, native=True)


def test_dropout_noise_draws_one_seed_from_torch() -> None:
    x = torch.randn(40, 3, 2)
    torch.manual_seed(3)
    a = fops.dropout_noise(x, 0.25)
    b = fops.dropout_noise(x, 0.25)
    torch.manual_seed(3)
    seed = fops.draw_mask_seed()
    assert torch.equal(a, dropout_mask(seed, 0.25, 40, (3, 2)))
    assert not torch.equal(a, b)  # the generator moved on
    assert fops.dropout_noise(torch.randn(()), 0.5).shape == ()


def test_plan_dropout_draws_matches_dropout_rows() -> None:
    """Under plan_dropout_draws, F.dropout of a whole tensor and dropout_rows of some of its rows see
    the same mask for the same seed (what makes a rank's masks the single-device ones)."""
    x = torch.randn(30, 4)
    torch.manual_seed(8)
    with fops.plan_dropout_draws():
        whole = F.dropout(x, 0.5)
    index = torch.tensor([3, 4, 5, 17, 29])
    torch.manual_seed(8)
    rows = fops.dropout_rows(x[index], 0.5, index, 30)
    assert torch.equal(rows, whole[index])


@needs_native
@pytest.mark.parametrize("width", [1, 3, 16, 20, 64, 100])
def test_rows_mixing_runs_and_scattered_rows(width) -> None:
    """Runs of consecutive rows (generated as one range of elements when they fill a batch) mixed
    with scattered and repeated rows (generated through the queue of blocks) give the whole mask's rows."""
    rows = torch.tensor([3, 4, 5, 6, 10, 11, *range(50, 81), 2, 2, 199, 0, 1, *range(120, 124)])
    whole = dropout_mask(77, 0.4, 200, (width,), native=True)
    for dtype in (torch.float32, torch.bool):
        got = dropout_mask(77, 0.4, 200, (width,), rows=rows, dtype=dtype, native=True)
        assert torch.equal(got, (whole[rows] != 0) if dtype == torch.bool else whole[rows])


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_foreign_checkpoint_is_refused_under_plan_draws(reentrant: bool) -> None:
    """torch's checkpoint replays its forward in backward without torch function modes: a redirected
    F.dropout inside one would draw other masks there (wrong gradients), so it is refused; outside a
    checkpoint the redirection draws dropout_noise's mask."""
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(20, 3, requires_grad=True)
    with fops.plan_dropout_draws():
        with pytest.raises(gc.KernelError, match="inside torch.utils.checkpoint"):
            checkpoint(lambda t: F.dropout(t, 0.5), x, use_reentrant=reentrant)
        torch.manual_seed(4)
        y = F.dropout(x, 0.5)
    torch.manual_seed(4)
    assert torch.equal(y, x * fops.dropout_noise(x, 0.5))


def _dropout_chain(replay: bool, layers: int = 3) -> tuple[list[torch.Tensor], int, int]:
    """``layers`` x (relu, replicated dropout, linear) on 2000 x 64 float32, forward under
    :func:`fops.replay_dropout_outputs` (or hooks that keep what autograd saves as it is): the
    gradients, the peak of live tensor bytes of the forward and the bytes of one activation."""
    from gnncompile.runtime.memory import PeakMemory

    torch.manual_seed(0)
    n, d = 2000, 64
    h = torch.randn(n, d, requires_grad=True)
    lins = [torch.nn.Linear(d, d) for _ in range(layers)]
    index = torch.arange(n)
    torch.manual_seed(1)
    hooks = fops.replay_dropout_outputs() if replay else torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                                                  lambda t: t)
    with PeakMemory("cpu") as peak, hooks:
        x = h * 1.0
        for lin in lins:
            x = lin(fops.dropout_rows(torch.relu(x), 0.5, index, n, replay=True))
    x.square().sum().backward()
    grads = [h.grad] + [p.grad for lin in lins for p in lin.parameters()]
    return grads, peak.peak_bytes, n * d * 4


def test_a_replayed_dropout_output_gives_the_same_gradients_and_is_not_held() -> None:
    """Under ``replay_dropout_outputs`` a linear layer after ``dropout(relu(x))`` saves the dropout's
    input and mask (held anyway by ``relu`` and the dropout) instead of its output, computed again in
    backward: the gradients are bit for bit those of keeping it, and the forward of three such
    layers holds two fewer activations."""
    kept, peak_kept, act = _dropout_chain(replay=False)
    replayed, peak_replayed, _ = _dropout_chain(replay=True)
    for a, b in zip(kept, replayed):
        assert torch.equal(a, b)
    assert peak_kept - peak_replayed >= 1.9 * act


def test_a_dropout_output_changed_in_place_is_saved_as_it_is() -> None:
    """An in-place change of the dropout's output before it is saved makes a replay wrong: the
    output is then saved itself; an in-place change of its input after it was saved is refused
    in backward, as autograd refuses a changed saved tensor."""
    torch.manual_seed(0)
    x = torch.randn(50, 8, requires_grad=True)
    lin = torch.nn.Linear(8, 4)
    index = torch.arange(50)
    with fops.replay_dropout_outputs():
        d = fops.dropout_rows(x * 1.0, 0.5, index, 50, replay=True)
        d.add_(1.0)
        y = lin(d)
    y.sum().backward()
    torch.testing.assert_close(lin.weight.grad, d.detach().sum(0).expand(4, 8))  # the changed output's
    with fops.replay_dropout_outputs():
        r = torch.relu(x * 1.0)
        y = lin(fops.dropout_rows(r, 0.5, index, 50, replay=True))
    r.mul_(2.0)
    with pytest.raises((KernelError, RuntimeError), match="modified"):
        y.sum().backward()


def test_a_plan_from_statistics_replicates_its_dropouts_and_replays_them() -> None:
    """A plan from statistics lowers dropout as a runnable plan does (replicated masks): its
    predicted memory is what a run holds, the linear layer after a hidden dropout holding nothing
    for backward beside what ``relu`` and the dropout hold."""
    stats = gc.GraphStats(num_nodes=100_000, num_edges=1_000_000, num_features=32, num_classes=4)
    plan = gc.plan(gc.nn.GCN(32, 16, 4, num_layers=3, dropout=0.5), stats, "1xA100", strategy="data")
    ops_ = [op for st in plan.ranks[0].stages for op in st.costs]
    names = [op.name for op in ops_]
    assert "dropout_rows" in names and not any(n == "dropout" or n.startswith("dropout_") and
                                                not n.startswith("dropout_rows") for n in names)
    lins = [op for k, op in enumerate(ops_) if k and ops_[k - 1].name.startswith("dropout_rows")]
    assert len(lins) == 2
    for op in lins:
        assert op.saved.v == 0 and op.replayed.v == 16 * 4


def test_replicated_dropouts_replay_only_where_their_input_is_held() -> None:
    """``replicate_dropout_masks`` sets ``replay`` on a dropout whose input another op saves anyway
    (GCN: ``relu``'s output) or that is a model input; GAT's hidden dropout reads ``elu``'s output,
    which ``elu`` does not save (it saves its input): holding it instead of the dropout's output
    would hold as much, so that dropout does not replay."""
    from gnncompile.passes.dropout import replicate_dropout_masks

    g = gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=4, num_features=8, num_classes=3, seed=0)
    for net, expected in ((gc.nn.GCN(8, 16, 3, num_layers=3), [True, True]),
                          (gc.nn.GAT(8, 4, 3, heads=2, num_layers=2), [True, False])):
        tp = replicate_dropout_masks(gc.trace(net, g, training=True), graph=g)
        # the dropouts of vertex rows in order (GAT's attention dropouts are of edge rows)
        flags = [bool(n.kwargs.get("replay")) for n in tp.graph.nodes
                 if n.target is fops.dropout_rows and n.args[0].meta["tp"].space == "V"]
        assert flags == expected, (type(net).__name__, flags)


def test_views_of_a_replayed_output_replay_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """GAT's propagation saves slices of its attention coefficients (the edges' and the self
    loops'): views of a replayed dropout output replay too, from one recomputation of the output,
    with the gradients of keeping it."""
    g = gc.datasets.synthetic("sbm", num_nodes=200, avg_degree=6, num_features=8, num_classes=3, seed=0)
    rows = g.num_edges + g.num_nodes
    torch.manual_seed(0)
    h = torch.randn(200, 4, 4, requires_grad=True)
    e = torch.randn(rows, 4, requires_grad=True)
    calls = []
    real = fops.keep_times
    monkeypatch.setattr(fops, "keep_times", lambda *a: calls.append(1) or real(*a))

    def run(replay: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        h.grad = e.grad = None
        calls.clear()
        torch.manual_seed(1)
        with fops.replay_dropout_outputs():
            alpha = fops.edge_softmax(g, e, add_self_loops=True)
            d = fops.dropout_rows(alpha, 0.5, torch.arange(rows), rows, replay=replay)
            out = fops.propagate(g, h, "none", edge_weight=d, add_self_loops=True)
        del d
        out.square().sum().backward()
        return h.grad.clone(), e.grad.clone(), len(calls)

    h_kept, e_kept, n_kept = run(False)
    h_rep, e_rep, n_rep = run(True)
    assert torch.equal(h_kept, h_rep) and torch.equal(e_kept, e_rep)
    assert n_rep == n_kept + 1  # (forward and the dropout's backward) and one replay for both slices


def test_rows_bounds_are_checked_once_per_tensor_version() -> None:
    """A row tensor is checked the first time (reading its bounds: a host synchronization on a GPU),
    not again while unchanged, and again after an in-place change."""
    rows = torch.tensor([0, 3, 5])
    dropout_mask(7, 0.5, 6, (4,), rows=rows)
    with count_host_syncs() as syncs:
        dropout_mask(7, 0.5, 6, (4,), rows=rows, native=False)
    assert not [s for s in syncs if "scalar" in s.op or "tolist" in s.op], syncs.report()
    with pytest.raises(KernelError, match=r"rows must be in \[0, 5\)"):
        dropout_mask(7, 0.5, 5, (4,), rows=rows)  # another row count: checked again
    rows[1] = 9
    with pytest.raises(KernelError, match=r"rows must be in \[0, 6\)"):
        dropout_mask(7, 0.5, 6, (4,), rows=rows)


class _Noisy(torch.nn.Module):
    """A propagation, then random numbers of another kind than F.dropout's masks."""

    def __init__(self, fin: int, fout: int, how: str) -> None:
        super().__init__()
        self.l1, self.l2, self.how = torch.nn.Linear(fin, 8), torch.nn.Linear(8, fout), how
        self.drop1d = torch.nn.Dropout1d(0.3)

    def forward(self, g, x):
        h = gc.ops.propagate(g, self.l1(x), norm="gcn")
        if self.how == "noise":
            h = h + 0.1 * torch.randn_like(h)
        elif self.how == "hand_mask":
            h = h * (torch.rand_like(h) > 0.3)
        elif self.how == "alpha":
            h = F.alpha_dropout(h, 0.3, training=self.training)
        elif self.how == "module":
            h = self.drop1d(h)
        elif self.how == "aten_alpha":  # ATen's form of F.alpha_dropout
            h = torch.alpha_dropout(h, 0.3, self.training)
        elif self.how == "gumbel":
            h = F.gumbel_softmax(h, tau=1.0)
        elif self.how == "multinomial":
            h = h * torch.softmax(h, -1).multinomial(1).to(h.dtype)
        else:  # draws nothing as called: not refused
            h = F.rrelu(F.dropout(h, 0.3, training=False))
        return self.l2(h)


@pytest.mark.parametrize("how", ["noise", "hand_mask", "alpha", "module", "aten_alpha", "gumbel", "multinomial"])
def test_random_draws_that_are_not_replicated_are_refused_under_exact(how: str) -> None:
    """Ranks seeded alike (dropout='replicated') drew the same noise for different rows: plans
    labelled exact lost 6e-4 to 1e-2 of loss against gc.train. dropout='local' (a stream per rank)
    and semantics='relaxed' (recorded) are the ways through."""
    g = gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=6, num_features=8, num_classes=3, seed=0)
    model = _Noisy(8, 3, how)
    for strategy in ("data", "tensor", "task", "layer"):
        with pytest.raises(gc.PlanningError, match=rf"strategy {strategy!r} is not exact for this model: \w+ draw\(s\) "
                                                   r"random numbers that dropout='replicated' does not replicate"):
            gc.plan(model, g, gpus=2, strategy=strategy)
    assert gc.plan(model, g, gpus=2, strategy="data", dropout="local").relaxations == ()
    relaxed = gc.plan(model, g, gpus=2, strategy="data", semantics="relaxed")
    assert any(r.startswith("unreplicated random draws") for r in relaxed.relaxations)
    assert gc.plan(model, g, gpus=1, strategy="data").relaxations == ()  # one rank draws as gc.train does


class _AtenAndCertainDropouts(torch.nn.Module):
    """``torch.dropout`` (ATen's form of ``F.dropout``, in place too) and ``p=1`` (drops everything,
    draws nothing)."""

    def __init__(self, fin: int, fout: int) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(fin, 8), torch.nn.Linear(8, fout)

    def forward(self, g, x):
        h = F.relu(gc.ops.propagate(g, self.l1(x), norm="gcn"))
        h = torch.dropout(h, 0.5, self.training) + torch.dropout_(h * 2.0, 0.3, self.training)
        return self.l2(h) + F.dropout(self.l2(h), 1.0, self.training)


def test_aten_dropout_is_replicated_and_p_one_draws_nothing() -> None:
    """torch.dropout drew from each rank's copy of one stream under an exact label (ranks dropped
    the same entries of different rows); F.dropout(h, 1.0) planned, then every rank failed."""
    from gnncompile.testing import check_plan

    g = gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=6, num_features=8, num_classes=3, seed=0)
    torch.manual_seed(0)
    model = _AtenAndCertainDropouts(8, 3).double()
    g = g.replace(x=g.x.double())
    res = check_plan(model, g, 2, strategy="data", device="cpu", timeout=120)
    assert res.plan.semantics == "exact" and res.plan.relaxations == ()


def test_ops_that_draw_nothing_as_called_are_not_refused() -> None:
    g = gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=6, num_features=8, num_classes=3, seed=0)
    assert gc.plan(_Noisy(8, 3, "none"), g, gpus=2, strategy="data").relaxations == ()


class _DropsOutInEvaluation(torch.nn.Module):
    """F.dropout without training=: it drops out in eval mode too (a common slip)."""

    def __init__(self, fin: int, fout: int) -> None:
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(fin, 8), torch.nn.Linear(8, fout)

    def forward(self, g, x):
        return self.l2(F.dropout(F.relu(gc.ops.propagate(g, self.l1(x), norm="gcn")), 0.5))


def test_dropout_in_evaluation_is_refused_under_exact() -> None:
    """Ranks evaluated with their own streams (validation accuracies unlike gc.train's, and the
    training masks after the first evaluation too) under an exact label."""
    g = gc.datasets.synthetic("sbm", num_nodes=120, avg_degree=6, num_features=8, num_classes=3, seed=0)
    model = _DropsOutInEvaluation(8, 3)
    for strategy in ("data", "tensor", "task", "layer"):
        with pytest.raises(gc.PlanningError, match=rf"strategy {strategy!r} is not exact for this model: dropout "
                                                   r"draw\(s\) random numbers in eval mode too.*training=self\.training"):
            gc.plan(model, g, gpus=2, strategy=strategy)
    relaxed = gc.plan(model, g, gpus=2, strategy="data", semantics="relaxed")
    assert any(r.startswith("random draws in evaluation (dropout)") for r in relaxed.relaxations)
