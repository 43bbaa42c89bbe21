"""Bad arguments to the result and plan objects' methods raise the project's own errors.

A reviewer found built-in ``ValueError``/``FileNotFoundError`` escaping where the neighbouring
methods raise :class:`gnncompile.ArgumentError`: a measured timeline with an unknown picture type
or a step that never ran, and pictures or a saved plan into a directory that does not exist (the
files were never written, after the drawing's work).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import gnncompile as gc


@pytest.fixture(scope="module")
def run() -> Any:
    g = gc.datasets.synthetic("sbm", num_nodes=40, avg_degree=4, num_features=4, num_classes=2, seed=0)
    plan = gc.plan(gc.nn.GCN(4, 4, 2), g, gpus=2, strategy="data")
    return plan.run(2, progress=False)


def test_measured_timeline_refuses_bad_arguments(run: Any, tmp_path: Path) -> None:
    with pytest.raises(gc.ArgumentError, match="unsupported picture file type"):
        run.timeline(str(tmp_path / "t.xyz"))
    with pytest.raises(gc.ArgumentError, match="no events recorded for step 99"):
        run.timeline(str(tmp_path / "t.png"), step=99)
    with pytest.raises(gc.ArgumentError, match="does not exist"):
        run.timeline(str(tmp_path / "missing" / "t.png"))
    assert not (tmp_path / "missing").exists()
    run.timeline(str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").stat().st_size > 0


def test_plan_pictures_into_a_missing_directory_are_refused(run: Any, tmp_path: Path) -> None:
    for draw in (run.plan.timeline, run.plan.memory_plot):
        with pytest.raises(gc.ArgumentError, match="does not exist"):
            draw(str(tmp_path / "missing" / "p.png"))


def test_plan_save_into_a_missing_directory_is_refused(run: Any, tmp_path: Path) -> None:
    with pytest.raises(gc.ArgumentError, match="plan.save: cannot write .*does not exist"):
        run.plan.save(tmp_path / "missing" / "plan.json")
    assert run.plan.save(tmp_path / "plan.json").stat().st_size > 0


@pytest.mark.parametrize("flag", ["overlap", "verify"])
def test_plan_switches_take_booleans_only(flag: str) -> None:
    """``gc.plan(overlap="no")`` simulated overlap (a non-empty string is true) and ``verify="no"``
    verified; every other option was checked."""
    g = gc.datasets.synthetic("sbm", num_nodes=40, avg_degree=4, num_features=4, num_classes=2, seed=0)
    with pytest.raises(gc.PlanningError, match=f"{flag}: expected True or False, got 'no'"):
        gc.plan(gc.nn.GCN(4, 4, 2), g, gpus=2, strategy="data", **{flag: "no"})


@pytest.mark.parametrize("gpus, asked", [(11, "11"), ("3x4xA100", "3x4xA100")])
def test_more_ranks_than_vertices_names_the_request_and_the_count(gpus: Any, asked: str) -> None:
    """A cluster spec with more devices than vertices was reported by its device count alone
    (``gpus=12``), which the CLI spelled as a ``--gpus 12`` the user never typed."""
    g = gc.datasets.synthetic("sbm", num_nodes=10, avg_degree=2, num_features=3, num_classes=2, seed=0)
    with pytest.raises(gc.PlanningError, match=rf"gpus={asked}: the rank count \d+ exceeds the graph's 10 vertices"):
        gc.plan(gc.nn.GCN(3, 4, 2), g, gpus)
