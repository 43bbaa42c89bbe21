"""Sampled mini-batch training: models bound to per-layer blocks (`frontend.blocks`), `ops.dst_rows`
and the single-device mini-batch reference (`gc.train(..., batch_size=, fanouts=)`)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import gnncompile as gc
from gnncompile import ops
from gnncompile.errors import KernelError, TraceError
from gnncompile.frontend.blocks import BlockModel, bind_blocks, block_input_names, value_depths
from gnncompile.graph.minibatch import batch_generator, epoch_order
from gnncompile.graph.sampling import sample_blocks
from gnncompile.graph.shard import build_shards
from graph_strategies import DT, labelled, sbm_graph, seeded_model, small_graphs

ALL_NORMS = [("gcn", False), ("gcn", True), ("mean", False), ("mean", True), ("sum", False), ("sum", True)]

#: models whose propagation coefficients depend only on the destinations' in-edges: with fanout -1
#: a block computes exactly the whole graph's outputs at its seeds
DST_NORMALIZED = {
    "sage": lambda f, c: gc.nn.GraphSAGE(f, 6, c, num_layers=2),
    "gin": lambda f, c: gc.nn.GIN(f, 6, c, num_layers=2),
    "gat": lambda f, c: gc.nn.GAT(f, 3, c, heads=2, num_layers=2),
    "sage3": lambda f, c: gc.nn.GraphSAGE(f, 5, c, num_layers=3),
}
#: GCN normalization reads the sources' out-degrees: equal to the whole graph's when every vertex is a seed
GCN_NORMALIZED = {
    "gcn": lambda f, c: gc.nn.GCN(f, 6, c, num_layers=2),
    "gcnii": lambda f, c: gc.nn.GCNII(f, 6, c, num_layers=3),
    "appnp": lambda f, c: gc.nn.APPNP(f, 6, c, num_layers=2, K=3),
}


def _outputs_and_grads(model: torch.nn.Module, fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = fn()
    out.pow(2).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _check_blocks_equal_graph(make, g: gc.Graph, seeds: torch.Tensor) -> None:
    model = seeded_model(make, g).eval()
    bound = BlockModel.trace(model, g)
    batch = sample_blocks(g, seeds, [-1] * bound.num_layers, seed=0, norms=ALL_NORMS)
    out, grads = _outputs_and_grads(model, lambda: bound(batch.blocks, g.x[batch.input_ids]))
    ref, ref_grads = _outputs_and_grads(model, lambda: model(g, g.x)[seeds])
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    assert ref_grads.keys() == grads.keys()
    for n in ref_grads:
        torch.testing.assert_close(grads[n], ref_grads[n], rtol=1e-9, atol=1e-11, msg=n)


@settings(max_examples=25, deadline=None)
@given(g=small_graphs(), name=st.sampled_from(sorted(DST_NORMALIZED)), data=st.data())
def test_full_fanout_blocks_compute_the_graphs_outputs_and_gradients_at_the_seeds(g, name, data):
    g = labelled(g)
    k = data.draw(st.integers(1, g.num_nodes), label="seeds")
    seeds = torch.randperm(g.num_nodes, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 9))))[:k]
    _check_blocks_equal_graph(DST_NORMALIZED[name], g, seeds)


@pytest.mark.parametrize("name", sorted(GCN_NORMALIZED))
def test_gcn_normalized_models_on_full_blocks_over_every_vertex_equal_the_graph(name):
    g = sbm_graph(40)
    _check_blocks_equal_graph(GCN_NORMALIZED[name], g, torch.randperm(40, generator=torch.Generator().manual_seed(3)))


def test_sampled_sage_layer_is_the_mean_over_the_sampled_in_edges_plus_the_root_term():
    g = sbm_graph(60)
    model = seeded_model(lambda f, c: gc.nn.GraphSAGE(f, 4, c, num_layers=1), g).eval()
    conv = model.convs[0]
    bound = BlockModel.trace(model, g)
    seeds = torch.tensor([5, 17, 3, 42])
    batch = sample_blocks(g, seeds, [2], seed=7, norms=bound.norms)
    out = bound(batch.blocks, g.x[batch.input_ids])
    src = g.indices[batch.edge_ids[0]]
    dst_of = torch.repeat_interleave(torch.arange(4), batch.blocks[0].indptr.diff())
    expected = []
    for j, v in enumerate(seeds.tolist()):
        nb = src[dst_of == j]
        mean = g.x[nb].mean(0) if nb.numel() else torch.zeros(g.num_features, dtype=DT)
        expected.append(conv.lin_l(mean) + conv.lin_r(g.x[v]))
    torch.testing.assert_close(out, torch.stack(expected), rtol=1e-10, atol=1e-12)


def test_binding_gives_one_graph_input_per_layer_and_restricts_x0_to_each_layers_destinations():
    g = sbm_graph(30)
    model = seeded_model(lambda f, c: gc.nn.GCNII(f, 4, c, num_layers=3), g)
    tp = gc.trace(model, g, training=False)
    bound = bind_blocks(tp)
    assert block_input_names(bound) == ("g_0", "g_1", "g_2")
    placeholders = [n.name for n in bound.graph.nodes if n.op == "placeholder"]
    assert placeholders[:3] == ["g_0", "g_1", "g_2"]
    restrictions = [n for n in bound.graph.nodes if n.op == "call_function" and n.target is ops.dst_rows]
    # GCNII combines (alpha times) x0, at depth 0, with every layer's output: each layer restricts
    # a depth-0 value to its destinations; nothing is restricted to a depth it already has
    depths = value_depths(tp)
    restricted = {(n.args[1].name, n.meta["tp"].layer) for n in restrictions}
    assert {k for v, k in restricted if depths[v] == 0} == {1, 2, 3}
    assert all(depths[v] < k for v, k in restricted)
    # every graph op reads the block of its layer
    for n in bound.graph.nodes:
        if n.op == "call_function" and ops.is_primitive(n.target):
            assert n.args[0].name == f"g_{n.meta['tp'].layer - 1}"
    with pytest.raises(TraceError, match="bind each mode"):
        bind_blocks(gc.trace(gc.nn.GAT(6, 2, 3, heads=1, dropout=0.5), g))


def test_binding_refuses_a_model_without_propagation_and_a_wrong_number_of_blocks():
    g = sbm_graph(20)

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(g.num_features, 3).to(DT)

        def forward(self, g, x):
            return self.lin(x)

    with pytest.raises(TraceError, match="no propagation"):
        bind_blocks(gc.trace(MLP(), g, training=True))
    bound = BlockModel.trace(seeded_model(lambda f, c: gc.nn.GCN(f, 4, c, num_layers=2), g), g)
    batch = sample_blocks(g, torch.arange(5), [3], seed=0, norms=bound.norms)
    with pytest.raises(TraceError, match="2 layers but the mini-batch has 1 blocks"):
        bound(batch.blocks, g.x[batch.input_ids])


def test_dst_rows_on_whole_graphs_local_graphs_and_blocks():
    g = sbm_graph(20)
    x = torch.randn(20, 3, dtype=DT)
    assert ops.dst_rows(g, x) is x
    shard = build_shards(g, torch.arange(20) % 2, 2)[1]
    lg = shard.graph
    xs = torch.randn(lg.num_src, 3, dtype=DT)
    assert torch.equal(ops.dst_rows(lg, xs), xs[lg.own_offset: lg.own_offset + lg.num_nodes])
    batch = sample_blocks(g, torch.tensor([4, 9]), [2, 2], seed=1)
    wide = torch.randn(batch.blocks[0].num_src, 3, dtype=DT)
    assert torch.equal(ops.dst_rows(batch.blocks[1], wide), wide[:2])  # an earlier layer's rows
    with pytest.raises(KernelError, match="dst_rows: x has 1 rows"):
        ops.dst_rows(batch.blocks[1], wide[:1])


def _mb_graph() -> gc.Graph:
    g = gc.datasets.synthetic("sbm", num_nodes=300, avg_degree=8, num_features=16, num_classes=4, seed=2)
    return g


def test_minibatch_training_is_reproducible_and_learns():
    g = _mb_graph()
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = gc.nn.GraphSAGE(g.num_features, 16, g.num_classes, num_layers=2)
        runs.append(gc.train(model, g, epochs=8, lr=0.02, batch_size=32, fanouts=[4, 3], verbose=False))
    assert runs[0].loss == runs[1].loss and runs[0].val_acc == runs[1].val_acc
    h = runs[0]
    assert len(h.loss) == 8 and h.loss[-1] < h.loss[0]
    assert h.best_val_acc > 1.5 / g.num_classes  # well above chance on a 4-class SBM
    torch.manual_seed(0)
    other = gc.train(gc.nn.GraphSAGE(g.num_features, 16, g.num_classes, num_layers=2), g, epochs=2, lr=0.02,
                     batch_size=32, fanouts=[4, 3], seed=1, verbose=False)
    assert other.loss[:2] != h.loss[:2]


def test_minibatch_step_is_the_mean_loss_over_the_batch_on_its_blocks():
    """One epoch with one batch holding every training vertex equals a hand-written step."""
    g = _mb_graph()
    n_train = int(g.train_mask.sum())
    torch.manual_seed(0)
    model = gc.nn.GCN(g.num_features, 8, g.num_classes, num_layers=2, dropout=0.0)
    ref = gc.nn.GCN(g.num_features, 8, g.num_classes, num_layers=2, dropout=0.0)
    ref.load_state_dict(model.state_dict())
    h = gc.train(model, g, epochs=1, lr=0.05, weight_decay=0.0, batch_size=n_train, fanouts=[3, 2], seed=5,
                 verbose=False)
    targets = torch.nonzero(g.train_mask).flatten()
    seeds = epoch_order(targets, 5, 0)
    assert sorted(seeds.tolist()) == targets.tolist()
    bound = BlockModel.trace(ref, g)
    batch = sample_blocks(g, seeds, [3, 2], generator=batch_generator(5, 0, 0), norms=bound.norms)
    ref.train()
    loss = F.cross_entropy(bound(batch.blocks, g.x[batch.input_ids]), g.y[seeds])
    opt = torch.optim.Adam(ref.parameters(), lr=0.05, weight_decay=0.0)
    loss.backward()
    opt.step()
    assert math.isclose(h.loss[0], float(loss.detach()), rel_tol=1e-6)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=n)


def test_minibatch_sampled_evaluation_and_argument_errors():
    g = _mb_graph()
    torch.manual_seed(0)
    model = gc.nn.GAT(g.num_features, 4, g.num_classes, heads=2, num_layers=2, dropout=0.2)
    h = gc.train(model, g, epochs=2, batch_size=64, fanouts=[3, 3], eval_fanouts=[5, 5], verbose=False)
    assert all(0.0 <= a <= 1.0 for a in h.val_acc + h.test_acc)
    with pytest.raises(ValueError, match="needs fanouts"):
        gc.train(model, g, epochs=1, batch_size=8)
    with pytest.raises(ValueError, match="need batch_size"):
        gc.train(model, g, epochs=1, fanouts=[2, 2])
    with pytest.raises(ValueError, match="fanouts has 3 entries but GAT has 2 GNN layers"):
        gc.train(model, g, epochs=1, batch_size=8, fanouts=[2, 2, 2])
    with pytest.raises(ValueError, match="each fanout is a number of in-edges"):
        gc.train(model, g, epochs=1, batch_size=8, fanouts=[2, 0])
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        gc.train(model, g, epochs=1, batch_size=0, fanouts=[2, 2])
    with pytest.raises(gc.ArgumentError, match=r"fanouts must be a sequence of ints .* got \[3\.9, 2\.5\]"):
        gc.train(model, g, epochs=1, batch_size=8, fanouts=[3.9, 2.5])   # (was trained with [3, 2])


def test_minibatch_training_resumes_from_a_checkpoint_bit_identically(tmp_path):
    g = _mb_graph()

    def fresh() -> torch.nn.Module:
        torch.manual_seed(0)
        return gc.nn.GraphSAGE(g.num_features, 8, g.num_classes, num_layers=2, dropout=0.3)

    kw = dict(lr=0.02, batch_size=48, fanouts=[3, 2], verbose=False)
    straight = gc.train(fresh(), g, epochs=4, checkpoint_dir=tmp_path / "a", checkpoint_every=2, **kw)
    gc.train(fresh(), g, epochs=2, checkpoint_dir=tmp_path / "b", checkpoint_every=2, **kw)
    resumed = gc.train(fresh(), g, epochs=4, checkpoint_dir=tmp_path / "b", resume=True, **kw)
    assert resumed.loss == straight.loss and resumed.val_acc == straight.val_acc
    with pytest.raises(gc.RuntimeFailure):  # other mini-batches: another run
        gc.train(fresh(), g, epochs=4, checkpoint_dir=tmp_path / "b", resume=True, **{**kw, "batch_size": 32})
