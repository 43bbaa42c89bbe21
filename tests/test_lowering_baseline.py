"""Today's lowering of every strategy x option set equals the baseline of the code before ``lower()``.

The baseline (``tests/data/lowering_baseline.*``, written by ``tests/lowering_cases.py`` at commit
6d78f0e) holds each case's instruction lists, stage ops, sizes and predicted bytes, and the one-step
result of the runnable ones. A lowering must reproduce them exactly, except for the intended
differences in :data:`INTENDED`, each with its reason.
"""

from __future__ import annotations

import gzip
import json
import re
from typing import Any, Callable

import pytest
import torch

from lowering_cases import CASES, CASE_IDS, DATA, fingerprint, make_plan, step

def _without_minibatch_options(fp: dict[str, Any]) -> dict[str, Any]:
    """Without the sampled mini-batch options and the exchange-list field of halo exchanges (``''``:
    the rank's own lists, what every full-graph exchange uses)."""
    options = {k: v for k, v in fp["options"].items() if k not in ("batch_size", "fanouts")}
    ranks = [{k: [i.replace(", halo='')", ")") for i in v] if k.endswith("instructions") else v
              for k, v in r.items()} for r in fp["ranks"]]
    return {**fp, "options": options, "ranks": ranks}


def _without_backward_option(fp: dict[str, Any]) -> dict[str, Any]:
    return {**fp, "options": {k: v for k, v in fp["options"].items() if k != "backward"}}


def _without_features_option(fp: dict[str, Any]) -> dict[str, Any]:
    return {**fp, "options": {k: v for k, v in fp["options"].items() if k != "features"}}


def _without_frees(fp: dict[str, Any]) -> dict[str, Any]:
    ranks = [{k: [i for i in v if not i.startswith("Free(")] if k.endswith("instructions") else v
              for k, v in r.items()} for r in fp["ranks"]]
    return {**fp, "ranks": ranks}


def _replicated_dropout_named_as_before(fp: dict[str, Any]) -> dict[str, Any]:
    ranks = [{k: [[re.sub(r"^dropout_rows", "dropout", op) for op in ops] for ops in v] if k == "stages" else v
              for k, v in r.items()} for r in fp["ranks"]]
    return {**fp, "ranks": ranks}


def _is_gin(fp: dict[str, Any]) -> bool:
    return any("convs_0_nn_0" in ops for r in fp["ranks"] for ops in r["stages"])


def _gin_eps_as_constant(fp: dict[str, Any]) -> dict[str, Any]:
    """GIN's stage ops by kind (``add_2`` -> ``add``: numbers shift once ``1 + eps`` is an op)
    without each ``add`` right before a ``mul`` (``(1 + eps) * x``: the ``add`` is new)."""
    if not _is_gin(fp):
        return fp

    def kinds(ops: list[str]) -> list[str]:
        base = [re.sub(r"_\d+$", "", op) for op in ops]
        return [op for i, op in enumerate(base) if not (op == "add" and base[i + 1:i + 2] == ["mul"])]

    ranks = [{k: [kinds(ops) for ops in v] if k == "stages" else v for k, v in r.items()} for r in fp["ranks"]]
    return {**fp, "ranks": ranks}


#: (strategy the difference applies to (``"*"``: every strategy), reason, a normalization applied to both the baseline's
#: fingerprint and today's before they are compared, and a check that today's has the difference).
INTENDED: list[tuple[str, str, Callable[[dict[str, Any]], dict[str, Any]], Callable[[dict[str, Any]], bool]]] = [
    ("mop", "FREE now also in mop (the driver frees values that cross ranks or chunks for every chunked strategy; "
            "mop sends point to point like task, and kept every received chunk for the whole step)",
     _without_frees, lambda fp: any(i.startswith("Free(") for r in fp["ranks"] for i in r["instructions"])),
    ("data", "FREE now also in data (every stage output and halo extension is released after its last use "
             "instead of at the end of the step: the first layer's output no longer lives beside the second's)",
     _without_frees, lambda fp: any(i.startswith("Free(") for r in fp["ranks"] for i in r["instructions"])),
    ("data", "data gained the options of sampled mini-batch training (batch_size, fanouts; None: the "
             "full-graph training it did before), and HaloExchange the name of its exchange lists (halo, '': the "
             "rank's own ones)",
     _without_minibatch_options, lambda fp: fp["options"].get("batch_size", 0) is None
     and fp["options"].get("fanouts", 0) is None),
    ("*", "every strategy gained the option of how propagations compute their backward product (backward; "
          "'transposed': what they did before)",
     _without_backward_option, lambda fp: fp["options"].get("backward") == "transposed"),
    ("*", "every plan records how ranks hold the input features (features; the cases' features are dense "
          "Gaussian, which the planner keeps dense: 'dense', what they did before)",
     _without_features_option, lambda fp: fp["options"].get("features") == "dense"),
    ("*", "plans from statistics replicate dropout masks as runnable plans do (dropout_rows, not F.dropout), so "
          "they predict the memory a run holds",
     # (the cases with dropout p = 0 or local masks keep F.dropout: test_dropout_masks checks the difference)
     _replicated_dropout_named_as_before, lambda fp: True),
    ("task", "a buffer read in forward is a graph input, read by each step (GIN's eps buffer: its 1 + eps is an op "
             "of the stage, not a constant folded at trace time, so a plan sees later changes of the buffer)",
     _gin_eps_as_constant, lambda fp: not _is_gin(fp) or any(ops[:2] == ["add", "mul"] for r in fp["ranks"]
                                                              for ops in r["stages"])),
]


#: The one-step results equal the baseline's up to float64 rounding, not bit for bit: since the compact
#: topology (issue 22) a normalized propagation applies per-vertex scales inside the product
#: (``row[v] * sum w * col[u] * x[u]``) where the baseline multiplied precomputed per-edge
#: coefficients, which rounds differently (measured: at most 3.6e-14 relative, 2.7e-15 absolute).
STEP_TOLERANCE = dict(rtol=1e-12, atol=1e-14)


@pytest.fixture(scope="module")
def baseline() -> tuple[dict[str, Any], dict[str, Any]]:
    with gzip.open(DATA / "lowering_baseline.json.gz", "rt") as f:
        prints = json.load(f)
    return prints, torch.load(DATA / "lowering_baseline.pt")


def normalized(got: dict[str, Any], old: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``got`` and ``old`` with the intended differences normalized away (each checked present)."""
    for strategy, reason, normalize, present in INTENDED:
        if strategy in ("*", old["strategy"]):
            assert present(got), f"intended difference missing: {reason}"
            got, old = normalize(got), normalize(old)
    return got, old


@pytest.mark.parametrize("case", CASE_IDS)
def test_lowering_matches_baseline(case: str, baseline: tuple[dict[str, Any], dict[str, Any]],
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # the baseline's steps drew torch's bernoulli_ masks (the default generator was that, then)
    monkeypatch.setenv("GNNCOMPILE_DROPOUT_MASKS", "torch")
    prints, steps = baseline
    plan = make_plan(case)
    got, want = normalized(fingerprint(plan), prints[case])
    assert got.keys() == want.keys()
    for key in ("strategy", "semantics", "options", "relaxations", "bytes_sent", "bytes_received"):
        assert got[key] == want[key], f"{case}: {key} differs"
    assert len(got["ranks"]) == len(want["ranks"]), f"{case}: number of ranks"
    for r, (g, w) in enumerate(zip(got["ranks"], want["ranks"])):
        for key in w:
            assert g.get(key) == w[key], f"{case}: rank {r}: {key} differs"
    gpus = next(c[2] for c in CASES if c[0] == case)
    if not isinstance(gpus, int):
        return
    now, then = step(plan), steps[case]
    exact = STEP_TOLERANCE
    torch.testing.assert_close(torch.tensor(now["loss"]), torch.tensor(then["loss"]), **exact)
    torch.testing.assert_close(now["logits"], then["logits"], **exact)
    assert now["grads"].keys() == then["grads"].keys()
    for name, g in then["grads"].items():
        if g is None:
            assert now["grads"][name] is None, name
        else:
            torch.testing.assert_close(now["grads"][name], g, **exact, msg=lambda m, n=name: f"{case}: grad {n}: {m}")
