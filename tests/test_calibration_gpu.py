"""GPU calibration: the timing helpers shared with the CPU path, argument errors, which preset a
GPU's name is, and GPU profiles read back by ``Cluster.parse`` (all on the CPU); end to end on a
GPU (marked ``gpu``, skipped without CUDA)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import gnncompile.calibration as calibration
from gnncompile.calibration import calibrate
from gnncompile.cost_models.hardware import (
    DATASHEET_LABEL,
    DEVICES,
    LINKS,
    Cluster,
    DeviceSpec,
    GiB,
    default_gpu_profile_path,
    default_profile_path,
    gpu_model_name,
    gpu_preset,
)
from gnncompile.errors import PlanningError


# --- measurement helpers shared by the CPU and GPU paths ----------------------------------------------

def test_best_time_synchronizes_after_every_timed_call() -> None:
    events: list[str] = []
    best = calibration._best_time(lambda: events.append("call"), 3, 10.0, lambda: events.append("sync"))
    assert events == ["call", "sync"] * 4 and 0 <= best < 1      # one warm-up, then three timed calls
    assert calibration._best_time(lambda: None, 2, 10.0) >= 0   # the CPU's default: no sync


def test_one_pass_of_the_local_measurements_gives_positive_rates() -> None:
    """The problems, one timed pass and its rates, as the GPU rank runs them (here on the CPU, quick,
    with a real sync callable); the report holds plain numbers when the rates are plain."""
    pb = calibration._problems(True, torch.device("cpu"))
    syncs = []
    s = calibration._time_once(pb, 1, 0.0, lambda: syncs.append(1))
    assert syncs                                                  # every timing synchronized
    rates = calibration._rates_once(pb, s)
    report = calibration._report(pb, lambda get: get(s), lambda get: get(rates))
    plain = report["rates"]
    assert all(v > 0 and math.isfinite(v) for v in plain["flops"].values())
    assert all(plain[k] > 0 for k in ("mem_bandwidth", "spmm_bandwidth", "edge_rate", "rng_rate", "loss_rate",
                                      "loss_grad_rate"))
    widths = [p["width"] for p in report["gemm_curve"]]
    assert widths == sorted(widths) == [p["width"] for p in report["gemm_deep_curve"]]
    assert all(isinstance(p["forward"], float) and p["forward"] > 0 for p in report["gemm_curve"])
    assert [p["working_set"] for p in report["spmm_curve"]] == [c["working_set"] for c in report["spmm"]["cases"]]
    assert report["linear"]["inner"] < report["linear_deep"]["inner"]
    json.dumps(report)                                           # a profile holds JSON types only
    assert calibration._op_overhead(torch.device("cpu"), 10, 2, 1.0, calibration._no_sync) > 0
    push = calibration._push_seconds(pb["spmm_cases"][0], 1, 0.0, calibration._no_sync)
    assert push["factor"] > 0


# --- arguments --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device, fragment", [
    ("gpu", "device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
    ("cuda:x", "device must be 'cpu', 'cuda' or 'cuda:N'"),
    (0, "device must be 'cpu', 'cuda' or 'cuda:N', got 0"),
])
def test_bad_device_is_refused_before_measuring(device: Any, fragment: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibration, "launch", _no_launch)
    with pytest.raises(PlanningError, match=fragment):
        calibrate(device=device)


def test_cuda_without_a_gpu_is_refused_before_measuring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibration, "launch", _no_launch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:0"):
        with pytest.raises(PlanningError, match=r"no CUDA device: torch.cuda.is_available\(\) is False"):
            calibrate(device=device)


def test_missing_gpu_index_and_gloo_on_a_gpu_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibration, "launch", _no_launch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(PlanningError, match=r"device='cuda:2' but this machine has 2 GPU\(s\)"):
        calibrate(device="cuda:2")
    with pytest.raises(PlanningError, match="NCCL's between GPUs"):
        calibrate(device="cuda", backend="gloo")


def test_cli_refuses_cuda_without_a_gpu() -> None:
    # (a machine's GPUs are hidden from the command: the refusal is checked on every machine)
    done = subprocess.run([sys.executable, "-m", "gnncompile", "calibrate", "--device", "cuda", "--quick"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1
    assert "no CUDA device: torch.cuda.is_available() is False" in done.stderr


def _no_launch(*args: object, **kw: object) -> None:
    raise AssertionError("calibrate launched ranks before checking its arguments")


# --- which preset a GPU is ------------------------------------------------------------------------------

@pytest.mark.parametrize("name, memory_gib, key", [
    ("NVIDIA H100 80GB HBM3", 79.6, "H100"),
    ("NVIDIA H200", 140.4, "H200"),
    ("NVIDIA A100-SXM4-80GB", 79.3, "A100-80GB"),
    ("NVIDIA A100-SXM4-40GB", 39.6, "A100-40GB"),
    ("Tesla V100-SXM2-16GB", 15.8, "V100-16GB"),
    ("Tesla T4", 14.6, "T4"),
    ("NVIDIA RTX A5000", 23.7, "A5000"),
    ("NVIDIA GeForce RTX 4090", 23.6, None),     # "RTX 4090" is no T4
    ("NVIDIA H100 NVL", 93.1, None),             # an H100 by name, but no preset has 94 GB
])
def test_gpu_names_map_to_presets(name: str, memory_gib: float, key: str | None) -> None:
    assert gpu_preset(name, int(memory_gib * GiB)) == key
    assert gpu_model_name(name, int(memory_gib * GiB)) == (DEVICES[key].name if key else gpu_model_name(name, 1))


def test_gpu_names_without_memory_and_unknown_model_names() -> None:
    assert gpu_preset("NVIDIA A100-SXM4-80GB") == "A100"          # the family's own key
    assert gpu_preset("NVIDIA H200") == "H200" and gpu_preset("AMD Instinct MI300X") is None
    assert gpu_model_name("NVIDIA GeForce RTX 4090", 24 * GiB) == "GeForce-RTX-4090"


def test_default_gpu_profile_path_is_next_to_the_cpu_one(no_saved_profile: Path) -> None:
    assert default_gpu_profile_path("H100") == no_saved_profile.parent / "gpu_profile-H100.json"
    assert default_gpu_profile_path("a100") == default_gpu_profile_path("A100-80GB") \
        == no_saved_profile.parent / "gpu_profile-A100-80GB.json"
    assert default_profile_path() == no_saved_profile


# --- GPU profiles read back ---------------------------------------------------------------------------------

def _gpu_profile(model: str = "H100", name: str = "NVIDIA H100 80GB HBM3") -> Cluster:
    """A calibrated GPU cluster as :func:`calibrate` would return it, with made-up rates."""
    device = DeviceSpec(name, {"float32": 40e12, "float64": 30e12, "float16": 900e12}, 2.5e12, 80 * GiB,
                        spmm_bandwidth=1.2e12, edge_rate=40e9, gamma=0.0, launch_overhead=6e-6,
                        gemm_curve=((4, 1e12, 2e12, 3e12), (64, 20e12, 21e12, 22e12)), gemm_inner=512.0,
                        runtime={"stage": 40e-6, "op_forward": 12e-6, "op_backward": 20e-6, "step": 300e-6},
                        kind="gpu")
    link = LINKS["nvlink4"]
    return Cluster(1, 1, device, dataclasses.replace(link, name="nccl", bandwidth=300e9), name=f"{model} (calibrated)",
                   calibration={"model": model, "preset": model, "sync": {"seconds": 8e-6},
                                "gpu": {"allow_tf32": False}, "runtime": dict(device.runtime),
                                "collectives": {"skipped": "one GPU"}})


def test_parse_applies_a_gpu_profile_of_its_model(tmp_path: Path) -> None:
    profile = _gpu_profile()
    path = profile.save(tmp_path / "h100.json")
    for given in (path, str(path), profile):
        c = Cluster.parse("2xH100", profile=given)
        assert (c.nodes, c.devices_per_node, c.name) == (1, 2, "2xH100")
        assert c.device == profile.device and c.intra == profile.intra and c.calibration == profile.calibration
        assert c.calibrated and c.prediction_label == "" and DATASHEET_LABEL not in c.prediction_label
        d = c.rank_device(1)                                    # no thread interpolation on a GPU
        assert d.flops_for("float32") == 40e12 and d.launch_overhead == 6e-6 and d.runtime == profile.device.runtime
    assert Cluster.parse("h100", profile=path).device == profile.device             # case-insensitive
    assert Cluster.parse("2x4xH100-ib200", profile=path).inter == LINKS["ib200"]
    assert Cluster.parse("2xH100-pcie4", profile=path).intra == LINKS["pcie4"]       # LINK replaces intra
    preset = Cluster.parse("2xH100")                          # no profile: the datasheet preset
    assert preset.device == DEVICES["H100"] and not preset.calibrated
    assert preset.prediction_label == f" {DATASHEET_LABEL}"


def test_a100_aliases_share_a_profile(tmp_path: Path) -> None:
    profile = _gpu_profile("A100-80GB", "NVIDIA A100-SXM4-80GB")
    assert Cluster.parse("4xA100", profile=profile).calibrated
    assert Cluster.parse("4xa100-80gb", profile=profile).calibrated


def test_a_profile_of_another_model_is_an_error_when_given(tmp_path: Path) -> None:
    a100 = _gpu_profile("A100-80GB", "NVIDIA A100-SXM4-80GB")
    path = a100.save(tmp_path / "a100.json")
    with pytest.raises(PlanningError, match="calibrated on A100-80GB, not H100"):
        Cluster.parse("2xH100", profile=path)
    with pytest.raises(PlanningError, match="calibrated on A100-80GB, not A100-40GB"):
        Cluster.parse("A100-40GB", profile=a100)
    cpu = Cluster(1, 1, DEVICES["cpu"], LINKS["shm"], cores=2, calibration={"quick": True})  # calibrated: a record
    with pytest.raises(PlanningError, match="calibrated on cpu, not H100"):
        Cluster.parse("2xH100", profile=cpu)
    with pytest.raises(PlanningError, match="not a CPU host"):
        Cluster.parse("2xcpu", profile=a100)


def test_default_path_profile_applies_to_its_model_only() -> None:
    h100 = _gpu_profile()
    h100.save(default_gpu_profile_path("H100"))
    assert Cluster.parse("4xH100").device == h100.device and Cluster.parse("4xH100").calibrated
    assert Cluster.parse("4xH200").device == DEVICES["H200"]           # another model's file: not read
    # a file at H200's default path holding another model's profile is ignored (preset used)
    h100.save(default_gpu_profile_path("H200"))
    c = Cluster.parse("4xH200")
    assert c.device == DEVICES["H200"] and not c.calibrated


def test_an_unknown_gpu_is_usable_through_its_profile(tmp_path: Path) -> None:
    rtx = _gpu_profile("GeForce-RTX-4090", "NVIDIA GeForce RTX 4090")
    path = rtx.save(tmp_path / "rtx.json")
    c = Cluster.parse("2xGeForce-RTX-4090", profile=path)
    assert c.device == rtx.device and c.intra == rtx.intra and c.calibrated
    assert Cluster.parse("2x2xgeforce-rtx-4090-ib200", profile=rtx).inter == LINKS["ib200"]
    with pytest.raises(PlanningError, match="unknown device model"):
        Cluster.parse("2xGeForce-RTX-4090")                             # without its profile


def test_local_gpu_cluster_uses_the_saved_profile(monkeypatch: pytest.MonkeyPatch, fake_gpus: Any) -> None:
    h100 = _gpu_profile()
    h100.save(default_gpu_profile_path("H100"))
    fake_gpus("NVIDIA H100 80GB HBM3", 4, int(79.6 * GiB))
    monkeypatch.delenv("GNNCOMPILE_DEVICE", raising=False)
    c = Cluster.local(2)
    assert c.device == h100.device and c.calibrated and c.name == "2xH100"


def test_cli_calibrate_cuda_saves_the_model_profile_and_prints_the_gpu_rates(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from gnncompile import cli

    calls = []

    def fake(path: Any, *, quick: bool, device: str) -> Cluster:
        calls.append((path, quick, device))
        return _gpu_profile()

    monkeypatch.setattr(calibration, "calibrate", fake)
    assert cli.main(["calibrate", "--device", "cuda:1", "--quick"]) == 0
    assert calls == [(None, True, "cuda:1")]
    assert Cluster.load(default_gpu_profile_path("H100")) == _gpu_profile()
    out = capsys.readouterr().out
    assert "float32 40 TFLOP/s (allow_tf32=False)" in out and "per op 6 us, synchronize 8 us" in out
    assert "collectives: one GPU" in out and f"written to {default_gpu_profile_path('H100')}" in out


# --- on a GPU ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Cluster, Path]:
    path = tmp_path_factory.mktemp("gpu") / "gpu.json"
    return calibrate(path, quick=True, device="cuda"), path


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_gpu_calibration_end_to_end(gpu_calibrated: tuple[Cluster, Path]) -> None:
    c, path = gpu_calibrated
    d, cal = c.device, c.calibration
    assert d.kind == "gpu" and c.cores == 0 and (c.nodes, c.devices_per_node) == (1, 1)
    assert d.name == torch.cuda.get_device_name(0) and d.memory == torch.cuda.get_device_properties(0).total_memory
    numbers = [d.flops["float32"], d.flops["float64"], d.mem_bandwidth, d.spmm_bandwidth, d.edge_rate, d.rng_rate,
               d.loss_rate, d.loss_grad_rate, d.launch_overhead, d.push_factor, cal["sync"]["seconds"],
               c.intra.bandwidth]
    assert all(math.isfinite(v) and v > 0 for v in numbers), numbers
    assert cal["rates"]["flops"]["float32"] == d.flops["float32"]          # plain numbers: no thread pairs
    assert isinstance(cal["rates"]["mem_bandwidth"], float) and isinstance(cal["runtime"]["stage"], float)
    assert cal["gpu"]["allow_tf32"] == torch.backends.cuda.matmul.allow_tf32
    assert all(v > 0 for p in d.gemm_curve + d.gemm_deep_curve for v in p) and d.gemm_rates(16) is not None
    assert {"stage", "op_forward", "op_backward", "segment", "comm", "optimizer_tensor", "step"} <= set(d.runtime)
    assert all(v >= 0 for v in d.runtime.values()) and d.runtime == cal["runtime"]
    if torch.cuda.device_count() >= 2:
        assert set(cal["collectives"]["fits"]) == {"all_reduce", "all_to_all"} and c.intra.name == "nccl"
    else:
        assert "skipped" in cal["collectives"]
    assert cal["model"] == gpu_model_name(d.name, d.memory)
    assert Cluster.load(path) == c
    if cal["preset"] is not None:                                     # read back for clusters of its model
        four = Cluster.parse(f"4x{cal['preset']}", profile=path)
        assert four.device == d and four.calibrated and four.rank_device(3) == d
    else:
        assert Cluster.parse(f"4x{cal['model']}", profile=path).device == d


def test_gpu_calibration_assembles_a_profile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, fake_gpus: Any) -> None:
    """``calibrate(device="cuda")``'s own logic on the CPU: the GPU rank runs in this process on CPU
    tensors with CUDA's queries stubbed (an H100 with one GPU: collectives skipped), the runtime's
    fixed costs stubbed; the profile it saves is an H100 one that ``Cluster.parse`` applies."""
    from types import SimpleNamespace

    memory = int(79.6 * GiB)
    fake_gpus("NVIDIA H100 80GB HBM3", 1, memory, major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    launched = []

    def launch(fn: Any, world_size: int, args: tuple, **kw: Any) -> list:
        launched.append((fn, world_size, kw))
        return [fn(SimpleNamespace(device=torch.device("cpu")), *args)]

    def overheads(cluster: Cluster, *, quick: bool, device: str) -> dict[str, float]:
        assert device == "cuda:0" and cluster.device.kind == "gpu" and cluster.device.launch_overhead > 0
        return {"stage": 3e-5, "op_forward": 1e-5, "op_backward": 2e-5, "segment": 0.0, "comm": 0.0,
                "optimizer_tensor": 1e-5, "step": 2e-4}

    monkeypatch.setattr(calibration, "launch", launch)
    monkeypatch.setattr(calibration, "runtime_overheads", overheads)
    c = calibrate(tmp_path / "h100.json", quick=True, device="cuda")
    assert [(fn, n, kw["device"]) for fn, n, kw in launched] == [(calibration._gpu_rank, 1, "cuda:0")]
    d, cal = c.device, c.calibration
    assert (cal["model"], cal["preset"], cal["device"]) == ("H100", "H100", "cuda:0")
    assert d.kind == "gpu" and d.name == "NVIDIA H100 80GB HBM3" and d.memory == memory and d.gamma == 0
    assert d.flops["float32"] == cal["rates"]["flops"]["float32"] > 0                # measured
    assert d.flops["bfloat16"] == DEVICES["H100"].flops["bfloat16"]                    # the preset's
    assert cal["flops_from_datasheet"] == ["bfloat16", "float16"]
    assert d.launch_overhead == cal["op_overhead"]["seconds"] > 0 and cal["sync"]["seconds"] >= 0
    assert d.runtime == cal["runtime"] and "switch" not in d.runtime
    assert "skipped" in cal["collectives"] and c.intra == LINKS["nvlink4"]
    assert len(d.gemm_curve) == len(cal["gemm_curve"]) and d.spmm_bandwidth == cal["rates"]["spmm_bandwidth"]
    four = Cluster.parse("4xH100", profile=tmp_path / "h100.json")
    assert four.device == d and four.calibrated and four.rank_device(2) == d
