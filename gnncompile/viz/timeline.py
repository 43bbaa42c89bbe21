"""Gantt charts of plan timelines: one row per rank, one bar per executed instruction.

Input is a list of :class:`~gnncompile.runtime.executor.TimelineEvent`-like records per rank (any
object with ``step``, ``instruction``, ``start``, ``end``); the runtime records them for every
training step (``result.ranks[r].timeline``), and the simulator produces the same shape. Bars are
coloured by kind: forward, backward and recomputation (compute), halo exchange / all-to-all /
send-receive / all-reduce (communication), optimizer step; gaps are idle time.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Optional, Sequence, Union

__all__ = ["instruction_kind", "KIND_COLORS", "draw_timeline", "draw_timelines", "draw_memory", "timelines_figure",
           "memory_figure", "byte_unit", "image_path", "image_formats"]

KIND_COLORS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "recompute": "#8172b3",
    "halo": "#55a868",
    "all-to-all": "#64b5cd",
    "send/recv": "#937860",
    "all-reduce": "#c44e52",
    "optimizer": "#8c8c8c",
    "other": "#cccccc",
}

_COMM_KINDS = {"HALO": "halo", "HALO^T": "halo", "A2A": "all-to-all", "AG": "all-to-all", "RS": "all-to-all",
               "SEND": "send/recv", "RECV": "send/recv", "AR": "all-reduce"}


def instruction_kind(text: str) -> str:
    """The colour class of an instruction's short form (``"F0c1"`` -> ``"forward"``)."""
    head = text.split()[0] if text else ""
    if head[:1] in ("F", "B", "R") and head[1:2].isdigit():
        return {"F": "forward", "B": "backward", "R": "recompute"}[head[0]]
    if head == "OPT":
        return "optimizer"
    return _COMM_KINDS.get(head, "other")


def _draw_on(ax: Any, ranks: Sequence[Sequence[Any]], step: Optional[int], title: str) -> set[str]:
    """Draw one panel (the events of ``step`` per rank) on ``ax``; the kinds used."""
    if not ranks or not any(ranks):
        raise ValueError("draw_timeline: no events to draw")
    if step is None:
        step = max(e.step for events in ranks for e in events)
    chosen = [[e for e in events if e.step == step] for events in ranks]
    if not any(chosen):
        raise ValueError(f"draw_timeline: no events recorded for step {step}")
    t0 = min(e.start for events in chosen for e in events)
    used = set()
    for r, events in enumerate(chosen):
        for e in events:
            kind = instruction_kind(e.instruction)
            used.add(kind)
            ax.barh(r, (e.end - e.start) * 1e3, left=(e.start - t0) * 1e3, height=0.7,
                    color=KIND_COLORS[kind], edgecolor="white", linewidth=0.3)
    t1 = max(e.end for events in chosen for e in events)
    ax.set_xlim(0.0, (t1 - t0) * 1e3 if t1 > t0 else 1.0)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))])
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlabel("time in the step (ms)")
    ax.set_title(_wrap(title or f"timeline of step {step}"), fontsize=10)
    return used


def draw_timeline(ranks: Sequence[Sequence[Any]], path: Union[str, Path], *, step: Optional[int] = None,
                  title: str = "") -> Path:
    """Draw the events of ``step`` (default: the last step recorded) for every rank into ``path``.

    ``ranks[r]`` is rank ``r``'s event list. Times are shown in milliseconds from the step's first
    event on any rank. The file type follows the suffix (``.png``, ``.svg``, ``.pdf``; see
    :func:`image_path`); returns the path written.
    """
    return draw_timelines([(title, ranks, step)], path)


def timelines_figure(panels: Sequence[tuple[str, Sequence[Sequence[Any]], Optional[int]]]) -> Any:
    """Several timelines stacked in one matplotlib figure (e.g. simulated above measured), same units.

    ``panels`` holds ``(title, ranks, step)`` triples as :func:`draw_timeline` takes them. Each
    panel's x-axis spans its step from the first event's start to the last event's end; long
    titles are wrapped. The caller owns the figure (``matplotlib.pyplot.close(fig)``).
    """
    plt = _pyplot()
    from matplotlib.patches import Patch

    if not panels:
        raise ValueError("draw_timelines: no panels")
    heights = [1.3 + 0.45 * max(len(ranks), 1) for _, ranks, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, sum(heights) + 0.8), squeeze=False,
                             gridspec_kw={"height_ratios": heights}, layout="constrained")
    used: set[str] = set()
    for ax, (title, ranks, step) in zip(axes[:, 0], panels):
        used |= _draw_on(ax, ranks, step, title)
    fig.legend(handles=[Patch(color=KIND_COLORS[k], label=k) for k in KIND_COLORS if k in used],
               loc="outside lower center", ncol=min(len(used), 5), frameon=False)
    return fig


def draw_timelines(panels: Sequence[tuple[str, Sequence[Sequence[Any]], Optional[int]]],
                   path: Union[str, Path]) -> Path:
    """:func:`timelines_figure` written to ``path`` (the file type follows the suffix, see
    :func:`image_path`); returns the path written."""
    out = image_path(path)  # refused before anything is drawn
    return _save(timelines_figure(panels), out)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


#: the file type of a picture whose path has no suffix (matplotlib's default, made explicit)
DEFAULT_IMAGE_SUFFIX = ".png"


def image_formats() -> list[str]:
    """The file types matplotlib writes, by suffix without the dot (``png``, ``svg``, ``pdf``, ...)."""
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(FigureCanvasBase.get_supported_filetypes())


def image_path(path: Union[str, Path]) -> Path:
    """The file a picture for ``path`` is written to: ``path`` itself when its suffix names a file
    type matplotlib writes (case-insensitive), ``path`` + ``.png`` when it has no suffix (as
    matplotlib would write it, so the path returned is the one written).

    Raises ``ValueError`` naming the supported suffixes for any other suffix, before anything is drawn.
    """
    out = Path(path)
    if not out.suffix:
        return out.with_name(out.name.rstrip(".") + DEFAULT_IMAGE_SUFFIX)
    formats = image_formats()
    if out.suffix[1:].lower() not in formats:
        raise ValueError(f"{str(path)!r}: unsupported picture file type {out.suffix!r}; use one of "
                         f"{', '.join('.' + f for f in formats)} (no suffix: {DEFAULT_IMAGE_SUFFIX})")
    return out


def _save(fig: Any, path: Union[str, Path]) -> Path:
    try:
        out = image_path(path)
        fig.savefig(out, dpi=120, format=out.suffix[1:].lower())
    finally:
        _pyplot().close(fig)
    return out


def _wrap(title: str, width: int = 90) -> str:
    return "\n".join(textwrap.wrap(title, width)) if title else title


_UNITS = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))


def byte_unit(n: float) -> tuple[float, str]:
    """The binary unit that shows ``n`` bytes as a number >= 1: ``(2**20, "MiB")`` for 10 MiB."""
    return next(((scale, name) for scale, name in _UNITS if abs(n) >= scale), (1, "B"))


def _fmt_bytes(n: float) -> str:
    scale, name = byte_unit(n)
    return f"{n / scale:.3g} {name}"


#: the memory plot draws the capacity as a line when the peak is at least this fraction of it
CAPACITY_LINE_FRACTION = 0.2


def memory_figure(curves: Sequence[Sequence[tuple[float, float]]], *, capacity: Optional[float] = None,
                  step_time: Optional[float] = None, title: str = "", capacity_label: str = "device memory") -> Any:
    """Memory over one step per rank (``curves[r]``: ``(seconds, bytes)`` points, each holding until
    the next) as a matplotlib figure; the caller owns it.

    The x-axis covers the whole step (``step_time``, default the last point; a curve is held at its
    last value up to there); the y-axis fits the data, in the binary unit its peak reads best in.
    ``capacity`` is drawn as a dashed line (``capacity_label``) when the peak reaches at least
    :data:`CAPACITY_LINE_FRACTION` of it, else stated in a note so the curves are not flattened.
    """
    plt = _pyplot()
    if not curves or not any(curves):
        raise ValueError("draw_memory: no memory curve to draw")
    last = max(t for pts in curves for t, _ in pts)
    end = max(step_time or 0.0, last)
    peak = max(b for pts in curves for _, b in pts)
    draw_capacity = capacity is not None and capacity > 0 and peak >= CAPACITY_LINE_FRACTION * capacity
    top = max(peak, capacity if draw_capacity else 0.0)
    scale, unit = byte_unit(top)
    fig, ax = plt.subplots(figsize=(9, 4.2), layout="constrained")
    labelled = len(curves) <= 16
    for r, pts in enumerate(curves):
        if not pts:
            continue
        xs = [t * 1e3 for t, _ in pts]
        ys = [b / scale for _, b in pts]
        if xs[-1] < end * 1e3:
            xs.append(end * 1e3)
            ys.append(ys[-1])
        ax.step(xs, ys, where="post", label=f"rank {r}" if labelled else None, linewidth=1)
    if draw_capacity:
        ax.axhline(capacity / scale, color="black", linestyle="--", linewidth=1,
                   label=f"{capacity_label}: {_fmt_bytes(capacity)}")
    elif capacity:
        ax.text(0.01, 0.97, f"{capacity_label}: {_fmt_bytes(capacity)}; the peak, {_fmt_bytes(peak)}, is "
                f"{peak / capacity:.2%} of it (not drawn to scale)", transform=ax.transAxes, va="top", fontsize=8)
    ax.set_xlim(0.0, end * 1e3 if end > 0 else 1.0)
    ax.set_ylim(0.0, top / scale * (1.12 if not draw_capacity or peak > capacity else 1.06) if top > 0 else 1.0)
    ax.set_xlabel("time in the step (ms)")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(_wrap(title or "memory per rank over one step"))
    if labelled or draw_capacity:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def draw_memory(curves: Sequence[Sequence[tuple[float, float]]], path: Union[str, Path], *,
                capacity: Optional[float] = None, step_time: Optional[float] = None, title: str = "",
                capacity_label: str = "device memory") -> Path:
    """:func:`memory_figure` written to ``path`` (the file type follows the suffix, see
    :func:`image_path`); returns the path written."""
    out = image_path(path)  # refused before anything is drawn
    return _save(memory_figure(curves, capacity=capacity, step_time=step_time, title=title,
                               capacity_label=capacity_label), out)
