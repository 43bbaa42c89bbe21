"""Hardware descriptions for the cost models: devices, links, clusters, presets, parsing, calibration.

A :class:`Cluster` is ``nodes`` machines of ``devices_per_node`` identical ranks (one GPU, or one
process on a CPU host), linked inside a machine by ``intra`` and between machines by ``inter``::

    Cluster.parse("2x4xA5000-ib200")     # 2 nodes x 4 A5000, PCIe 4.0 inside, 200 Gbit/s IB across
    Cluster.parse("neutrontask")         # a paper's testbed (see CLUSTERS)
    Cluster.parse("4xcpu")               # 4 ranks on this host, from the saved CPU profile
    Cluster.calibrate("profile.json")    # measure this host's CPU and gloo and save a profile

Grammar of :meth:`Cluster.parse`: ``[NODESx]DEVICESxMODEL[-LINK]``, a bare ``MODEL`` (one device)
or a preset name from :data:`CLUSTERS`. ``LINK`` names the inter-node link when ``NODES > 1``
(default :data:`DEFAULT_INTER`), else it replaces the model's default intra-node link.

Conventions
-----------
- Rates are per second and per rank: FLOP/s by dtype, bytes/s for memory and links (one direction).
- GPU memory: vendors' "GB" for GPU memory are GiB (an A100 80GB reports 81920 MiB), so the presets
  use ``2**30``-byte units. Network links are quoted in Gbit/s; ``bandwidth`` is that / 8 bytes/s.
- GPU FLOP/s: ``float32`` is the non-tensor-core FP32 peak (PyTorch does not use TF32 for matmul
  by default); ``float16``/``bfloat16`` are dense tensor-core peaks (no 2:4 sparsity); ``float64``
  the FP64 peak. All are datasheet peaks, not achieved rates.
- ``spmm_bandwidth`` is the effective bandwidth of sparse propagation in the byte convention of
  NeutronTask Eq. 6 (Sec. 5.2): a P op over ``|V|`` rows, ``|E| = |V|·d̄`` edges and width ``d``
  moves ``4·(|V|·d̄·(1 + 2d) + |V|)`` bytes (float32 elements). The Eq. 6 P-op time is
  ``γ·2|V|d̄d / FLOPS + (1 − γ)·bytes / spmm_bandwidth``.
- GPU presets take ``spmm_bandwidth = SPMM_DERATE · mem_bandwidth`` (an assumption: a gather of
  random neighbour rows reaches a fraction of STREAM bandwidth) and ``γ = GPU_GAMMA``. NeutronTask
  determines γ "empirically based on hardware characteristics" and reports no value; 0.3 is a
  placeholder to be replaced by a measurement on the target. CPUs use ``γ = 0``: a CPU has no
  separate compute engine to overlap with, and the calibrated ``spmm_bandwidth`` is measured over
  whole SpMM kernels, so Eq. 6 with ``γ = 0`` reproduces the measured time.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..errors import PlanningError

__all__ = [
    "DeviceSpec",
    "LinkSpec",
    "Cluster",
    "DEVICES",
    "LINKS",
    "DEFAULT_INTRA",
    "CLUSTERS",
    "DEFAULT_INTER",
    "GiB",
    "SPMM_DERATE",
    "GPU_GAMMA",
    "CPU_GAMMA",
    "PROFILE_ENV",
    "default_profile_path",
]

GiB = 2**30
SPMM_DERATE = 0.5          # default spmm_bandwidth / mem_bandwidth (assumed, see the module docstring)
GPU_GAMMA = 0.3            # Eq. 6 overlap factor of GPUs (placeholder, see the module docstring)
CPU_GAMMA = 0.0            # Eq. 6 overlap factor of CPUs
DEFAULT_LAUNCH_OVERHEAD = 5e-6   # s per kernel: a CUDA kernel launch; calibration measures the CPU's
DEFAULT_INTER = "ib100"    # inter-node link of a multi-node spec that names none
PROFILE_ENV = "GNNCOMPILE_PROFILE"
_FORMAT = "gnncompile.cluster"
_FORMAT_VERSION = 1
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                  "bf16": "bfloat16", "fp64": "float64", "double": "float64"}
_GRAMMAR = "[NODESx]DEVICESxMODEL[-LINK] (e.g. '4xA5000', '2x4xA5000-ib200', 'A100', '4xcpu') or a preset name"


def default_profile_path() -> Path:
    """Where :meth:`Cluster.parse` looks for a saved CPU profile: ``$GNNCOMPILE_PROFILE`` if set,
    else ``~/.cache/gnncompile/cpu_profile.json``."""
    env = os.environ.get(PROFILE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gnncompile" / "cpu_profile.json"


def _check_number(value: Any, what: str, *, low: float = 0.0, high: float = math.inf,
                  strict: bool = True) -> None:
    """Raise :class:`PlanningError` unless ``value`` is a finite real number above ``low`` (or at
    least ``low`` when not ``strict``) and at most ``high``."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < low or (strict and value == low) or value > high:
        bound = f"> {low:g}" if strict else f">= {low:g}"
        bound += f" and <= {high:g}" if high < math.inf else ""
        raise PlanningError(f"{what} must be a finite number {bound}, got {value!r}")


def _fields_from_dict(cls: type, data: Any, what: str) -> dict[str, Any]:
    """The constructor arguments of dataclass ``cls`` in ``data``; unknown or missing keys raise."""
    if not isinstance(data, dict):
        raise PlanningError(f"{what}: expected a JSON object, got {type(data).__name__}")
    names = {f.name for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    unknown = sorted(set(data) - names - {"format", "version"})
    missing = sorted(required - set(data))
    if unknown or missing:
        raise PlanningError(f"{what}: " + "; ".join(
            ([f"unknown field(s) {', '.join(unknown)}"] if unknown else [])
            + ([f"missing field(s) {', '.join(missing)}"] if missing else [])))
    return {k: v for k, v in data.items() if k in names}


# --------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class DeviceSpec:
    """One rank's compute device.

    Parameters
    ----------
    name : str
        Model name, e.g. ``"A100-80GB"``.
    flops : dict[str, float]
        FLOP/s by dtype name (``"float32"``, ``"float16"``, ``"bfloat16"``, ``"float64"``).
    mem_bandwidth : float
        STREAM-like memory bandwidth, bytes/s.
    memory : int
        Capacity, bytes.
    spmm_bandwidth : float, optional
        Effective bytes/s of sparse propagation (Eq. 6 byte convention); default
        ``SPMM_DERATE * mem_bandwidth``.
    gamma : float, optional
        Eq. 6 compute/memory overlap factor in [0, 1]; default ``GPU_GAMMA`` or ``CPU_GAMMA``.
    launch_overhead : float
        Seconds per kernel launch / operator dispatch.
    kind : str
        ``"gpu"`` or ``"cpu"``.
    runtime : dict[str, float]
        Measured fixed costs of gnncompile's runtime on this device, seconds
        (:func:`gnncompile.runtime.calibrate.runtime_overheads`): ``stage`` per Forward/Backward
        instruction, ``op_forward``/``op_backward`` per op of a stage, ``comm`` per communication
        instruction, ``optimizer_tensor`` per parameter tensor of the optimizer step, ``step``
        per training step outside the instructions (loss, zeroing gradients). Empty for
        presets: the cost models then charge ``launch_overhead`` per op only.
    edge_rate : float, optional
        Edges per second a propagation visits on top of its bytes (random row gathers are
        latency bound at small widths): calibrated from SpMM at two widths; ``None``: bytes only.
    rng_rate : float, optional
        Random numbers per second (dropout masks); ``None``: not charged.
    spmm_curve : tuple of (working set bytes, spmm bandwidth, edge rate)
        Calibrated propagation rates by the size of the gathered source rows (a working set in
        the last-level cache is gathered faster than one in DRAM); empty: ``spmm_bandwidth`` and
        ``edge_rate`` for every size. See :meth:`spmm_rates`.
    """

    name: str
    flops: dict[str, float] = field(hash=False)
    mem_bandwidth: float
    memory: int
    spmm_bandwidth: Optional[float] = None
    gamma: Optional[float] = None
    launch_overhead: float = DEFAULT_LAUNCH_OVERHEAD
    kind: str = "gpu"
    runtime: dict[str, float] = field(default_factory=dict, hash=False)
    edge_rate: Optional[float] = None
    rng_rate: Optional[float] = None
    spmm_curve: tuple[tuple[float, float, float], ...] = ()

    def __post_init__(self) -> None:
        what = f"device {self.name!r}"
        if self.kind not in ("gpu", "cpu"):
            raise PlanningError(f"{what}: kind must be 'gpu' or 'cpu', got {self.kind!r}")
        if not isinstance(self.flops, dict) or not self.flops:
            raise PlanningError(f"{what}: flops must be a non-empty dict of FLOP/s by dtype")
        for dtype, rate in self.flops.items():
            _check_number(rate, f"{what}: flops[{dtype!r}]")
        _check_number(self.mem_bandwidth, f"{what}: mem_bandwidth")
        _check_number(self.memory, f"{what}: memory")
        if self.spmm_bandwidth is None:
            object.__setattr__(self, "spmm_bandwidth", SPMM_DERATE * self.mem_bandwidth)
        _check_number(self.spmm_bandwidth, f"{what}: spmm_bandwidth")
        if self.gamma is None:
            object.__setattr__(self, "gamma", GPU_GAMMA if self.kind == "gpu" else CPU_GAMMA)
        _check_number(self.gamma, f"{what}: gamma", strict=False, high=1.0)
        _check_number(self.launch_overhead, f"{what}: launch_overhead (s)", strict=False)
        object.__setattr__(self, "flops", dict(self.flops))
        object.__setattr__(self, "memory", int(self.memory))
        if not isinstance(self.runtime, dict):
            raise PlanningError(f"{what}: runtime must be a dict of seconds by overhead name")
        for key, value in self.runtime.items():
            _check_number(value, f"{what}: runtime[{key!r}] (s)", strict=False)
        object.__setattr__(self, "runtime", dict(self.runtime))
        for key in ("edge_rate", "rng_rate"):
            if getattr(self, key) is not None:
                _check_number(getattr(self, key), f"{what}: {key}")
        try:
            curve = tuple(sorted((float(w), float(b), float(e)) for w, b, e in self.spmm_curve))
        except (TypeError, ValueError):
            raise PlanningError(f"{what}: spmm_curve must hold (working set, bandwidth, edge rate) triples") from None
        for point in curve:
            for value, name in zip(point, ("working set", "bandwidth", "edge rate")):
                _check_number(value, f"{what}: spmm_curve {name}")
        object.__setattr__(self, "spmm_curve", curve)

    def spmm_rates(self, working_set: float) -> tuple[float, Optional[float]]:
        """``(bandwidth, edge rate)`` of a propagation gathering ``working_set`` bytes of source
        rows: interpolated in log size between the calibrated points, clamped at the ends."""
        curve = self.spmm_curve
        if not curve:
            return self.spmm_bandwidth, self.edge_rate
        if working_set <= curve[0][0]:
            return curve[0][1], curve[0][2]
        for (w0, b0, e0), (w1, b1, e1) in zip(curve, curve[1:]):
            if working_set <= w1:
                f = math.log(working_set / w0) / math.log(w1 / w0)
                return b0 + f * (b1 - b0), e0 + f * (e1 - e0)
        return curve[-1][1], curve[-1][2]

    def flops_for(self, dtype: Union[str, torch.dtype]) -> float:
        """FLOP/s for ``dtype`` (a name such as ``"float32"``/``"bf16"`` or a ``torch.dtype``).

        Raises
        ------
        PlanningError
            The device has no rate for that dtype.
        """
        key = str(dtype).removeprefix("torch.").lower()
        key = _DTYPE_ALIASES.get(key, key)
        try:
            return self.flops[key]
        except KeyError:
            raise PlanningError(f"device {self.name!r} has no FLOP/s for dtype {str(dtype)!r}; "
                                f"known: {', '.join(self.flops)}") from None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DeviceSpec":
        """Inverse of :meth:`to_dict`; malformed data raises :class:`PlanningError`."""
        return cls(**_fields_from_dict(cls, data, "device"))


@dataclass(frozen=True)
class LinkSpec:
    """A link between two ranks: ``bandwidth`` bytes/s per direction, ``latency`` seconds per
    message; ``network`` marks links quoted in Gbit/s (InfiniBand, Ethernet)."""

    name: str
    bandwidth: float
    latency: float
    network: bool = False

    def __post_init__(self) -> None:
        _check_number(self.bandwidth, f"link {self.name!r}: bandwidth")
        _check_number(self.latency, f"link {self.name!r}: latency (s)", strict=False)

    def __str__(self) -> str:
        if self.network:
            return f"{self.name} {_si(self.bandwidth * 8, 'bit/s')}"
        return f"{self.name} {_si(self.bandwidth, 'B/s')}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LinkSpec":
        """Inverse of :meth:`to_dict`; malformed data raises :class:`PlanningError`."""
        return cls(**_fields_from_dict(cls, data, "link"))


def _si(value: float, unit: str) -> str:
    """``value`` with an SI prefix and three significant digits: ``_si(2.78e13, "FLOP/s")``."""
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


# --------------------------------------------------------------------------- presets
def _gpu(name: str, fp32: float, memory_gib: float, bandwidth: float, *, fp16: float, fp64: float,
         bf16: Optional[float] = None) -> DeviceSpec:
    flops = {"float32": fp32, "float16": fp16, "float64": fp64}
    if bf16 is not None:
        flops["bfloat16"] = bf16
    return DeviceSpec(name, flops, bandwidth, int(memory_gib * GiB), kind="gpu")


_V100_16 = _gpu("V100-16GB", 15.7e12, 16, 900e9, fp16=125e12, fp64=7.8e12)
_A100_80 = _gpu("A100-80GB", 19.5e12, 80, 2039e9, fp16=312e12, bf16=312e12, fp64=9.7e12)

DEVICES: dict[str, DeviceSpec] = {
    # NVIDIA RTX A5000 datasheet: 27.8 TFLOPS FP32, 24 GB GDDR6, 768 GB/s, PCIe 4.0 x16; tensor
    # 222.2 TFLOPS with sparsity -> 111.1 dense FP16/BF16; FP64 at 1/32 of FP32 (GA102).
    "A5000": _gpu("A5000", 27.8e12, 24, 768e9, fp16=111.1e12, bf16=111.1e12, fp64=27.8e12 / 32),
    # NVIDIA T4 datasheet: 8.1 TFLOPS FP32, 65 TFLOPS FP16 mixed precision, 16 GB GDDR6, 320 GB/s;
    # FP64 at 1/32 of FP32 (TU104); no BF16.
    "T4": _gpu("T4", 8.1e12, 16, 320e9, fp16=65e12, fp64=8.1e12 / 32),
    # NVIDIA V100 SXM2 datasheet: 15.7 TFLOPS FP32, 7.8 FP64, 125 tensor (FP16), 900 GB/s HBM2,
    # 16 or 32 GB; no BF16. "V100" is the 32 GB part.
    "V100-16GB": _V100_16,
    "V100-32GB": dataclasses.replace(_V100_16, name="V100-32GB", memory=32 * GiB),
    "V100": dataclasses.replace(_V100_16, name="V100-32GB", memory=32 * GiB),
    # NVIDIA A100 SXM datasheet: 19.5 TFLOPS FP32, 9.7 FP64, 312 FP16/BF16 tensor (dense);
    # 40 GB HBM2 at 1,555 GB/s, 80 GB HBM2e at 2,039 GB/s. "A100" is the 80 GB part.
    "A100-40GB": _gpu("A100-40GB", 19.5e12, 40, 1555e9, fp16=312e12, bf16=312e12, fp64=9.7e12),
    "A100-80GB": _A100_80,
    "A100": _A100_80,
    # NVIDIA H100 SXM5 datasheet: 67 TFLOPS FP32, 34 FP64, 989.5 FP16/BF16 tensor (dense; 1,979
    # with sparsity), 80 GB HBM3 at 3.35 TB/s.
    "H100": _gpu("H100", 67e12, 80, 3.35e12, fp16=989.5e12, bf16=989.5e12, fp64=34e12),
    # NVIDIA H200 SXM datasheet: H100 SXM compute, 141 GB HBM3e at 4.8 TB/s.
    "H200": _gpu("H200", 67e12, 141, 4.8e12, fp16=989.5e12, bf16=989.5e12, fp64=34e12),
    # Uncalibrated placeholder for a CPU host (all cores together), not a measurement: rough rates
    # of a small server. Cluster.calibrate() measures the real host and parse() prefers its profile.
    "cpu": DeviceSpec("cpu", {"float32": 1e11, "float64": 5e10}, 20e9, 16 * GiB, kind="cpu"),
}

LINKS: dict[str, LinkSpec] = {
    # PCIe x16 per direction: 3.0 is 15.75 GB/s raw, ~12 GB/s achieved; 4.0 is 31.5 raw, ~25
    # achieved. Latency of a small peer-to-peer/NCCL message: a few microseconds.
    "pcie3": LinkSpec("pcie3", 12e9, 5e-6),
    "pcie4": LinkSpec("pcie4", 25e9, 5e-6),
    # NVLink per GPU, per direction, all links together (NVIDIA's figures are bidirectional:
    # 300/600/900 GB/s): V100 6 x 25 GB/s, A100 12 x 25, H100/H200 18 x 25. In a V100 hybrid
    # cube-mesh (DGX-1, p3.16xlarge) one pair of GPUs shares only 1-2 of those links.
    "nvlink2": LinkSpec("nvlink2", 150e9, 3e-6),
    "nvlink3": LinkSpec("nvlink3", 300e9, 3e-6),
    "nvlink4": LinkSpec("nvlink4", 450e9, 3e-6),
    # InfiniBand EDR/HDR/NDR: Gbit/s / 8; ~1-2 us through the switch plus the software stack: 3 us.
    "ib100": LinkSpec("ib100", 100e9 / 8, 3e-6, network=True),
    "ib200": LinkSpec("ib200", 200e9 / 8, 3e-6, network=True),
    "ib400": LinkSpec("ib400", 400e9 / 8, 3e-6, network=True),
    # Ethernet over TCP: 20-50 us per message; 15 Gbit/s is NeutronTP's T4 cluster (Sec. 5.1),
    # 10 and 100 Gbit/s common datacenter NICs.
    "eth10": LinkSpec("eth10", 10e9 / 8, 50e-6, network=True),
    "eth15": LinkSpec("eth15", 15e9 / 8, 30e-6, network=True),
    "eth100": LinkSpec("eth100", 100e9 / 8, 20e-6, network=True),
    # Ranks on one host talking through gloo (loopback TCP / shared memory). Uncalibrated
    # placeholder; Cluster.calibrate() measures it.
    "shm": LinkSpec("shm", 5e9, 20e-6),
}

DEFAULT_INTRA: dict[str, str] = {
    "A5000": "pcie4", "T4": "pcie3", "V100-16GB": "nvlink2", "V100-32GB": "nvlink2", "V100": "nvlink2",
    "A100-40GB": "nvlink3", "A100-80GB": "nvlink3", "A100": "nvlink3", "H100": "nvlink4", "H200": "nvlink4",
    "cpu": "shm",
}


def _lookup(name: str, table: dict[str, Any]) -> Optional[str]:
    """The key of ``table`` equal to ``name`` ignoring case, or ``None``."""
    return next((k for k in table if k.lower() == name.lower()), None)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


# --------------------------------------------------------------------------- clusters
@dataclass(frozen=True)
class Cluster:
    """``nodes`` machines of ``devices_per_node`` ranks of ``device``.

    Parameters
    ----------
    nodes, devices_per_node : int
        Machines, and ranks per machine (GPUs, or processes on a CPU host).
    device : DeviceSpec
        The device of every rank; for CPUs the whole host (all cores), see :meth:`rank_device`.
    intra, inter : LinkSpec
        Links inside a machine and between machines (``inter`` required when ``nodes > 1``).
    name : str
        A label (the spec it was parsed from, a preset name, ...).
    cores : int
        Usable cores of each CPU host (0 for GPU clusters).
    threads_per_rank : int, optional
        Threads of each CPU rank; ``None``: ``max(1, cores // devices_per_node)`` (the launcher's default).
    calibration : dict
        Raw measurements of :meth:`calibrate` (JSON types only); empty when uncalibrated.
    """

    nodes: int
    devices_per_node: int
    device: DeviceSpec
    intra: LinkSpec
    inter: Optional[LinkSpec] = None
    name: str = ""
    cores: int = 0
    threads_per_rank: Optional[int] = None
    calibration: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        what = f"cluster {self.name!r}"
        minimum = {"nodes": 1, "devices_per_node": 1, "cores": 1 if self.device.kind == "cpu" else 0,
                   "threads_per_rank": 1}
        for key, low in minimum.items():
            value = getattr(self, key)
            if key == "threads_per_rank" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise PlanningError(f"{what}: {key} must be an integer >= {low}, got {value!r}")
        if self.nodes > 1 and self.inter is None:
            raise PlanningError(f"{what}: {self.nodes} nodes need an inter-node link")
        if not isinstance(self.calibration, dict):
            raise PlanningError(f"{what}: calibration must be a dict, got {type(self.calibration).__name__}")

    # --- topology
    @property
    def num_devices(self) -> int:
        """Ranks in the cluster."""
        return self.nodes * self.devices_per_node

    def node_of(self, rank: int) -> int:
        """The node of ``rank`` (ranks are numbered node by node)."""
        if not 0 <= rank < self.num_devices:
            raise PlanningError(f"rank {rank} out of range: cluster {self.name!r} has {self.num_devices} ranks")
        return rank // self.devices_per_node

    def link(self, a: int, b: int) -> LinkSpec:
        """The link between ranks ``a`` and ``b``: ``intra`` on one node, else ``inter``."""
        if self.node_of(a) == self.node_of(b):
            return self.intra
        assert self.inter is not None  # __post_init__: several nodes have an inter link
        return self.inter

    def slowest_link(self, group: Sequence[int]) -> LinkSpec:
        """The lowest-bandwidth link between two ranks of ``group`` (ties: the higher latency).

        A group of one rank crosses no link; it gets ``intra``.
        """
        if not group:
            raise PlanningError("slowest_link: empty group of ranks")
        per_node: dict[int, int] = {}
        for rank in group:
            node = self.node_of(rank)
            per_node[node] = per_node.get(node, 0) + 1
        links = [self.inter] if len(per_node) > 1 else []
        if len(per_node) == 1 or max(per_node.values()) > 1:
            links.append(self.intra)
        return min(links, key=lambda link: (link.bandwidth, -link.latency))

    @property
    def oversubscription(self) -> float:
        """How many times over a CPU host's cores its ranks' threads are (>= 1; 1 for GPUs).

        Time-shared cores stretch everything a rank does on the CPU, including the latency of a
        message, which waits for the peer process to be scheduled.
        """
        if self.device.kind != "cpu":
            return 1.0
        threads = self.threads_per_rank or max(1, self.cores // self.devices_per_node)
        return max(1.0, self.devices_per_node * threads / self.cores)

    def collective_link(self, op: str) -> LinkSpec:
        """The link a collective ``op`` (``"all_reduce"``, ``"all_to_all"``) sees inside a node.

        A calibrated CPU host measured each collective of its backend separately (gloo's
        all-reduce has a higher latency floor than a plain exchange); the fit is returned as a
        per-ring-step link (``latency / (2 (p - 1))`` of the fitted ``p``-rank all-reduce).
        Otherwise: :attr:`intra`.
        """
        fits = self.calibration.get("collectives", {}).get("fits", {})
        if op not in fits:
            return self.intra
        fit = fits[op]
        p = int(self.calibration["collectives"].get("world_size", 2))
        steps = 2 * (p - 1) if op == "all_reduce" else max(p - 1, 1)
        return LinkSpec(f"{self.intra.name}:{op}", fit["bandwidth"], fit["latency"] / steps)

    def rank_device(self, rank: int = 0) -> DeviceSpec:
        """The device as rank ``rank`` sees it.

        GPUs: :attr:`device`. CPUs: the ``devices_per_node`` ranks of a host time-share its
        ``cores``. A rank with ``t`` threads gets rate ``r(t) · min(1, cores / (ranks · t))`` for
        FLOP/s, ``mem_bandwidth`` and ``spmm_bandwidth``, where ``r`` interpolates linearly in
        threads between the calibrated single-thread and all-core rates; past ``cores`` it grows
        on with that slope if positive, else stays flat (one core: ``r(t) = t · r(1)``). An
        uncalibrated host assumes linear scaling of its all-core rates. ``memory`` is the host's
        split evenly among its ranks.
        """
        self.node_of(rank)
        if self.device.kind != "cpu":
            return self.device
        ranks = self.devices_per_node
        threads = self.threads_per_rank or max(1, self.cores // ranks)
        share = min(1.0, self.cores / (ranks * threads))

        def rate(pair: Sequence[float]) -> float:
            single, all_cores = pair
            if self.cores == 1:
                return single * threads * share
            slope = (all_cores - single) / (self.cores - 1)
            within = min(threads, self.cores)
            return (single + slope * (within - 1) + max(0.0, slope) * (threads - within)) * share

        rates = self._thread_rates()
        return dataclasses.replace(
            self.device,
            flops={dtype: rate(pair) for dtype, pair in rates["flops"].items()},
            mem_bandwidth=rate(rates["mem_bandwidth"]),
            spmm_bandwidth=rate(rates["spmm_bandwidth"]),
            edge_rate=rate(rates["edge_rate"]) if "edge_rate" in rates else self.device.edge_rate,
            rng_rate=rate(rates["rng_rate"]) if "rng_rate" in rates else self.device.rng_rate,
            spmm_curve=tuple((p["working_set"], rate(p["bandwidth"]), rate(p["edge_rate"]))
                             for p in self.calibration.get("spmm_curve", [])) or self.device.spmm_curve,
            memory=self.device.memory // ranks,
            # fixed costs are CPU time too: time-shared cores stretch them
            launch_overhead=self.device.launch_overhead / share,
            runtime={k: v / share for k, v in self.device.runtime.items()},
        )

    def _thread_rates(self) -> dict[str, Any]:
        """``{"flops": {dtype: [single, all_cores]}, "mem_bandwidth": [...], "spmm_bandwidth": [...]}``."""
        if "rates" in self.calibration:
            return self.calibration["rates"]
        d, n = self.device, self.cores
        return {"flops": {k: [v / n, v] for k, v in d.flops.items()},
                "mem_bandwidth": [d.mem_bandwidth / n, d.mem_bandwidth],
                "spmm_bandwidth": [d.spmm_bandwidth / n, d.spmm_bandwidth]}

    def __str__(self) -> str:
        d = self.device
        fp32 = d.flops.get("float32")
        memory = f"{d.memory / GiB:.3g} GiB"
        if d.kind == "cpu" and self.devices_per_node > 1:  # rank_device splits the host's memory
            memory += f" host memory shared by {self.devices_per_node} ranks"
        text = (f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.devices_per_node} {d.name} "
                f"({memory}" + (f", {_si(fp32, 'FLOP/s')} fp32)" if fp32 else ")"))
        if d.kind == "cpu":
            text += f", {self.cores} core{'s' if self.cores > 1 else ''}"
            text += "" if self.calibration else " (uncalibrated)"
        text += f", intra {self.intra}"
        if self.inter is not None and self.nodes > 1:
            text += f", inter {self.inter}"
        return text

    # --- serialization
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (with a ``format`` tag and ``version``)."""
        data = dataclasses.asdict(self)
        return {"format": _FORMAT, "version": _FORMAT_VERSION, **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Cluster":
        """Inverse of :meth:`to_dict`; malformed data raises :class:`PlanningError`."""
        if isinstance(data, dict) and data.get("format", _FORMAT) != _FORMAT:
            raise PlanningError(f"not a cluster description (format {data.get('format')!r}, expected {_FORMAT!r})")
        if isinstance(data, dict) and data.get("version", _FORMAT_VERSION) != _FORMAT_VERSION:
            raise PlanningError(f"cluster description version {data.get('version')!r} unsupported "
                                f"(expected {_FORMAT_VERSION})")
        kwargs = _fields_from_dict(cls, data, "cluster")
        kwargs["device"] = DeviceSpec.from_dict(kwargs["device"])
        kwargs["intra"] = LinkSpec.from_dict(kwargs["intra"])
        if kwargs.get("inter") is not None:
            kwargs["inter"] = LinkSpec.from_dict(kwargs["inter"])
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise PlanningError(f"cluster: {exc}") from exc

    def save(self, path: Union[str, Path]) -> Path:
        """Write :meth:`to_dict` as JSON to ``path`` (parents created); return the path."""
        path = Path(path).expanduser()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
            tmp.replace(path)
        except OSError as exc:
            raise PlanningError(f"cannot write cluster profile {path}: {exc}") from exc
        return path

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Cluster":
        """Read a cluster saved by :meth:`save`; any problem raises :class:`PlanningError` naming the file."""
        path = Path(path).expanduser()
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise PlanningError(f"cannot read cluster profile {path}: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise PlanningError(f"cluster profile {path} is not valid JSON: {exc}") from exc
        try:
            return cls.from_dict(data)
        except PlanningError as exc:
            raise PlanningError(f"cluster profile {path}: {exc}") from exc

    # --- construction
    @classmethod
    def local(cls, num_ranks: int, profile: Union["Cluster", str, Path, None] = None) -> "Cluster":
        """``num_ranks`` ranks on this machine: on its GPUs when CUDA is available (the model from
        ``torch.cuda.get_device_name`` matched against :data:`DEVICES`), else CPU processes costed
        with the calibrated profile (see :meth:`parse`; uncalibrated without one).

        With more ranks than GPUs the ranks share them (the runtime's shared-GPU mode: rank ``r`` on
        GPU ``r % GPUs``, gloo through host memory): each rank is costed as its share of a GPU
        (memory, FLOP/s and bandwidth divided by the ranks per GPU) and the ranks talk over
        ``shm``. ``$GNNCOMPILE_DEVICE=cpu`` (the runtime's default device) plans for CPU ranks on a
        GPU machine too. Raises :class:`PlanningError` for a GPU model the presets do not know (name it
        with ``Cluster.parse("4xA100")`` or a :class:`Cluster` of your own).
        """
        if not torch.cuda.is_available() or os.environ.get("GNNCOMPILE_DEVICE", "").strip().lower() == "cpu":
            return cls.parse(f"{num_ranks}xcpu", profile=profile)
        name = torch.cuda.get_device_name(0)
        gpus = torch.cuda.device_count()
        known = sorted((k for k in DEVICES if k != "cpu" and k.split("-")[0].lower() in name.lower()),
                       key=lambda k: (-len(k), k))
        mem = torch.cuda.get_device_properties(0).total_memory
        match = next((k for k in known if abs(DEVICES[k].memory - mem) <= 0.1 * DEVICES[k].memory), None)
        if match is None:
            raise PlanningError(f"GPU {name!r} ({mem / 2**30:.0f} GiB) is not among the device presets "
                                f"({', '.join(DEVICES)}); pass a cluster, e.g. gpus='{num_ranks}xA100'")
        if num_ranks <= gpus:
            return cls.parse(f"{num_ranks}x{match}")
        return cls.shared_gpus(num_ranks, gpus, DEVICES[match])

    @classmethod
    def shared_gpus(cls, num_ranks: int, num_gpus: int, device: DeviceSpec) -> "Cluster":
        """``num_ranks`` ranks sharing ``num_gpus`` GPUs of model ``device`` on one machine.

        Each rank is costed as ``1/k`` of a GPU, ``k = ceil(num_ranks / num_gpus)`` ranks per GPU:
        its memory, FLOP/s and bandwidths divided by ``k``; ranks communicate through host memory
        (``shm``), as the runtime's gloo path does.
        """
        if num_gpus < 1 or num_ranks < 1:
            raise PlanningError(f"shared_gpus: need at least one rank and one GPU, got {num_ranks} and {num_gpus}")
        share = -(-num_ranks // num_gpus)
        spec = dataclasses.replace(
            device, name=f"{device.name}/{share}", memory=device.memory // share,
            flops={k: v / share for k, v in device.flops.items()}, mem_bandwidth=device.mem_bandwidth / share,
            spmm_bandwidth=device.spmm_bandwidth / share,
            edge_rate=None if device.edge_rate is None else device.edge_rate / share)
        return cls(1, num_ranks, spec, LINKS["shm"], name=f"{num_ranks} ranks sharing {num_gpus}x{device.name}")

    @property
    def calibrated(self) -> bool:
        """Whether the device numbers come from measurement (CPU profile) or datasheets (GPU presets)."""
        return self.device.kind != "cpu" or bool(self.calibration)

    @classmethod
    def parse(cls, text: str, profile: Union["Cluster", str, Path, None] = None) -> "Cluster":
        """A cluster from ``[NODESx]DEVICESxMODEL[-LINK]``, a bare ``MODEL`` or a preset name.

        Model, link and preset names are case-insensitive. ``LINK`` is the inter-node link when
        ``NODES > 1`` (default :data:`DEFAULT_INTER`), else it replaces the intra-node link.
        ``cpu`` models take their device, cores, intra link and calibration from ``profile`` (a
        calibrated :class:`Cluster` or the path of a saved one), else from the saved profile at
        :func:`default_profile_path` if it exists, else the uncalibrated placeholder with this
        host's usable cores. ``profile`` is ignored for GPU models.

        Raises
        ------
        PlanningError
            Malformed text, unknown model or link (the message lists the valid ones), a
            profile that cannot be read.
        """
        spec = text.strip() if isinstance(text, str) else ""
        preset = _lookup(spec, CLUSTERS)
        if preset is not None:
            return CLUSTERS[preset]
        match = re.fullmatch(r"(?:(\d+)x)?(?:(\d+)x)?([A-Za-z].*)", spec, re.IGNORECASE)
        if not match:
            raise PlanningError(f"cannot parse cluster spec {text!r}; expected {_GRAMMAR}; "
                                f"models: {', '.join(DEVICES)}; links: {', '.join(LINKS)}; "
                                f"presets: {', '.join(CLUSTERS)}")
        first, second, rest = match.groups()
        nodes, per_node = (int(first), int(second)) if second else (1, int(first or 1))
        if nodes < 1 or per_node < 1:
            raise PlanningError(f"cluster spec {text!r}: node and device counts must be >= 1")
        model, link = _lookup(rest, DEVICES), None
        if model is None and "-" in rest:
            head, _, tail = rest.rpartition("-")
            model, link = _lookup(head, DEVICES), tail
            if model is not None and _lookup(link, LINKS) is None:
                raise PlanningError(f"unknown link {link!r} in cluster spec {text!r}; valid: {', '.join(LINKS)}")
        if model is None:
            raise PlanningError(f"unknown device model {rest.rpartition('-')[0] or rest!r} in cluster spec "
                                f"{text!r}; valid: {', '.join(DEVICES)}; links: {', '.join(LINKS)}; "
                                f"presets: {', '.join(CLUSTERS)}; grammar: {_GRAMMAR}")
        link_key = _lookup(link, LINKS) if link is not None else None
        link_spec = LINKS[link_key] if link_key is not None else None
        intra = LINKS[DEFAULT_INTRA[model]]
        inter = None
        if nodes > 1:
            inter = link_spec or LINKS[DEFAULT_INTER]
        elif link_spec is not None:
            intra = link_spec
        device, cores, calibration = DEVICES[model], 0, {}
        if device.kind == "cpu":
            host = _cpu_profile(profile)
            if host is None:
                cores = _usable_cores()
            else:
                device, cores, calibration = host.device, host.cores, host.calibration
                intra = link_spec if (link_spec is not None and nodes == 1) else host.intra
        name = (f"{nodes}x" if nodes > 1 else "") + f"{per_node}x{model}" + (f"-{link_key}" if link_key else "")
        return cls(nodes, per_node, device, intra, inter, name=name, cores=cores, calibration=calibration)

    @classmethod
    def calibrate(cls, path: Union[str, Path, None] = None, *, quick: bool = False, backend: str = "gloo",
                  world_size: int = 2) -> "Cluster":
        """Measure this host's CPU and the collectives of ``backend`` between local ranks.

        Measures, at one thread and at all usable cores: float32/float64 GEMM FLOP/s
        (``torch.mm``, best over square sizes), STREAM-like bandwidth (copy and add of 64 MB
        arrays; the better of the two), SpMM effective bandwidth (``kernels.spmm`` on a random
        graph of uniform degree 10, width 64, in the Eq. 6 byte convention). Also the time of a
        tiny torch op (``launch_overhead``) and, over ``world_size`` launched ranks,
        ``all_reduce`` and ``all_to_all_single`` at three message sizes, each fitted as
        ``latency + bus_bytes / bandwidth`` (bus bytes as nccl-tests: ``2(p-1)/p·size`` for
        all-reduce, ``(p-1)/p·size`` for all-to-all; least squares on relative error). The
        ``shm`` link takes the all-to-all fit (a plain exchange of data); gloo's all-reduce has a
        higher latency floor on small messages, kept in ``calibration["collectives"]["fits"]``.
        The local rates are measured in a launched rank (a fresh process, as ranks run).

        Returns a one-node, one-rank cluster whose device holds the all-core rates, with the
        raw measurements in :attr:`calibration`; saved as JSON to ``path`` when given.
        ``quick`` uses smaller problems and fewer repeats (a few seconds on 2 cores).
        """
        if world_size < 2:
            raise PlanningError(f"calibrate: world_size must be >= 2 to measure a link, got {world_size}")
        cores = _usable_cores()
        host = socket.gethostname()
        local = _measure_local(cores, quick)
        comm = _measure_collectives(backend, world_size, quick)
        rates = local["rates"]
        device = DeviceSpec(
            name=f"cpu ({host})",
            flops={dtype: pair[1] for dtype, pair in rates["flops"].items()},
            mem_bandwidth=rates["mem_bandwidth"][1],
            memory=_total_memory(),
            spmm_bandwidth=rates["spmm_bandwidth"][1],
            edge_rate=rates["edge_rate"][1],
            rng_rate=rates["rng_rate"][1],
            spmm_curve=tuple((p["working_set"], p["bandwidth"][1], p["edge_rate"][1]) for p in local["spmm_curve"]),
            gamma=CPU_GAMMA,
            launch_overhead=local["op_overhead"]["seconds"],
            kind="cpu",
        )
        from ..runtime.calibrate import runtime_overheads  # lazy: it plans and runs a small model

        device = dataclasses.replace(device, runtime=runtime_overheads(
            cls(1, 1, device, LinkSpec("shm", comm["bandwidth"], comm["latency"]), cores=cores), quick=quick))
        calibration = {
            "host": host,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "quick": quick,
            "cores": cores,
            "threads": [1, cores],
            **local,
            "collectives": comm,
        }
        cluster = cls(1, 1, device, LinkSpec("shm", comm["bandwidth"], comm["latency"]),
                      name=f"cpu (calibrated {host})", cores=cores, calibration=calibration)
        if path is not None:
            cluster.save(path)
        return cluster


def _cpu_profile(profile: Union[Cluster, str, Path, None]) -> Optional[Cluster]:
    """The CPU profile :meth:`Cluster.parse` uses (see there), or ``None`` for the placeholder."""
    if profile is None:
        default = default_profile_path()
        if not default.is_file():
            return None
        profile = default
    host = profile if isinstance(profile, Cluster) else Cluster.load(profile)
    if host.device.kind != "cpu":
        raise PlanningError(f"profile {host.name!r} describes a {host.device.kind.upper()} cluster, not a CPU host")
    return host


def _preset(name: str, nodes: int, per_node: int, model: str, inter: Optional[str] = None) -> Cluster:
    return Cluster(nodes, per_node, DEVICES[model], LINKS[DEFAULT_INTRA[model]],
                   LINKS[inter] if inter else None, name=name)


CLUSTERS: dict[str, Cluster] = {
    # NeutronTask Sec. 6.1: one server, 4 x A5000 (24 GB) on PCIe 4.0 x16.
    "neutrontask": _preset("neutrontask", 1, 4, "A5000"),
    # NeutronTP Sec. 5.1: Aliyun ECS cluster of 16 nodes, each one Tesla T4, 15 Gbps network.
    "neutrontp": _preset("neutrontp", 16, 1, "T4", "eth15"),
    # GNNPipe Sec. 5.1: 2 nodes x 4 A5000, PCIe 4.0 x16 inside a node, 200 Gbps InfiniBand across.
    "gnnpipe": _preset("gnnpipe", 2, 4, "A5000", "ib200"),
    # GSplit Sec. 6.1: AWS p3.8xlarge, 4 x V100 (16 GB) connected by NVLink (fully, per its
    # artifact appendix A.3.1); its 8-GPU runs use a p3.16xlarge, whose NVLink mesh is not
    # all-to-all (Sec. 6.4).
    "gsplit": _preset("gsplit", 1, 4, "V100-16GB"),
    "gsplit8": _preset("gsplit8", 1, 8, "V100-16GB"),
}


# --------------------------------------------------------------------------- calibration
def _best_time(fn: Callable[[], Any], repeats: int, budget: float) -> float:
    """The shortest of up to ``repeats`` timed calls of ``fn`` after one warm-up call; stops
    early once ``budget`` seconds have been spent timing."""
    fn()
    best, start = math.inf, time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        if time.perf_counter() - start > budget:
            break
    return best


def _total_memory() -> int:
    """Physical memory of this host, bytes."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024


def _measure_local(cores: int, quick: bool) -> dict[str, Any]:
    """Local rates at all cores and at one thread, measured in one launched rank.

    A fresh process, as ranks are, that lowers its thread count instead of raising it: on some
    hosts raising ``torch.set_num_threads`` after parallel work leaves later kernels running
    several times slower.
    """
    from ..runtime.launcher import launch

    threads = [cores, 1] if cores > 1 else [1]
    return launch(_local_rank, 1, (threads, quick), backend="gloo", timeout=120, threads_per_rank=cores)[0]


def _local_rank(ctx: Any, threads: list[int], quick: bool) -> dict[str, Any]:
    """Run in a launched rank: GEMM, STREAM and SpMM rates at each of ``threads`` (in that order),
    and the per-op overhead at one thread."""
    from ..frontend.ops import propagate
    from ..graph.core import Graph
    from ..runtime.kernels import default_backend

    repeats, budget = (3, 0.3) if quick else (7, 1.5)
    sizes = [256, 512] if quick else [256, 512, 1024]
    stream_elems = (64 * 2**20) // 4
    degree, width, narrow = 10, 64, 4
    # working sets from one that fits in the last-level cache to one that does not
    spmm_rows = [16_000, 50_000] if quick else [16_000, 64_000, 200_000]
    gen = torch.Generator().manual_seed(0)
    spmm_cases = []
    for rows in spmm_rows:
        # the propagation the models run (GCN normalization, implicit self loops), uniform random edges
        graph = Graph.from_edge_index(torch.stack([torch.randint(0, rows, (rows * degree,), generator=gen),
                                                   torch.arange(rows).repeat_interleave(degree)]), rows)
        nnz = graph.num_edges + rows
        spmm_cases.append({
            "graph": graph, "rows": rows, "nnz": nnz, "working_set": 4 * rows * width,
            "x": torch.randn(rows, width, generator=gen), "x_narrow": torch.randn(rows, narrow, generator=gen),
            "bytes": 4 * (nnz * (1 + 2 * width) + rows), "narrow_bytes": 4 * (nnz * (1 + 2 * narrow) + rows),
            "seconds": {}, "narrow_seconds": {}})
    a, b, c = (torch.rand(stream_elems, generator=gen) for _ in range(3))
    gemm_inputs = {(dtype, n): (torch.rand(n, n, dtype=getattr(torch, dtype), generator=gen),
                                torch.rand(n, n, dtype=getattr(torch, dtype), generator=gen))
                   for dtype in ("float32", "float64") for n in sizes}

    gemm: dict[str, dict[str, list[float]]] = {"float32": {}, "float64": {}}
    stream: dict[str, dict[str, float]] = {}
    rng_s: dict[str, float] = {}
    noise = torch.empty(stream_elems // 4)
    for t in threads:
        torch.set_num_threads(t)
        for (dtype, n), (p, q) in gemm_inputs.items():
            out = torch.empty_like(p)
            gemm[dtype].setdefault(str(t), []).append(_best_time(lambda: torch.mm(p, q, out=out), repeats, budget))
        stream[str(t)] = {"copy": _best_time(lambda: c.copy_(a), repeats, budget),
                          "add": _best_time(lambda: torch.add(a, b, out=c), repeats, budget)}
        for case in spmm_cases:
            g = case["graph"]
            for key, xs in (("seconds", case["x"]), ("narrow_seconds", case["x_narrow"])):
                case[key][str(t)] = _best_time(lambda: propagate(g, xs, norm="gcn", add_self_loops=True),
                                               repeats, budget)
        rng_s[str(t)] = _best_time(lambda: noise.bernoulli_(0.5), repeats, budget)
    tiny, ops = torch.zeros(1), 200
    op_overhead = _best_time(lambda: [tiny.add_(1.0) for _ in range(ops)], repeats, budget) / ops

    def pair(per_thread: Callable[[str], float]) -> list[float]:
        """``[single thread, all cores]`` of a rate."""
        return [per_thread(str(min(threads))), per_thread(str(max(threads)))]

    def fit(case: dict[str, Any], t: str) -> tuple[float, float]:
        return _spmm_fit(case["nnz"], (case["narrow_bytes"], case["narrow_seconds"][t]),
                         (case["bytes"], case["seconds"][t]))

    large = spmm_cases[-1]
    array_bytes = 4 * stream_elems
    return {
        "rates": {
            "flops": {dtype: pair(lambda t, d=dtype: max(2 * n**3 / s for n, s in zip(sizes, gemm[d][t])))
                      for dtype in gemm},
            "mem_bandwidth": pair(lambda t: max(2 * array_bytes / stream[t]["copy"],
                                                3 * array_bytes / stream[t]["add"])),
            "spmm_bandwidth": pair(lambda t: fit(large, t)[1]),
            "edge_rate": pair(lambda t: fit(large, t)[0]),
            "rng_rate": pair(lambda t: noise.numel() / rng_s[t]),
        },
        "rng": {"op": "bernoulli_(0.5)", "elements": noise.numel(), "seconds": rng_s},
        "gemm": {"sizes": sizes, "seconds": gemm},
        "stream": {"array_bytes": array_bytes, "bytes_moved": {"copy": 2 * array_bytes, "add": 3 * array_bytes},
                   "seconds": stream},
        "spmm": {"op": "ops.propagate(norm='gcn', add_self_loops=True)", "backend": default_backend("cpu"),
                 "degree": degree, "widths": [width, narrow],
                 "bytes_convention": "4*(nnz*(1+2*width)+rows), NeutronTask Eq. 6; nnz with self loops",
                 "cases": [{k: v for k, v in case.items() if k not in ("graph", "x", "x_narrow")}
                           for case in spmm_cases]},
        "spmm_curve": [{"working_set": case["working_set"], "bandwidth": pair(lambda t, c=case: fit(c, t)[1]),
                        "edge_rate": pair(lambda t, c=case: fit(c, t)[0])} for case in spmm_cases],
        "op_overhead": {"op": "add_ on a 1-element tensor, 1 thread", "seconds": op_overhead},
    }


def _spmm_fit(edges: int, narrow: tuple[float, float], wide: tuple[float, float]) -> tuple[float, float]:
    """``(edges/s, bytes/s)`` of ``t = edges / edge_rate + bytes / bandwidth`` through two SpMMs of
    different widths (``(bytes, seconds)`` each). Without a per-edge term to find (the narrow one
    is not slower per byte), the edge rate is effectively unlimited and the bandwidth the wide one's."""
    (b1, t1), (b2, t2) = narrow, wide
    per_byte = (t2 - t1) / (b2 - b1) if b2 != b1 else 0.0
    per_edge = (t1 - b1 * per_byte) / edges if per_byte > 0 else 0.0
    if per_byte <= 0 or per_edge <= 0:
        return 1e18, b2 / t2
    return 1.0 / per_edge, 1.0 / per_byte


def _collective_rank(ctx: Any, sizes: list[int], batches: int, iters: list[int]) -> dict[str, list[float]]:
    """Run on each launched rank: seconds per ``all_reduce`` / ``all_to_all_single`` of each size
    (the best over ``batches`` of ``iters[i]`` back-to-back calls)."""
    import torch.distributed as dist

    sync = torch.cuda.synchronize if ctx.device.type == "cuda" else (lambda: None)
    result: dict[str, list[float]] = {"all_reduce": [], "all_to_all": []}
    for nbytes, k in zip(sizes, iters):
        src = torch.zeros(nbytes // 4, device=ctx.device)
        dst = torch.empty_like(src)
        for op, call in (("all_reduce", lambda: dist.all_reduce(src)),
                         ("all_to_all", lambda: dist.all_to_all_single(dst, src))):
            call()
            best = math.inf
            for _ in range(batches):
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                for _ in range(k):
                    call()
                sync()
                best = min(best, (time.perf_counter() - t0) / k)
            result[op].append(best)
    return result


def _fit_latency_bandwidth(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """``(latency, bandwidth)`` of ``seconds ≈ latency + nbytes / bandwidth``, least squares on
    relative error; latency clamped to >= 1e-7 s, and a bandwidth from the largest message if
    the fitted slope is not positive."""
    w = [1 / t**2 for t in seconds]
    s = sum(w)
    sx = sum(wi * x for wi, x in zip(w, nbytes))
    sxx = sum(wi * x * x for wi, x in zip(w, nbytes))
    st = sum(wi * t for wi, t in zip(w, seconds))
    sxt = sum(wi * x * t for wi, x, t in zip(w, nbytes, seconds))
    det = s * sxx - sx * sx
    alpha, beta = ((sxx * st - sx * sxt) / det, (s * sxt - sx * st) / det) if det > 0 else (0.0, 0.0)
    alpha = max(alpha, 1e-7)
    if beta <= 0:
        x_max, t_max = max(zip(nbytes, seconds))
        beta = max(t_max - alpha, t_max / 2) / x_max
    return alpha, 1 / beta


def _measure_collectives(backend: str, world_size: int, quick: bool) -> dict[str, Any]:
    """Launch ``world_size`` ranks and fit latency and bandwidth of their collectives."""
    from ..runtime.launcher import launch

    sizes = [4 * 2**10, 256 * 2**10, 4 * 2**20] if quick else [4 * 2**10, 2**20, 16 * 2**20]
    sizes = [s - s % (4 * world_size) for s in sizes]
    iters, batches = ([20, 5, 2], 3) if quick else ([50, 10, 3], 5)
    per_rank = launch(_collective_rank, world_size, (sizes, batches, iters), backend=backend, timeout=120)
    seconds = {op: [max(r[op][i] for r in per_rank) for i in range(len(sizes))] for op in per_rank[0]}
    factor = {"all_reduce": 2 * (world_size - 1) / world_size, "all_to_all": (world_size - 1) / world_size}
    fits = {op: _fit_latency_bandwidth([factor[op] * s for s in sizes], seconds[op]) for op in seconds}
    latency, bandwidth = fits["all_to_all"]
    return {"backend": backend, "world_size": world_size, "sizes": sizes, "seconds": seconds,
            "bus_factor": factor, "fits": {op: {"latency": a, "bandwidth": b} for op, (a, b) in fits.items()},
            "link_from": "all_to_all", "latency": latency, "bandwidth": bandwidth}
