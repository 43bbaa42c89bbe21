"""Today's lowering of every strategy x option set equals the baseline of the code before ``lower()``.

The baseline (``tests/data/lowering_baseline.*``, written by ``tests/lowering_cases.py`` at commit
6d78f0e) holds each case's instruction lists, stage ops, sizes and predicted bytes, and the one-step
result of the runnable ones. A lowering must reproduce them exactly, except for the intended
differences in :data:`INTENDED`, each with its reason.
"""

from __future__ import annotations

import gzip
import json
from typing import Any, Callable

import pytest
import torch

from lowering_cases import CASES, CASE_IDS, DATA, fingerprint, make_plan, step

#: (strategy the difference applies to, reason, the edit that turns a baseline fingerprint into
#: today's). Empty while the lowering is the baseline's.
INTENDED: list[tuple[str, str, Callable[[dict[str, Any]], dict[str, Any]]]] = []


@pytest.fixture(scope="module")
def baseline() -> tuple[dict[str, Any], dict[str, Any]]:
    with gzip.open(DATA / "lowering_baseline.json.gz", "rt") as f:
        prints = json.load(f)
    return prints, torch.load(DATA / "lowering_baseline.pt")


def expected(old: dict[str, Any]) -> dict[str, Any]:
    for strategy, _, edit in INTENDED:
        if old["strategy"] == strategy:
            old = edit(old)
    return old


@pytest.mark.parametrize("case", CASE_IDS)
def test_lowering_matches_baseline(case: str, baseline: tuple[dict[str, Any], dict[str, Any]]) -> None:
    prints, steps = baseline
    plan = make_plan(case)
    got, want = fingerprint(plan), expected(prints[case])
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
    exact = dict(rtol=0.0, atol=0.0)
    torch.testing.assert_close(torch.tensor(now["loss"]), torch.tensor(then["loss"]), **exact)
    torch.testing.assert_close(now["logits"], then["logits"], **exact)
    assert now["grads"].keys() == then["grads"].keys()
    for name, g in then["grads"].items():
        if g is None:
            assert now["grads"][name] is None, name
        else:
            torch.testing.assert_close(now["grads"][name], g, **exact, msg=lambda m, n=name: f"{case}: grad {n}: {m}")
