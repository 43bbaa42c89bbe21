"""Clusters for the cost models: ranks of a device, the links between them, parsing, presets, profiles.

A :class:`Cluster` is ``nodes`` machines of ``devices_per_node`` identical ranks (one GPU, or one
process on a CPU host), linked inside a machine by ``intra`` and between machines by ``inter``::

    Cluster.parse("2x4xA5000-ib200")     # 2 nodes x 4 A5000, PCIe 4.0 inside, 200 Gbit/s IB across
    Cluster.parse("neutrontask")         # a paper's testbed (see CLUSTERS)
    Cluster.parse("4xcpu")               # 4 ranks on this host, from the saved CPU profile
    Cluster.parse("4xH100")              # from the saved H100 profile if there is one, else the datasheet
    gnncompile.calibrate("profile.json") # measure this host's CPU and gloo and save a profile
    gnncompile.calibrate(device="cuda")  # measure this machine's GPU (and NCCL between its GPUs)

Grammar of :meth:`Cluster.parse`: ``[NODESx]DEVICESxMODEL[-LINK]``, a bare ``MODEL`` (one device)
or a preset name from :data:`CLUSTERS`. ``LINK`` names the inter-node link when ``NODES > 1``
(default :data:`DEFAULT_INTER`), else it replaces the model's default intra-node link.

The devices and links (:class:`DeviceSpec`, :class:`LinkSpec`, the presets :data:`DEVICES`,
:data:`LINKS`, the units and conventions) are in :mod:`gnncompile.cost_models.specs` and importable
from here too. Calibration (measuring a host, which launches the runtime) is above the runtime, in
:mod:`gnncompile.calibration`; a saved profile is read here (:meth:`Cluster.load`).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import math
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import torch

from ..errors import PlanningError
from ..paths import write_text
from .specs import (CPU_GAMMA, DEFAULT_INTRA, DEFAULT_LAUNCH_OVERHEAD, DEVICES, GPU_GAMMA, LINKS,  # noqa: F401
                    SPMM_DERATE, DeviceSpec, GiB, LinkSpec, _fields_from_dict, _si)

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
    "UNCALIBRATED_LABEL",
    "DATASHEET_LABEL",
    "default_profile_path",
    "default_gpu_profile_path",
    "gpu_preset",
    "gpu_model_name",
]

DEFAULT_INTER = "ib100"    # inter-node link of a multi-node spec that names none
#: The label of a time predicted from the uncalibrated CPU placeholder (:attr:`Cluster.prediction_label`)
UNCALIBRATED_LABEL = "(uncalibrated: placeholder CPU rates, run `gnncompile calibrate` once)"
#: The label of a time predicted from a GPU preset (:attr:`Cluster.prediction_label`): datasheet peak
#: rates, no kernel launch or framework costs measured, so small steps are predicted far too fast
DATASHEET_LABEL = "(uncalibrated: datasheet GPU rates, no measured launch or framework costs)"
PROFILE_ENV = "GNNCOMPILE_PROFILE"
_FORMAT = "gnncompile.cluster"
_FORMAT_VERSION = 1
_GRAMMAR = "[NODESx]DEVICESxMODEL[-LINK] (e.g. '4xA5000', '2x4xA5000-ib200', 'A100', '4xcpu') or a preset name"


_RECALIBRATE = "`gnncompile calibrate` writes a new one (`--out PATH` for another file)"


def _check_calibration(cal: dict, kind: str, what: str) -> None:
    """Raise :class:`PlanningError` naming the field where ``cal`` (a cluster's ``calibration``)
    holds what the cost models cannot use: the collectives' fits (every kind) and, on a CPU, the
    rate pairs ``[single thread, all cores]`` and curves :meth:`Cluster.rank_device` reads."""

    def fail(where: str, want: str, got: Any) -> None:
        raise PlanningError(f"{what}: calibration{where} must be {want}, got {got!r}")

    def number(v: Any, where: str, low: float = 0.0, strict: bool = True) -> None:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and \
            (v > low if strict else v >= low)
        if not ok:
            fail(where, f"a finite number {'>' if strict else '>='} {low:g}", v)

    def pair(v: Any, where: str, strict: bool = True) -> None:
        if not isinstance(v, (list, tuple)) or len(v) != 2:
            fail(where, "[single thread, all cores]: two numbers", v)
        for i, x in enumerate(v):
            number(x, f"{where}[{i}]", strict=strict)

    def table(v: Any, where: str) -> dict:
        if not isinstance(v, dict):
            fail(where, "a dict", v)
        return v

    def points(key: str, fields: dict[str, str]) -> None:
        curve = cal.get(key, [])
        if not isinstance(curve, list):
            fail(f"[{key!r}]", "a list of points", curve)
        for i, p in enumerate(curve):
            for name, form in fields.items():
                where = f"[{key!r}][{i}][{name!r}]"
                if name not in table(p, f"[{key!r}][{i}]"):
                    raise PlanningError(f"{what}: calibration{where} is missing")
                (number if form == "number" else pair)(p[name], where)

    comm = table(cal.get("collectives", {}), "['collectives']")
    for op, fit in table(comm.get("fits", {}), "['collectives']['fits']").items():
        fit = table(fit, f"['collectives']['fits'][{op!r}]")
        number(fit.get("bandwidth"), f"['collectives']['fits'][{op!r}]['bandwidth']")
        number(fit.get("latency"), f"['collectives']['fits'][{op!r}]['latency']", strict=False)
    if "world_size" in comm and (not isinstance(comm["world_size"], int) or comm["world_size"] < 2):
        fail("['collectives']['world_size']", "an integer >= 2", comm["world_size"])
    if kind != "cpu":
        return
    if "rates" in cal:
        rates = table(cal["rates"], "['rates']")
        for name, v in table(rates.get("flops"), "['rates']['flops']").items():
            pair(v, f"['rates']['flops'][{name!r}]")
        for name in ("mem_bandwidth", "spmm_bandwidth"):
            pair(rates.get(name), f"['rates'][{name!r}]")
        for name in ("edge_rate", "rng_rate", "loss_rate", "loss_grad_rate"):
            if name in rates:
                pair(rates[name], f"['rates'][{name!r}]")
    for name, v in table(cal.get("runtime", {}), "['runtime']").items():
        pair(v, f"['runtime'][{name!r}]", strict=False)
    points("spmm_curve", {"working_set": "number", "bandwidth": "pair", "edge_rate": "pair"})
    for key in ("gemm_curve", "gemm_deep_curve"):
        points(key, {"width": "number", "forward": "pair", "weight_grad": "pair", "input_grad": "pair"})


def default_profile_path() -> Path:
    """Where :meth:`Cluster.parse` looks for a saved CPU profile: ``$GNNCOMPILE_PROFILE`` if set,
    else ``~/.cache/gnncompile/cpu_profile.json``."""
    env = os.environ.get(PROFILE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gnncompile" / "cpu_profile.json"


def default_gpu_profile_path(model: str) -> Path:
    """Where :meth:`Cluster.parse` looks for a saved profile of GPU ``model`` (a :data:`DEVICES` key
    or alias, or a :func:`gpu_model_name`): ``gpu_profile-<model>.json`` in the directory of
    :func:`default_profile_path` (``~/.cache/gnncompile/``, or that of ``$GNNCOMPILE_PROFILE``),
    ``<model>`` the preset's device name (``A100`` and ``a100-80gb`` share ``gpu_profile-A100-80GB.json``)."""
    key = _lookup(model, DEVICES)
    name = DEVICES[key].name if key is not None else model
    return default_profile_path().parent / f"gpu_profile-{re.sub(r'[^A-Za-z0-9.+-]+', '_', name)}.json"


def gpu_preset(name: str, memory: Optional[int] = None) -> Optional[str]:
    """The :data:`DEVICES` key of a GPU that CUDA names ``name`` (``torch.cuda.get_device_name``)
    with ``memory`` bytes (``get_device_properties(...).total_memory``), or ``None``.

    Rule: a preset's family is its key up to the first ``-`` (``A100-80GB``: ``A100``); it must
    occur in ``name`` as a token, ignoring case: not preceded by a letter or digit, not followed by
    a digit (``"NVIDIA A100-SXM4-80GB"`` and ``"NVIDIA H100 80GB HBM3"`` match ``A100`` and ``H100``;
    ``"NVIDIA H200"`` matches ``H200``, not ``H100``; ``"RTX 4090"`` is no ``T4``). With ``memory``,
    the most specific (longest) such key whose capacity is within 10% of it (``A100-80GB`` vs
    ``A100-40GB``; an H100 NVL's 94 GB matches nothing); without, the family's own key (``A100``,
    ``V100``) if there is one, else the most specific."""
    found = sorted((k for k in DEVICES if DEVICES[k].kind == "gpu"
                    and re.search(rf"(?<![a-z0-9]){re.escape(k.split('-')[0].lower())}(?![0-9])", name.lower())),
                   key=lambda k: (-len(k), k))
    if memory is not None:
        return next((k for k in found if abs(DEVICES[k].memory - memory) <= 0.1 * DEVICES[k].memory), None)
    return next((k for k in found if "-" not in k), found[0] if found else None)


def gpu_model_name(name: str, memory: Optional[int] = None) -> str:
    """The model a GPU's profile records (``calibration["model"]``): its preset's device name
    (:func:`gpu_preset`, e.g. ``"H100"``), else ``name`` without a leading ``NVIDIA`` and with
    spaces as ``-`` (``"NVIDIA GeForce RTX 4090"``: ``"GeForce-RTX-4090"``)."""
    key = gpu_preset(name, memory)
    if key is not None:
        return DEVICES[key].name
    return "-".join(re.sub(r"^\s*nvidia\s+", "", name, flags=re.IGNORECASE).split()) or "gpu"


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
        Raw measurements of :func:`gnncompile.calibrate` (JSON types only); empty when uncalibrated.
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
        _check_calibration(self.calibration, self.device.kind, what)

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

        Time-shared cores stretch everything a rank does on the CPU, including its messages
        (:meth:`time_shared`).
        """
        if self.device.kind != "cpu":
            return 1.0
        threads = self.threads_per_rank or max(1, self.cores // self.devices_per_node)
        return max(1.0, self.devices_per_node * threads / self.cores)

    def time_shared(self, link: LinkSpec) -> LinkSpec:
        """``link`` as the ranks of an oversubscribed CPU host see it: a message's latency waits for
        the peer process to be scheduled, and its copies (shared memory, loopback sockets: CPU work
        of both processes) run on time-shared cores, so latency is multiplied and bandwidth divided
        by :attr:`oversubscription` (the link itself where that is 1)."""
        o = self.oversubscription
        if o <= 1:
            return link
        return dataclasses.replace(link, latency=link.latency * o, bandwidth=link.bandwidth / o)

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
        FLOP/s (the square GEMM's and each point of the ``gemm_curve`` and ``gemm_deep_curve``), ``mem_bandwidth``,
        ``spmm_bandwidth`` and the other calibrated rates, where ``r`` interpolates linearly in
        threads between the calibrated single-thread and all-core rates; past ``cores`` it grows
        on with that slope if positive, else stays flat (one core: ``r(t) = t · r(1)``). The
        memory-bound rates (``mem_bandwidth``, ``spmm_bandwidth``, ``edge_rate``, the
        ``spmm_curve``) are the host's, shared: at most ``r(b) / ranks`` with ``b = min(cores,
        ranks · t)`` the threads running at once (two one-thread ranks on two cores do not each
        get a lone thread's bandwidth). An uncalibrated host assumes linear scaling of its
        all-core rates. ``memory`` is the host's
        split evenly among its ranks. The runtime's fixed costs (``DeviceSpec.runtime``), where
        calibrated at one thread and at all cores (``calibration["runtime"]``), are interpolated
        linearly in ``min(t, cores)`` threads and stretched by ``1 / min(1, cores / (ranks · t))``
        where the ranks time-share the cores.
        """
        self.node_of(rank)
        if self.device.kind != "cpu":
            return self.device
        ranks = self.devices_per_node
        threads = self.threads_per_rank or max(1, self.cores // ranks)
        share = min(1.0, self.cores / (ranks * threads))

        def at(pair: Sequence[float], t: int) -> float:
            """``r(t)``: the calibrated rate ``pair`` (single thread, all cores) at ``t`` threads."""
            single, all_cores = pair
            if self.cores == 1:
                return single * t
            slope = (all_cores - single) / (self.cores - 1)
            within = min(t, self.cores)
            return single + slope * (within - 1) + max(0.0, slope) * (t - within)

        def rate(pair: Sequence[float]) -> float:
            return at(pair, threads) * share

        busy = min(self.cores, ranks * threads)  # threads the host's ranks run at once

        def shared(pair: Sequence[float]) -> float:
            """A memory-bound rate: the host's memory system serves its ranks together, at most the
            calibrated rate of ``busy`` threads split among the ranks (never above :func:`rate`)."""
            if ranks == 1 or self.cores == 1:
                return rate(pair)
            return min(rate(pair), at(pair, busy) / ranks)

        def gemm(key: str) -> tuple:
            """The calibrated GEMM curve ``key`` at this rank's threads (the device's where none)."""
            return tuple((p["width"], *(rate(p[k]) for k in ("forward", "weight_grad", "input_grad")))
                         for p in self.calibration.get(key, [])) or getattr(self.device, key)

        rates = self._thread_rates()
        threaded = self.calibration.get("runtime", {})

        def fixed(pair: Sequence[float]) -> float:
            """A fixed cost ``pair`` (single thread, all cores) at this rank's threads, linear in
            between, flat past ``cores`` (more threads than cores: ``share`` stretches it)."""
            single, all_cores = pair
            if self.cores == 1:
                return single
            return single + (all_cores - single) * (min(threads, self.cores) - 1) / (self.cores - 1)
        return dataclasses.replace(
            self.device,
            flops={dtype: rate(pair) for dtype, pair in rates["flops"].items()},
            mem_bandwidth=shared(rates["mem_bandwidth"]),
            host_bandwidth=shared(rates["mem_bandwidth"]),  # a CPU rank "loads" rows by gathering them
            spmm_bandwidth=shared(rates["spmm_bandwidth"]),
            edge_rate=shared(rates["edge_rate"]) if "edge_rate" in rates else self.device.edge_rate,
            rng_rate=rate(rates["rng_rate"]) if "rng_rate" in rates else self.device.rng_rate,
            loss_rate=rate(rates["loss_rate"]) if "loss_rate" in rates else self.device.loss_rate,
            loss_grad_rate=rate(rates["loss_grad_rate"]) if "loss_grad_rate" in rates else self.device.loss_grad_rate,
            spmm_curve=tuple((p["working_set"], shared(p["bandwidth"]), shared(p["edge_rate"]))
                             for p in self.calibration.get("spmm_curve", [])) or self.device.spmm_curve,
            gemm_curve=gemm("gemm_curve"),
            gemm_deep_curve=gemm("gemm_deep_curve"),
            memory=self.device.memory // ranks,
            # fixed costs are CPU time too: time-shared cores stretch them; measured at one thread and
            # at all cores, they are r(t) as the rates are (a multi-threaded op forks and joins)
            launch_overhead=self.device.launch_overhead / share,
            runtime={k: (fixed(threaded[k]) if k in threaded else v) / share for k, v in self.device.runtime.items()},
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
        """Write :meth:`to_dict` as JSON to ``path`` (parents created); return the path.

        A regular file is replaced atomically (a temporary file of its own in the same directory,
        then renamed over it): a process reading the profile meanwhile sees the old one or the new
        one, never a mix, and saves at once do not disturb each other (the last one wins). A
        symbolic link is followed (its target is replaced, the link stays); a path that is neither
        a file nor a directory (``/dev/null``, a pipe) is written as it is. Raises
        :class:`PlanningError` naming the path (a directory, no permission...)."""
        path = Path(path).expanduser()
        text = json.dumps(self.to_dict(), indent=2) + "\n"
        try:
            if path.is_dir():
                raise PlanningError(f"cannot write cluster profile {path}: it is a directory (give a file name)")
            Path(os.path.realpath(path)).parent.mkdir(parents=True, exist_ok=True)
            write_text(path, text)
        except OSError as exc:
            why = "nothing reads it (a pipe or socket without a reader)" if exc.errno == errno.ENXIO else \
                exc.strerror or exc
            raise PlanningError(f"cannot write cluster profile {path}: {why}") from exc
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
            raise PlanningError(f"cluster profile {path} is not valid JSON: {exc}; {_RECALIBRATE}") from exc
        try:
            return cls.from_dict(data)
        except PlanningError as exc:
            raise PlanningError(f"cluster profile {path}: {exc}; {_RECALIBRATE}") from exc

    # --- construction
    @classmethod
    def local(cls, num_ranks: int, profile: Union["Cluster", str, Path, None] = None) -> "Cluster":
        """``num_ranks`` ranks on this machine: on its GPUs when CUDA is available (the model from
        ``torch.cuda.get_device_name`` matched against :data:`DEVICES` by :func:`gpu_preset`), else
        CPU processes costed with the calibrated profile (see :meth:`parse`; uncalibrated without
        one). A GPU profile of that model (``profile``, else the saved one) applies as in :meth:`parse`
        where every rank has a GPU of its own.

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
        mem = torch.cuda.get_device_properties(0).total_memory
        match = gpu_preset(name, mem)
        if match is None:
            raise PlanningError(f"GPU {name!r} ({mem / 2**30:.0f} GiB) is not among the device presets "
                                f"({', '.join(DEVICES)}); pass a cluster, e.g. gpus='{num_ranks}xA100'")
        if num_ranks <= gpus:
            return cls.parse(f"{num_ranks}x{match}", profile=profile)
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
            spmm_bandwidth=device.spmm_bandwidth / share, host_bandwidth=device.host_bandwidth / share,
            edge_rate=None if device.edge_rate is None else device.edge_rate / share)
        return cls(1, num_ranks, spec, LINKS["shm"], name=f"{num_ranks} ranks sharing {num_gpus}x{device.name}")

    @property
    def calibrated(self) -> bool:
        """Whether the device numbers come from measurement (a calibrated profile): not for the CPU
        placeholder, nor for GPU presets (datasheet rates)."""
        return bool(self.calibration)

    @property
    def prediction_label(self) -> str:
        """What every time predicted on this cluster is printed with (plan explanations, the CLI,
        timelines): ``""`` when :attr:`calibrated` on this host, else :data:`UNCALIBRATED_LABEL` (a
        CPU) or :data:`DATASHEET_LABEL` (a GPU preset) with a leading space; a CPU profile measured
        on another host (``calibration["host"]``) or with other usable cores says so."""
        if self.calibrated:
            host, cores = self.calibration.get("host"), self.calibration.get("cores")
            if self.device.kind != "cpu" or host is None:
                return ""
            here, usable = socket.gethostname(), _usable_cores()
            if host == here and cores in (None, usable):
                return ""
            return (f" (CPU profile measured on {host}" + (f", {cores} cores" if cores is not None else "") +
                    f"; this is {here}, {usable} cores: `gnncompile calibrate` here)")
        return f" {UNCALIBRATED_LABEL if self.device.kind == 'cpu' else DATASHEET_LABEL}"

    @classmethod
    def parse(cls, text: str, profile: Union["Cluster", str, Path, None] = None) -> "Cluster":
        """A cluster from ``[NODESx]DEVICESxMODEL[-LINK]``, a bare ``MODEL`` or a preset name.

        Model, link and preset names are case-insensitive. ``LINK`` is the inter-node link when
        ``NODES > 1`` (default :data:`DEFAULT_INTER`), else it replaces the intra-node link.
        ``cpu`` models take their device, cores, intra link and calibration from ``profile`` (a
        calibrated :class:`Cluster` or the path of a saved one), else from the saved profile at
        :func:`default_profile_path` if it exists, else the uncalibrated placeholder with this
        host's usable cores. GPU models take their device, intra link (unless ``LINK`` replaces it)
        and calibration from a GPU profile of that model (:func:`gnncompile.calibrate` with
        ``device="cuda"``; matched by ``calibration["model"]``, the preset's device name, so
        ``A100`` and ``A100-80GB`` share one): ``profile``, else the saved one at
        :func:`default_gpu_profile_path` if it exists and is of that model (one of another model
        there is ignored), else the datasheet preset. An explicit GPU profile of a GPU no preset
        matches also makes its model name (``calibration["model"]``, e.g. ``GeForce-RTX-4090``)
        a valid ``MODEL``.

        Raises
        ------
        PlanningError
            Malformed text, unknown model or link (the message lists the valid ones), a
            profile that cannot be read, an explicit profile of another model than the spec's
            (a GPU's for ``cpu``, a CPU's or another GPU's for a GPU model).
        """
        if profile is not None and not isinstance(profile, (Cluster, str, os.PathLike)):
            raise PlanningError(f"profile: expected a Cluster or the path of a saved profile, got "
                                f"{type(profile).__name__}")
        if profile is not None and not isinstance(profile, Cluster):
            profile = Cluster.load(profile)
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
        # an explicit profile of a GPU no preset matches names a model of its own
        own = _profiled_model(profile) if profile is not None and profile.device.kind == "gpu" else None
        models = {**DEVICES, own: profile.device} if own is not None and _lookup(own, DEVICES) is None else DEVICES
        model, link = _lookup(rest, models), None
        if model is None and "-" in rest:
            head, _, tail = rest.rpartition("-")
            model, link = _lookup(head, models), tail
            if model is not None and _lookup(link, LINKS) is None:
                raise PlanningError(f"unknown link {link!r} in cluster spec {text!r}; valid: {', '.join(LINKS)}")
        if model is None:
            raise PlanningError(f"unknown device model {rest.rpartition('-')[0] or rest!r} in cluster spec "
                                f"{text!r}; valid: {', '.join(DEVICES)}; links: {', '.join(LINKS)}; "
                                f"presets: {', '.join(CLUSTERS)}; grammar: {_GRAMMAR}")
        link_key = _lookup(link, LINKS) if link is not None else None
        link_spec = LINKS[link_key] if link_key is not None else None
        intra = LINKS[DEFAULT_INTRA[model]] if model in DEFAULT_INTRA else profile.intra
        inter = None
        if nodes > 1:
            inter = link_spec or LINKS[DEFAULT_INTER]
        elif link_spec is not None:
            intra = link_spec
        device, cores, calibration = models[model], 0, {}
        measured = _cpu_profile(profile) if device.kind == "cpu" else _gpu_profile(model, models, profile)
        if device.kind == "cpu" and measured is None:
            cores = _usable_cores()
        elif measured is not None:
            device, cores, calibration = measured.device, measured.cores, measured.calibration
            intra = link_spec if (link_spec is not None and nodes == 1) else measured.intra
        name = (f"{nodes}x" if nodes > 1 else "") + f"{per_node}x{model}" + (f"-{link_key}" if link_key else "")
        return cls(nodes, per_node, device, intra, inter, name=name, cores=cores, calibration=calibration)


def _cpu_profile(profile: Union[Cluster, str, Path, None]) -> Optional[Cluster]:
    """The CPU profile :meth:`Cluster.parse` uses (see there), or ``None`` for the placeholder."""
    if profile is None:
        default = default_profile_path()
        if default.exists() and not default.is_file():  # (a directory: not silently uncalibrated)
            raise PlanningError(f"the CPU profile {default} (${PROFILE_ENV} or the default) is not a file; point "
                                f"${PROFILE_ENV} at a profile file, or {_RECALIBRATE}")
        if not default.is_file():
            return None
        profile = default
    host = profile if isinstance(profile, Cluster) else Cluster.load(profile)
    if host.device.kind != "cpu":
        source = "" if isinstance(profile, Cluster) else f" ({profile})"
        raise PlanningError(f"profile {host.name!r}{source} describes a {host.device.kind.upper()} cluster, not a "
                            "CPU host")
    return host


def _profiled_model(cluster: Cluster) -> Optional[str]:
    """The model a profile was calibrated on: ``"cpu"``, or a GPU profile's ``calibration["model"]``
    as the preset's device name where it is a preset's (``None``: a GPU profile without one)."""
    if cluster.device.kind == "cpu":
        return "cpu"
    model = cluster.calibration.get("model")
    if not isinstance(model, str):
        return None
    key = _lookup(model, DEVICES)
    return DEVICES[key].name if key is not None else model


def _gpu_profile(model: str, models: dict[str, DeviceSpec], profile: Optional[Cluster]) -> Optional[Cluster]:
    """The GPU profile :meth:`Cluster.parse` applies to GPU ``model`` (a key of ``models``, see
    there), or ``None`` for the preset."""
    wanted = models[model].name if model in DEVICES else model
    explicit = profile is not None
    if profile is None:
        path = default_gpu_profile_path(wanted)
        if not path.is_file():
            return None
        profile = Cluster.load(path)
    found = _profiled_model(profile)
    if found is not None and found.lower() == wanted.lower():
        return profile
    if explicit:
        raise PlanningError(f"profile {profile.name!r} was calibrated on {found or 'an unnamed GPU model'}, not "
                            f"{wanted}: pass a profile of {wanted} (gnncompile calibrate --device cuda on one), "
                            f"or none for the {wanted} preset's datasheet rates")
    return None


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
