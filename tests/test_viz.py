"""Pictures a user reads without explanation (issue 18): the memory plot's axes fit the data and
the whole step, the capacity is drawn only at a readable scale and labelled consistently with the
cluster, and titles are not cut off."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import gnncompile as gc  # noqa: E402
from gnncompile.viz.timeline import memory_figure, timelines_figure  # noqa: E402

MiB, GiB = 2**20, 2**30


def _inside_figure(fig: Any, artist: Any) -> bool:
    fig.canvas.draw()
    box = artist.get_window_extent(renderer=fig.canvas.get_renderer())
    return box.x0 >= -1 and box.x1 <= fig.bbox.width + 1 and box.y1 <= fig.bbox.height + 1


def test_memory_axes_fit_the_data_and_the_whole_step() -> None:
    """~10 MiB per rank used to be drawn on a 0-24 GiB axis (flat lines at zero), and the x-axis
    stopped at the last memory change (0.27 ms of a 0.497 ms step)."""
    curves = [[(0.0, 8 * MiB), (1e-4, 10 * MiB), (2.7e-4, 9 * MiB)],
              [(0.0, 8 * MiB), (2e-4, 11 * MiB)]]
    fig = memory_figure(curves, capacity=24 * GiB, step_time=4.97e-4, title="x " * 120)
    try:
        ax = fig.axes[0]
        lo, hi = ax.get_xlim()
        assert lo <= 0 and hi >= 0.497 - 1e-9
        ylo, yhi = ax.get_ylim()
        assert "MiB" in ax.get_ylabel()
        assert ylo <= 0 and 11 <= yhi <= 11 * 1.5  # the peak fills most of the axis
        for line in ax.get_lines():  # every curve is held to the end of the step
            assert max(line.get_xdata()) == pytest.approx(0.497)
        assert not any(line.get_linestyle() == "--" for line in ax.get_lines())  # capacity not drawn to scale ...
        note = [t.get_text() for t in ax.texts]
        assert any("24 GiB" in t and "not drawn to scale" in t for t in note)  # ... but stated
        assert _inside_figure(fig, ax.title)
    finally:
        plt.close(fig)


def test_memory_capacity_line_when_it_is_to_scale() -> None:
    curves = [[(0.0, 3 * GiB), (1e-3, 5 * GiB)]]
    fig = memory_figure(curves, capacity=8 * GiB, step_time=2e-3, capacity_label="device memory")
    try:
        ax = fig.axes[0]
        dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
        assert len(dashed) == 1 and dashed[0].get_ydata()[0] == pytest.approx(8)
        assert ax.get_ylim()[1] >= 8 and "GiB" in ax.get_ylabel()
        assert "device memory: 8 GiB" in ax.get_legend_handles_labels()[1]
    finally:
        plt.close(fig)


def test_plan_memory_plot_labels_the_capacity_like_the_cluster(tmp_path: Any) -> None:
    """The device-memory line said 4 GiB while the cluster label said 16 GiB: on a CPU host the
    ranks share the host's memory; the label now says both numbers and how they relate."""
    g = gc.datasets.synthetic("sbm", num_nodes=300, avg_degree=4, num_features=8, num_classes=3, seed=0)
    torch.manual_seed(0)
    plan = gc.plan(gc.nn.GCN(8, 8, 3, num_layers=2), g, gpus=4, strategy="data", partitioner="random")
    data = plan.memory_plot_data()
    cluster = plan.prediction.cluster
    assert data["capacity"] == cluster.rank_device(0).memory
    if cluster.device.kind == "cpu" and cluster.devices_per_node > 1:
        whole = cluster.device.memory / GiB
        assert f"{whole:.2f} GiB shared by {cluster.devices_per_node} ranks" in data["capacity_label"]
        assert data["capacity"] * cluster.devices_per_node == pytest.approx(cluster.device.memory, rel=1e-6)
    step = plan.prediction.simulation.step_time
    assert data["step_time"] == step
    fig = memory_figure(**data)
    try:
        ax = fig.axes[0]
        peak = max(b for c in data["curves"] for _, b in c)
        scale = {"B": 1, "KiB": 2**10, "MiB": MiB, "GiB": GiB}[ax.get_ylabel().split("(")[1].rstrip(")")]
        assert ax.get_xlim()[1] >= step * 1e3 * (1 - 1e-9)
        assert ax.get_ylim()[1] >= peak / scale and ax.get_ylim()[1] <= 1.5 * max(peak, data["capacity"]) / scale
        assert _inside_figure(fig, ax.title)
    finally:
        plt.close(fig)
    assert plan.memory_plot(tmp_path / "m.png").stat().st_size > 0


def test_timeline_titles_fit_and_x_covers_the_step() -> None:
    ev = lambda s, e, text: SimpleNamespace(step=0, instruction=text, start=s, end=e)  # noqa: E731
    ranks = [[ev(0.0, 1e-3, "F0c0"), ev(1e-3, 3e-3, "B0c0")], [ev(0.5e-3, 4e-3, "AR grads")]]
    title = "predicted: 4.000 ms per step on " + "8 nodes x 8 A100-80GB (80 GiB, 19.5 TFLOP/s fp32), " * 3
    fig = timelines_figure([(title, ranks, 0)])
    try:
        ax = fig.axes[0]
        assert ax.get_xlim() == pytest.approx((0.0, 4.0))
        assert _inside_figure(fig, ax.title)
    finally:
        plt.close(fig)


def test_draw_returns_the_file_written_and_refuses_unknown_types(tmp_path: Any) -> None:
    """``draw_memory(path="mem")`` returned ``mem`` while matplotlib wrote ``mem.png``; ``.xyz``
    failed inside matplotlib after the figure was drawn."""
    from gnncompile.viz import draw_memory, draw_timeline, image_path

    ev = lambda s, e, text: SimpleNamespace(step=0, instruction=text, start=s, end=e)  # noqa: E731
    ranks = [[ev(0.0, 1e-3, "F0c0")], [ev(0.0, 2e-3, "AR grads")]]
    curves = [[(0.0, 3 * MiB), (1e-3, 5 * MiB)]]
    assert draw_timeline(ranks, tmp_path / "tl") == tmp_path / "tl.png"
    assert draw_memory(curves, str(tmp_path / "mem.")) == tmp_path / "mem.png"
    assert draw_timeline(ranks, tmp_path / "t.PDF") == tmp_path / "t.PDF"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mem.png", "t.PDF", "tl.png"]
    assert (tmp_path / "tl.png").read_bytes()[:4] == b"\x89PNG" and (tmp_path / "t.PDF").read_bytes()[:4] == b"%PDF"
    assert image_path("a/b.svg") == Path("a/b.svg") and image_path("a/b") == Path("a/b.png")
    figures = plt.get_fignums()
    for draw, args in ((draw_timeline, (ranks,)), (draw_memory, (curves,))):
        with pytest.raises(ValueError, match=r"unsupported picture file type '\.xyz'; use one of .*\.png.*\.svg"):
            draw(*args, tmp_path / "x.xyz")
    assert not (tmp_path / "x.xyz").exists() and plt.get_fignums() == figures


def test_plan_pictures_return_the_file_written(tmp_path: Any) -> None:
    g = gc.datasets.synthetic("sbm", num_nodes=300, avg_degree=4, num_features=8, num_classes=3, seed=0)
    torch.manual_seed(0)
    plan = gc.plan(gc.nn.GCN(8, 8, 3, num_layers=2), g, gpus=2, strategy="data", partitioner="random")
    for draw in (plan.timeline, plan.memory_plot):
        out = draw(tmp_path / draw.__name__)
        assert out == tmp_path / f"{draw.__name__}.png" and out.stat().st_size > 0
    with pytest.raises(ValueError, match="unsupported picture file type"):
        plan.timeline(tmp_path / "t.xyz")
