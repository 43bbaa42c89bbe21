"""Device and link specifications and their presets, for the cost models.

A :class:`DeviceSpec` is one rank's compute device (FLOP/s by dtype, memory bandwidth and capacity,
sparse-propagation rates, measured runtime overheads); a :class:`LinkSpec` a link between two ranks.
:data:`DEVICES` and :data:`LINKS` are the presets, with their datasheet sources; :data:`DEFAULT_INTRA`
names each device model's intra-node link. Clusters of them are in
:mod:`gnncompile.cost_models.hardware`; measuring a host is :func:`gnncompile.calibrate`.

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
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from ..errors import PlanningError

__all__ = [
    "DeviceSpec",
    "LinkSpec",
    "DEVICES",
    "LINKS",
    "DEFAULT_INTRA",
    "GiB",
    "SPMM_DERATE",
    "GPU_GAMMA",
    "CPU_GAMMA",
    "DEFAULT_LAUNCH_OVERHEAD",
]

GiB = 2**30
#: time of a transposed product by scattering from the forward CSR (a backward whose graph holds no
#: transposed copy: ``ops.set_backward_product(g, "push")``) over the pull through a cached
#: transpose, assumed where calibration did not measure it (the native CPU kernel measured 1.2-2.1x
#: on R-MAT 100k/2M at d = 256-16; cuSPARSE's op(A) = A^T accumulates with atomics)
PUSH_FACTOR = 1.5
SPMM_DERATE = 0.5          # default spmm_bandwidth / mem_bandwidth (assumed, see the module docstring)
HOST_LINK = 25e9           # host -> GPU bytes/s: a PCIe 4.0 x16 link as achieved (31.5 GB/s raw)
GPU_GAMMA = 0.3            # Eq. 6 overlap factor of GPUs (placeholder, see the module docstring)
CPU_GAMMA = 0.0            # Eq. 6 overlap factor of CPUs
DEFAULT_LAUNCH_OVERHEAD = 5e-6   # s per kernel: a CUDA kernel launch; calibration measures the CPU's
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                  "bf16": "bfloat16", "fp64": "float64", "double": "float64"}


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
def _gemm_points(curve: Any, what: str) -> tuple[tuple[float, float, float, float], ...]:
    """A GEMM curve as sorted ``(width, forward, weight gradient, input gradient)`` float quadruples,
    every number checked; :class:`PlanningError` naming ``what`` otherwise."""
    try:
        points = tuple(sorted((float(w), float(f), float(g), float(i)) for w, f, g, i in curve))
    except (TypeError, ValueError):
        raise PlanningError(f"{what} must hold (width, forward, weight gradient, input gradient) "
                            f"FLOP/s quadruples") from None
    for point in points:
        for value, name in zip(point, ("width", "forward", "weight gradient", "input gradient")):
            _check_number(value, f"{what} {name}")
    return points


def _interpolate_width(curve: tuple[tuple[float, float, float, float], ...],
                       width: float) -> Optional[tuple[float, float, float]]:
    """The three rates of ``curve`` at ``width``: linear in log width between its points, clamped at
    the ends; ``None`` for an empty curve."""
    if not curve:
        return None
    if width <= curve[0][0]:
        return curve[0][1:]
    for lo, hi in zip(curve, curve[1:]):
        if width <= hi[0]:
            f = math.log(width / lo[0]) / math.log(hi[0] / lo[0])
            return tuple(a + f * (b - a) for a, b in zip(lo[1:], hi[1:]))  # type: ignore[return-value]
    return curve[-1][1:]


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
        (:func:`gnncompile.calibration.runtime_overheads`): ``stage`` per Forward/Backward
        instruction, ``op_forward``/``op_backward`` per op of a stage, ``segment`` per checkpointed
        segment in a Forward or Backward, ``comm`` per communication
        instruction, ``optimizer_tensor`` per parameter tensor of the optimizer step, ``step``
        per training step outside the instructions (loss, zeroing gradients); ``switch`` per
        compute instruction that follows a wait for peers (the caches a thread switch costs it,
        :func:`gnncompile.calibration.calibrate`). Empty for presets: the cost models then charge
        ``launch_overhead`` per op only.
    edge_rate : float, optional
        Edges per second a propagation visits on top of its bytes (random row gathers are
        latency bound at small widths): calibrated from SpMM at two widths; ``None``: bytes only.
    rng_rate : float, optional
        Random numbers per second (dropout masks); ``None``: not charged.
    loss_rate, loss_grad_rate : float, optional
        Logits per second (rows x classes) of the training loss's forward (the cross-entropy of the
        training rows, computed in the Forward of the stage that makes the model's output) and of
        its backward (in that stage's Backward); ``None``: not charged beyond the fixed costs.
    spmm_curve : tuple of (working set bytes, spmm bandwidth, edge rate)
        Calibrated propagation rates by the size of the gathered source rows (a working set in
        the last-level cache is gathered faster than one in DRAM); empty: ``spmm_bandwidth`` and
        ``edge_rate`` for every size. See :meth:`spmm_rates`.
    push_factor : float, optional
        Time of a backward product that scatters from the forward CSR over one that pulls through
        a cached transpose (calibrated; ``None``: :data:`PUSH_FACTOR` assumed).
    host_bandwidth : float, optional
        Bytes/s of loading rows from host memory onto the device (a sampled mini-batch's input
        features every step); default: a PCIe 4.0 x16 link's achieved 25 GB/s for a GPU, the
        memory bandwidth (a gather) for a CPU.
    gemm_curve : tuple of (width, forward, weight gradient, input gradient)
        Calibrated float32 FLOP/s of the three dense products of a linear layer by its output
        width (``x @ W^T``, ``g^T @ x``, ``g @ W`` for a tall ``x``): a product with a narrow
        output runs far below the square-GEMM rate of :attr:`flops` (a CPU at width 16 reaches
        about half of it, at width 4-8 a fifth). Empty (presets): :attr:`flops` for all three.
        See :meth:`gemm_rates`.
    gemm_inner : float, optional
        The inner size (input width ``K`` of ``x``) of the products of :attr:`gemm_curve`.
    gemm_deep_curve : tuple of (width, forward, weight gradient, input gradient)
        The same products with a deep input, ``K =`` :attr:`gemm_deep_inner` (a first layer on
        dense features, whose narrow products run below the shallow curve's rates). Empty: no
        dependence on ``K``.
    gemm_deep_inner : float, optional
        The inner size of :attr:`gemm_deep_curve`'s products.
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
    loss_rate: Optional[float] = None
    loss_grad_rate: Optional[float] = None
    spmm_curve: tuple[tuple[float, float, float], ...] = ()
    host_bandwidth: Optional[float] = None
    push_factor: Optional[float] = None
    gemm_curve: tuple[tuple[float, float, float, float], ...] = ()
    gemm_inner: Optional[float] = None
    gemm_deep_curve: tuple[tuple[float, float, float, float], ...] = ()
    gemm_deep_inner: Optional[float] = None

    def __post_init__(self) -> None:
        what = f"device {self.name!r}"
        if self.host_bandwidth is None:
            object.__setattr__(self, "host_bandwidth", HOST_LINK if self.kind == "gpu" else self.mem_bandwidth)
        _check_number(self.host_bandwidth, f"{what}: host_bandwidth")
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
        for key in ("edge_rate", "rng_rate", "loss_rate", "loss_grad_rate", "push_factor"):
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
        for key in ("gemm_curve", "gemm_deep_curve"):
            object.__setattr__(self, key, _gemm_points(getattr(self, key), f"{what}: {key}"))
        for key in ("gemm_inner", "gemm_deep_inner"):
            if getattr(self, key) is not None:
                _check_number(getattr(self, key), f"{what}: {key}")
        if self.gemm_deep_curve and (self.gemm_inner is None or self.gemm_deep_inner is None
                                     or self.gemm_deep_inner <= self.gemm_inner):
            raise PlanningError(f"{what}: gemm_deep_curve needs gemm_inner and a larger gemm_deep_inner "
                                f"(got {self.gemm_inner} and {self.gemm_deep_inner})")

    def gemm_rates(self, width: float, inner: Optional[float] = None) -> Optional[tuple[float, float, float]]:
        """``(forward, weight gradient, input gradient)`` FLOP/s of a float32 linear layer with
        ``width`` outputs per row and ``inner`` inputs: interpolated in log width between the
        calibrated points of :attr:`gemm_curve`, clamped at the ends; with a :attr:`gemm_deep_curve`
        and an ``inner`` above :attr:`gemm_inner`, scaled towards the deep curve's rates
        geometrically in log ``inner`` (clamped at :attr:`gemm_deep_inner`). ``None`` without a curve."""
        rates = _interpolate_width(self.gemm_curve, width)
        if rates is None or not self.gemm_deep_curve or inner is None or inner <= self.gemm_inner:
            return rates
        deep = _interpolate_width(self.gemm_deep_curve, width)
        f = min(1.0, math.log(inner / self.gemm_inner) / math.log(self.gemm_deep_inner / self.gemm_inner))
        return tuple(r * (d / r) ** f for r, d in zip(rates, deep))  # type: ignore[return-value]

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
         bf16: Optional[float] = None, host: float = HOST_LINK) -> DeviceSpec:
    flops = {"float32": fp32, "float16": fp16, "float64": fp64}
    if bf16 is not None:
        flops["bfloat16"] = bf16
    return DeviceSpec(name, flops, bandwidth, int(memory_gib * GiB), kind="gpu", host_bandwidth=host)


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
    # PCIe 5.0 x16 host link: 63 GB/s raw, ~50 achieved.
    "H100": _gpu("H100", 67e12, 80, 3.35e12, fp16=989.5e12, bf16=989.5e12, fp64=34e12, host=50e9),
    # NVIDIA H200 SXM datasheet: H100 SXM compute, 141 GB HBM3e at 4.8 TB/s.
    "H200": _gpu("H200", 67e12, 141, 4.8e12, fp16=989.5e12, bf16=989.5e12, fp64=34e12, host=50e9),
    # Uncalibrated placeholder for a CPU host (all cores together), not a measurement: rough rates
    # of a small server. gnncompile.calibrate() measures the real host and parse() prefers its profile.
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
    # placeholder; gnncompile.calibrate() measures it.
    "shm": LinkSpec("shm", 5e9, 20e-6),
}

DEFAULT_INTRA: dict[str, str] = {
    "A5000": "pcie4", "T4": "pcie3", "V100-16GB": "nvlink2", "V100-32GB": "nvlink2", "V100": "nvlink2",
    "A100-40GB": "nvlink3", "A100-80GB": "nvlink3", "A100": "nvlink3", "H100": "nvlink4", "H200": "nvlink4",
    "cpu": "shm",
}

