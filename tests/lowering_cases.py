"""The lowering baseline: every strategy x option set of the pre-``lower()`` code on fixed graphs.

:data:`CASES` lists them; :func:`fingerprint` is what a lowering must reproduce (every rank's
training and evaluation instruction lists, stage ops, sizes, predicted bytes); :func:`step` is the
one-step result (loss, logits, gradients) of a runnable plan. ``python tests/lowering_cases.py``
wrote ``tests/data/lowering_baseline.{json.gz,pt}`` at commit 6d78f0e, before the lowerings were
unified; ``tests/test_lowering_baseline.py`` compares today's lowering with it.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any, Callable

import torch

import gnncompile as gc

sys.path.insert(0, str(Path(__file__).parent))
from graph_strategies import sbm_graph, seeded_model  # noqa: E402

DATA = Path(__file__).parent / "data"

class _UnfusedGATConv(gc.nn.GATConv):
    """``GATConv`` as written when the baseline was recorded: its attention's gathers, add, LeakyReLU
    and ``edge_softmax`` as separate primitives (the zoo's now calls ``edge_attention``, which fuses
    them, and so traces to other ops: the baseline is of the lowering, not of the zoo's layers)."""

    def forward(self, g: gc.Graph, x: torch.Tensor) -> torch.Tensor:
        heads, c, sl = self.heads, self.out_channels, self.add_self_loops
        h = self.lin(x).view(-1, heads, c)
        a_src = (h * self.att_src).sum(dim=-1)
        a_dst = (h * self.att_dst).sum(dim=-1)
        scores = gc.ops.gather_src(g, a_src, sl) + gc.ops.gather_dst(g, a_dst, sl)
        scores = torch.nn.functional.leaky_relu(scores, self.negative_slope)
        alpha = gc.ops.edge_softmax(g, scores, sl)
        alpha = torch.nn.functional.dropout(alpha, p=self.dropout, training=self.training)
        out = gc.ops.propagate(g, h, "none", edge_weight=alpha, add_self_loops=sl)
        out = out.reshape(-1, heads * c) if self.concat else out.mean(dim=1)
        if self.bias is not None:
            out = out + self.bias
        return out


def _unfused_gat(f: int, c: int) -> torch.nn.Module:
    """The zoo's GAT (same parameters, same initialization) with :class:`_UnfusedGATConv` layers."""
    model = gc.nn.GAT(f, 3, c, heads=2, num_layers=2, dropout=0.5)
    for conv in model.convs:
        conv.__class__ = _UnfusedGATConv
    return model


MODELS: dict[str, Callable[[int, int], torch.nn.Module]] = {
    "gcn": lambda f, c: gc.nn.GCN(f, 5, c, num_layers=2, dropout=0.0),
    "gcn_dropout": lambda f, c: gc.nn.GCN(f, 5, c, num_layers=2, dropout=0.5),
    "gcn3": lambda f, c: gc.nn.GCN(f, 4, c, num_layers=3, dropout=0.5),
    "sage": lambda f, c: gc.nn.GraphSAGE(f, 5, c, num_layers=2, dropout=0.0),
    "gat": _unfused_gat,
    "gin": lambda f, c: gc.nn.GIN(f, 5, c, num_layers=2, dropout=0.0),
    "appnp": lambda f, c: gc.nn.APPNP(f, 5, c, K=3, dropout=0.0),
    "sgc": lambda f, c: gc.nn.SGC(f, c, K=2),
}

#: (case id, model, gpus, plan options); ``gpus`` a number (runnable, on the 60-vertex SBM) or a
#: cluster description (planned from GraphStats of a 200k-vertex graph: printed and simulated only).
CASES: list[tuple[str, str, Any, dict[str, Any]]] = [
    ("data-metis", "gcn_dropout", 3, dict(strategy="data")),
    ("data-random-recompute", "gcn_dropout", 3, dict(strategy="data", partitioner="random", recompute=True)),
    ("data-contiguous-local", "gcn_dropout", 2, dict(strategy="data", partitioner="contiguous", dropout="local")),
    ("data-gat", "gat", 3, dict(strategy="data")),
    ("data-sage-4", "sage", 4, dict(strategy="data", partitioner="random", seed=3)),
    ("data-stats", "gcn", "4xA100", dict(strategy="data")),
    ("tensor", "gcn_dropout", 3, dict(strategy="tensor")),
    ("tensor-recompute", "gat", 3, dict(strategy="tensor", recompute=True)),
    ("tensor-decouple", "gcn3", 2, dict(strategy="tensor", decouple=True, semantics="relaxed")),
    ("tensor-chunks", "gcn_dropout", 3, dict(strategy="tensor", chunks=4)),
    ("tensor-chunks-sage", "sage", 2, dict(strategy="tensor", chunks=3)),
    ("tensor-chunks-decouple", "sgc", 3, dict(strategy="tensor", chunks=4, decouple=True, semantics="relaxed")),
    ("tensor-stats", "gcn", "8xA100", dict(strategy="tensor", chunks=8)),
    ("mop", "gcn_dropout", 4, dict(strategy="mop", chunks=1)),
    ("mop-rcm", "gcn_dropout", 4, dict(strategy="mop", chunks=4, reorder="rcm")),
    ("mop-sparse1", "appnp", 3, dict(strategy="mop", chunks=3, sparse_ranks=1)),
    ("mop-stats", "gcn", "8xA100", dict(strategy="mop", chunks=8, reorder="rcm")),
    ("task-2", "gcn", 2, dict(strategy="task", chunks=4)),
    ("task-5", "gat", 5, dict(strategy="task", chunks=6)),
    ("task-7", "gin", 7, dict(strategy="task", chunks=6)),
    ("task-recompute", "gcn", 3, dict(strategy="task", chunks=4, recompute=True)),
    ("task-decouple", "sgc", 3, dict(strategy="task", chunks=3, decouple=True, semantics="relaxed")),
    ("task-p-ranks", "gcn", 4, dict(strategy="task", chunks=4, p_ranks=1)),
    ("task-skip-later", "gcn", 3, dict(strategy="task", chunks=4, dependencies="skip-later", semantics="relaxed")),
    ("task-regrouped", "gcn", 3, dict(strategy="task", chunks=3, dependencies="regrouped", subgraph_chunks=2,
                                      semantics="relaxed")),
    ("task-cached", "gcn", 2, dict(strategy="task", chunks=4, dependencies="cached", semantics="relaxed")),
    ("task-stats", "gcn", "8xA100", dict(strategy="task")),
    ("search", "gcn", 4, dict()),
    ("search-relaxed-any", "gcn3", "4xA100", dict(semantics="relaxed", devices="any")),
]

CASE_IDS = [c[0] for c in CASES]


def graph() -> gc.Graph:
    return sbm_graph(60)


def make_plan(case: str) -> Any:
    """The plan of ``case`` (lowered with today's code)."""
    _, name, gpus, options = next(c for c in CASES if c[0] == case)
    g = graph()
    model = seeded_model(MODELS[name], g)
    target = g if isinstance(gpus, int) else gc.GraphStats(num_nodes=200_000, num_edges=4_000_000,
                                                           num_features=g.num_features, num_classes=g.num_classes)
    return gc.plan(model, target, gpus, **options)


def fingerprint(plan: Any) -> dict[str, Any]:
    """What two lowerings of one case must agree on (JSON data)."""
    ranks = []
    programs = getattr(plan, "program", None) or []
    for r, dp in enumerate(plan.ranks):
        entry = {"instructions": [repr(i) for i in dp.instructions],
                 "stages": [list(s.ops) for s in dp.stages],
                 "sizes": dict(sorted(dp.sizes.to_dict().items()))}
        if r < len(programs):
            entry["eval_instructions"] = [repr(i) for i in programs[r].eval_instructions]
        ranks.append(entry)
    pred = plan.predictions
    return {"strategy": plan.strategy, "semantics": plan.semantics, "options": plan.options,
            "relaxations": list(plan.relaxations), "ranks": ranks,
            "bytes_sent": [int(b) for b in pred["bytes_sent"]],
            "bytes_received": [int(b) for b in pred["bytes_received"]]}


def step(plan: Any) -> dict[str, Any]:
    """One captured training step of a runnable plan (float64 model)."""
    res = plan.run(epochs=1, seed=0, capture=True, timeout=120, device="cpu")
    return {"loss": res.history.loss[0], "logits": res.captured["logits"],
            "grads": dict(res.captured["grads"])}


def write_baseline() -> None:
    DATA.mkdir(exist_ok=True)
    prints, steps = {}, {}
    for case, _, gpus, _ in CASES:
        plan = make_plan(case)
        prints[case] = fingerprint(plan)
        if isinstance(gpus, int):
            steps[case] = step(plan)
        print(case, plan.strategy, len(plan.ranks), "ranks", flush=True)
    with gzip.open(DATA / "lowering_baseline.json.gz", "wt") as f:
        json.dump(prints, f, indent=1, sort_keys=True)
    torch.save(steps, DATA / "lowering_baseline.pt")


if __name__ == "__main__":
    write_baseline()
