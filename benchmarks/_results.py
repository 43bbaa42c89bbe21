"""Shared helpers of the benchmark scripts: machine description and `RESULTS.md` sections.

`RESULTS.md` is a list of ``## <title>`` sections, one per benchmark script; each script rewrites
only its own section so the others stay intact.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Union

__all__ = ["update_section", "machine_info", "command_line", "today", "sampling_graphs"]

HEADER = (
    "# Benchmark results\n\n"
    "Written by the scripts in `benchmarks/`; each section is replaced when its script reruns.\n"
)


def update_section(path: Union[str, Path], title: str, markdown: str) -> None:
    """Replace the ``## title`` section of ``path`` with ``markdown`` (append it when absent).

    A section runs from its ``## title`` line to the next level-2 heading (or the end of the file);
    deeper headings (``###``) inside ``markdown`` belong to the section. The file is created with a
    short header when missing.
    """
    path = Path(path)
    text = path.read_text() if path.exists() else HEADER
    body = markdown.strip("\n")
    section = f"## {title}\n\n{body}\n"
    lines = text.splitlines(keepends=True)
    heading = re.compile(r"^##\s+(.*?)\s*$")
    start = next((i for i, ln in enumerate(lines) if (m := heading.match(ln)) and m.group(1) == title), None)
    if start is None:
        if not text.endswith("\n"):
            text += "\n"
        new = text + "\n" + section
    else:
        end = next((j for j in range(start + 1, len(lines)) if heading.match(lines[j])), len(lines))
        tail = "".join(lines[end:])
        new = "".join(lines[:start]) + section + ("\n" + tail if tail else "")
    path.write_text(new)


def _lscpu_model() -> str:
    """The CPU model name as lscpu reports it."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_info(threads: int) -> str:
    """One line: CPU model (lscpu), logical CPUs, threads used, memory, Python/torch versions."""
    import torch

    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        mem = f"{mem_gib:.0f} GiB RAM"
    except (ValueError, OSError):
        mem = "RAM unknown"
    return (
        f"{_lscpu_model()}, {os.cpu_count()} logical CPUs, {threads} threads used, {mem}; "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )


def gpu_info() -> str:
    """One line: the CUDA device, its memory, and the versions of torch, CUDA, CuPy and PyG that ran."""
    import torch

    props = torch.cuda.get_device_properties(0)
    parts = [f"{props.name} ({props.total_memory / 2**30:.0f} GiB)", f"torch {torch.__version__}",
             f"CUDA {torch.version.cuda}"]
    for module in ("cupy", "torch_geometric"):
        try:
            parts.append(f"{module} {__import__(module).__version__}")
        except ImportError:
            parts.append(f"{module} not installed")
    return ", ".join(parts)


def command_line() -> str:
    """The command that produced the results, relative to the repository root when possible."""
    return shlex.join(["python"] + sys.argv)


def today() -> str:
    """Local date and time of the run."""
    return time.strftime("%Y-%m-%d %H:%M %Z")


def sampling_graphs(gc, rmat_nodes: int, rmat_degree: float, with_rmat: bool = True) -> list:
    """``(label, graph)`` of the sampling benchmarks: coauthor_physics, soc_slashdot and an R-MAT
    graph (one feature, no training split: targets are drawn from every vertex)."""
    out = [(name, gc.datasets.load(name)) for name in ("coauthor_physics", "soc_slashdot")]
    if with_rmat:
        t0 = time.perf_counter()
        rmat = gc.datasets.synthetic("rmat", num_nodes=rmat_nodes, avg_degree=rmat_degree, num_features=1,
                                     num_classes=2, seed=0)
        print(f"rmat: generated in {time.perf_counter() - t0:.1f} s", flush=True)
        out.append((f"rmat ({rmat_nodes:,} vertices, avg degree {rmat_degree:g})", rmat.replace(train_mask=None)))
    return out
