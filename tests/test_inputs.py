"""The step-input provider: what a rank feeds its training steps and evaluations."""

from __future__ import annotations

import torch

import gnncompile as gc
from gnncompile.runtime.inputs import StepInputProvider
from graph_strategies import sbm_graph, seeded_model


def test_program_inputs_feed_steps_without_regrouping_in_the_parameters_dtype() -> None:
    g = sbm_graph(40)
    g = g.replace(x=g.x.float())  # float32 features, float64 model
    model = seeded_model(lambda f, c: gc.nn.GCN(f, 4, c, num_layers=2, dropout=0.0), g)
    prog = gc.plan(model, g, 2, strategy="data").program[0]
    provider = StepInputProvider(prog.step, torch.device("cpu"), torch.float64)
    assert provider.inputs["x"].dtype == torch.float64 and not provider.regrouped
    train, ev = provider.training(3), provider.evaluation()
    assert train.chunk_inputs is ev.chunk_inputs and train.offsets == ev.offsets == ()
    assert torch.equal(train.labels, prog.step.labels) and torch.equal(train.train_mask, prog.step.masks["train"])


def test_a_regrouped_pipeline_feeds_each_epoch_its_subgraphs_and_evaluation_the_programs() -> None:
    g = sbm_graph(60)
    model = seeded_model(lambda f, c: gc.nn.GCN(f, 4, c, num_layers=2, dropout=0.0), g)
    plan = gc.plan(model, g, 2, strategy="task", chunks=3, dependencies="regrouped", semantics="relaxed")
    prog = next(p for p in plan.program if p.step.owned.numel())  # the rank that scores rows
    provider = StepInputProvider(prog.step, torch.device("cpu"))
    assert provider.regrouped
    e0, e1, ev = provider.training(0), provider.training(1), provider.evaluation()
    assert e0.owned is not None and sorted(e0.owned.tolist()) == sorted(prog.step.owned.tolist())
    assert not torch.equal(e0.owned, e1.owned)  # another shuffle every epoch
    torch.testing.assert_close(e0.labels, g.y[e0.owned])
    assert ev.owned is None and torch.equal(ev.labels, prog.step.labels)
