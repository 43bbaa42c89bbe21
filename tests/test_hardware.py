"""Hardware specs: parsing cluster specs, links between ranks, presets, JSON round trips, CPU
calibration (quick, once per module) and the per-rank scaling of CPU rates."""

from __future__ import annotations

import dataclasses
import json
import math
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from gnncompile.cost_models.hardware import (
    CLUSTERS,
    DEFAULT_INTER,
    DEVICES,
    GiB,
    LINKS,
    Cluster,
    DeviceSpec,
    LinkSpec,
    _usable_cores,
    default_profile_path,
)
from gnncompile.calibration import calibrate
from gnncompile.errors import PlanningError


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Cluster, Path]:
    path = tmp_path_factory.mktemp("profile") / "cpu.json"
    return calibrate(path, quick=True), path


# --- parsing -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, nodes, per_node, model, intra, inter", [
    ("4xA5000", 1, 4, "A5000", "pcie4", None),
    ("2x4xA5000-ib200", 2, 4, "A5000", "pcie4", "ib200"),
    ("8x8xA100-ib200", 8, 8, "A100-80GB", "nvlink3", "ib200"),
    ("2x8xH100", 2, 8, "H100", "nvlink4", DEFAULT_INTER),
    ("1xH100", 1, 1, "H100", "nvlink4", None),
    ("A100", 1, 1, "A100-80GB", "nvlink3", None),
    ("a100-40gb", 1, 1, "A100-40GB", "nvlink3", None),
    ("4XA5000-PCIE3", 1, 4, "A5000", "pcie3", None),          # one node: LINK replaces intra
    ("2xA100-80GB-ib400", 1, 2, "A100-80GB", "ib400", None),   # hyphenated model, then a link
    ("16x1xT4-eth15", 16, 1, "T4", "pcie3", "eth15"),
    ("V100", 1, 1, "V100-32GB", "nvlink2", None),
    ("  2xh200 ", 1, 2, "H200", "nvlink4", None),
])
def test_parse_grammar(text: str, nodes: int, per_node: int, model: str, intra: str, inter: str | None) -> None:
    c = Cluster.parse(text)
    assert (c.nodes, c.devices_per_node, c.num_devices) == (nodes, per_node, nodes * per_node)
    assert c.device.name == model
    assert c.intra.name == intra
    assert (c.inter.name if c.inter else None) == inter
    assert c.cores == 0 and c.device.kind == "gpu"


@pytest.mark.parametrize("name", list(CLUSTERS))
def test_presets_parse_case_insensitively(name: str) -> None:
    assert Cluster.parse(name.upper()) == CLUSTERS[name]


def test_paper_presets() -> None:
    assert str(Cluster.parse("neutrontask")) == "1 node x 4 A5000 (24 GiB, 27.8 TFLOP/s fp32), intra pcie4 25 GB/s"
    assert str(Cluster.parse("gnnpipe")) == ("2 nodes x 4 A5000 (24 GiB, 27.8 TFLOP/s fp32), intra pcie4 25 GB/s, "
                                             "inter ib200 200 Gbit/s")
    tp = Cluster.parse("neutrontp")
    assert (tp.nodes, tp.devices_per_node, tp.device.name, tp.inter.name) == (16, 1, "T4", "eth15")
    gs = Cluster.parse("gsplit")
    assert (gs.num_devices, gs.device.memory, gs.intra.name) == (4, 16 * GiB, "nvlink2")


@pytest.mark.parametrize("text, fragment", [
    ("4xA6000", "unknown device model 'A6000'"),
    ("2x4xA6000-ib200", "unknown device model 'A6000'"),
    ("4xA5000-ib300", "unknown link 'ib300'"),
    ("0xA100", "must be >= 1"),
    ("", "cannot parse"),
    ("4x", "cannot parse"),
    ("4xx", "unknown device model"),
])
def test_parse_errors_are_helpful(text: str, fragment: str) -> None:
    with pytest.raises(PlanningError) as info:
        Cluster.parse(text)
    message = str(info.value)
    assert fragment in message
    if "model" in fragment or "parse" in fragment:
        assert "A5000" in message and "H200" in message and "ib200" in message   # lists the valid names
    if "link" in fragment:
        assert "eth15" in message and "nvlink4" in message


def test_parse_cpu_without_profile_is_the_placeholder() -> None:
    c = Cluster.parse("4xcpu")
    assert c.device == DEVICES["cpu"] and c.calibration == {}
    assert c.devices_per_node == 4 and c.cores >= 1 and c.intra == LINKS["shm"]
    assert "uncalibrated" in str(c)


def test_parse_unreadable_profile_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(PlanningError, match="bad.json"):
        Cluster.parse("cpu", profile=bad)
    with pytest.raises(PlanningError, match="missing.json"):
        Cluster.parse("cpu", profile=tmp_path / "missing.json")
    with pytest.raises(PlanningError, match="not a CPU host"):
        Cluster.parse("cpu", profile=CLUSTERS["gnnpipe"])


def _cpu_record() -> dict:
    """A CPU calibration record shaped as :func:`calibrate` writes it (the fields the cost models read)."""
    pair = [1e9, 2e9]
    return {"host": socket.gethostname(), "cores": _usable_cores(), "threads": [1, 2],
            "rates": {"flops": {"float32": [50e9, 90e9]}, "mem_bandwidth": pair, "spmm_bandwidth": pair,
                      "edge_rate": pair},
            "runtime": {"stage": [5e-5, 6e-5]},
            "spmm_curve": [{"working_set": 1e6, "bandwidth": pair, "edge_rate": pair}],
            "gemm_curve": [{"width": 16, "forward": pair, "weight_grad": pair, "input_grad": pair}],
            "collectives": {"world_size": 2, "fits": {"all_reduce": {"bandwidth": 1e9, "latency": 1e-4}}},
            "push": {"factor": 1.6}}


@pytest.mark.parametrize("damage, fragment", [
    (lambda c: c["rates"]["flops"].update(float32="fast"), r"\['rates'\]\['flops'\]\['float32'\] must be \[single"),
    (lambda c: c["rates"].update(mem_bandwidth=[0, 0]), r"\['mem_bandwidth'\]\[0\] must be a finite number > 0"),
    (lambda c: c["runtime"].update(stage=1e-4), r"\['runtime'\]\['stage'\] must be \[single thread, all cores\]"),
    (lambda c: c.update(spmm_curve=[{"x": 1}]), r"\['spmm_curve'\]\[0\]\['working_set'\] is missing"),
    (lambda c: c["gemm_curve"][0].pop("forward"), r"\['gemm_curve'\]\[0\]\['forward'\] is missing"),
    (lambda c: c["collectives"].update(fits="nope"), r"\['collectives'\]\['fits'\] must be a dict"),
    (lambda c: c["collectives"].update(world_size=1), r"\['world_size'\] must be an integer >= 2"),
])
def test_a_damaged_calibration_record_names_its_field_and_the_file(tmp_path: Path, damage: Any,
                                                                   fragment: str) -> None:
    """A profile whose record holds what the cost models cannot read is refused when loaded, naming
    the file, the field and how to write a new one (it leaked ValueError, TypeError or KeyError
    from the first plan that used it, or the CLI printed "too many values to unpack")."""
    good = dataclasses.replace(Cluster.parse("1xcpu"), calibration=_cpu_record())
    path = good.save(tmp_path / "profile.json")
    assert Cluster.load(path) == good
    data = json.loads(path.read_text())
    damage(data["calibration"])
    path.write_text(json.dumps(data))
    with pytest.raises(PlanningError, match=fragment) as info:
        Cluster.parse("2xcpu", profile=path)
    assert str(path) in str(info.value) and "`gnncompile calibrate` writes a new one" in str(info.value)


def test_a_profile_argument_of_another_type_and_a_profile_directory_are_refused(
        tmp_path: Path, no_saved_profile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``profile=123`` leaked a TypeError; ``$GNNCOMPILE_PROFILE`` naming a directory planned with the
    uncalibrated placeholder without a word."""
    with pytest.raises(PlanningError, match="profile: expected a Cluster or the path of a saved profile, got int"):
        Cluster.parse("2xcpu", profile=123)
    monkeypatch.setenv("GNNCOMPILE_PROFILE", str(tmp_path))
    with pytest.raises(PlanningError, match=f"the CPU profile {tmp_path} .* is not a file"):
        Cluster.parse("2xcpu")


def test_a_profile_of_another_host_says_so_in_every_prediction() -> None:
    """A CPU profile measured on another host, or with other usable cores, costs this one's ranks
    with that host's rates: predictions say so (they were labelled as calibrated here)."""
    here = dataclasses.replace(Cluster.parse("2xcpu"), calibration=_cpu_record())
    assert here.prediction_label == ""
    other = dataclasses.replace(here, calibration={**_cpu_record(), "host": "elsewhere", "cores": 64})
    assert other.prediction_label == (f" (CPU profile measured on elsewhere, 64 cores; this is {socket.gethostname()}, "
                                      f"{_usable_cores()} cores: `gnncompile calibrate` here)")


def test_plausibility_warnings_name_what_a_busy_host_got_wrong() -> None:
    """A calibration taken while other processes ran can measure all cores below one thread, or
    scattering faster than pulling; the record keeps warnings naming them (the CLI prints them)."""
    from gnncompile.calibration import plausibility_warnings

    assert plausibility_warnings(_cpu_record()) == []
    busy = _cpu_record()
    busy["rates"]["flops"]["float32"] = [50e9, 12e9]
    busy["push"]["factor"] = 0.43
    busy["runtime"]["stage"] = [5e-5, 6.4e-3]
    warnings = plausibility_warnings(busy)
    assert len(warnings) == 3
    assert warnings[0] == "float32 GEMM at 2 threads (1.2e+10/s) measured below 1 thread's (5e+10/s)"
    assert "'stage' at 2 threads (6.4e+03 us) over 10x 1 thread's (50 us)" in warnings[1]
    assert warnings[2].startswith("push_factor 0.43 < 1")


# --- links -------------------------------------------------------------------------------------------

def test_link_intra_vs_inter() -> None:
    c = Cluster.parse("2x4xA5000-ib200")
    assert [c.node_of(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert c.link(0, 3) == LINKS["pcie4"]
    assert c.link(3, 4) == LINKS["ib200"]
    assert c.link(5, 5) == LINKS["pcie4"]
    with pytest.raises(PlanningError, match="rank 8 out of range"):
        c.link(0, 8)


def test_slowest_link() -> None:
    c = Cluster.parse("2x4xA100-ib200")
    assert c.slowest_link([0, 1, 2, 3]) == LINKS["nvlink3"]
    assert c.slowest_link([0, 4]) == LINKS["ib200"]
    assert c.slowest_link(range(8)) == LINKS["ib200"]
    assert c.slowest_link([2]) == LINKS["nvlink3"]
    slow_intra = dataclasses.replace(c, intra=LINKS["eth10"])
    assert slow_intra.slowest_link([0, 1, 4]) == LINKS["eth10"]      # intra pair 0-1 is the slower one
    assert slow_intra.slowest_link([0, 4]) == LINKS["ib200"]         # no two ranks share a node
    with pytest.raises(PlanningError, match="empty"):
        c.slowest_link([])


# --- specs and presets -------------------------------------------------------------------------------

def test_preset_numbers_are_sane() -> None:
    assert 0.9 * 80e9 < DEVICES["A100-80GB"].memory < 1.1 * 80e9
    assert DEVICES["A100"] == DEVICES["A100-80GB"]
    assert DEVICES["A100-40GB"].memory == 40 * GiB
    assert DEVICES["H200"].memory > DEVICES["H100"].memory
    assert DEVICES["H200"].mem_bandwidth > DEVICES["H100"].mem_bandwidth > DEVICES["A100"].mem_bandwidth
    assert DEVICES["V100"].memory == 32 * GiB and DEVICES["V100-16GB"].memory == 16 * GiB
    for name, d in DEVICES.items():
        assert d.flops_for("float32") > 0 and d.spmm_bandwidth < d.mem_bandwidth, name
        if d.kind == "gpu":
            assert d.flops_for("float16") > d.flops_for("float32") > d.flops_for("float64"), name
            assert d.gamma == pytest.approx(0.3) and d.launch_overhead == pytest.approx(5e-6)
    assert DEVICES["cpu"].gamma == 0.0
    assert LINKS["ib200"].bandwidth == pytest.approx(25e9)
    assert LINKS["eth15"].bandwidth == pytest.approx(15e9 / 8)
    assert LINKS["nvlink4"].bandwidth > LINKS["nvlink3"].bandwidth > LINKS["nvlink2"].bandwidth > LINKS["pcie4"].bandwidth
    assert all(l.latency < 1e-4 for l in LINKS.values())


def test_flops_for() -> None:
    a100 = DEVICES["A100"]
    assert a100.flops_for("bf16") == a100.flops_for(torch.bfloat16) == a100.flops["bfloat16"]
    with pytest.raises(PlanningError, match="no FLOP/s for dtype 'bfloat16'.*float32"):
        DEVICES["T4"].flops_for("bfloat16")
    with pytest.raises(PlanningError, match="int8"):
        a100.flops_for("int8")


def test_spec_validation() -> None:
    with pytest.raises(PlanningError, match="gamma"):
        DeviceSpec("x", {"float32": 1e12}, 1e11, GiB, gamma=1.5)
    with pytest.raises(PlanningError, match="mem_bandwidth"):
        DeviceSpec("x", {"float32": 1e12}, -1.0, GiB)
    with pytest.raises(PlanningError, match="latency"):
        LinkSpec("l", 1e9, "fast")
    with pytest.raises(PlanningError, match="inter-node link"):
        Cluster(2, 4, DEVICES["A5000"], LINKS["pcie4"])
    d = DeviceSpec("x", {"float32": 1e12}, 1e11, GiB)
    assert d.spmm_bandwidth == pytest.approx(0.5e11) and d.gamma == 0.3
    assert Cluster.parse("2X4Xa5000-IB200").name == "2x4xA5000-ib200"
    assert hash(Cluster.parse("4xA5000")) == hash(Cluster.parse("4xa5000"))


def test_json_round_trip(tmp_path: Path) -> None:
    for text in ("2x4xA5000-ib200", "neutrontp", "4xcpu"):
        c = Cluster.parse(text)
        assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c
        assert Cluster.load(c.save(tmp_path / "sub" / f"{text}.json")) == c


def test_save_follows_links_writes_pipes_and_never_replaces_them(tmp_path: Path) -> None:
    """A profile saved through a symbolic link replaces the link's target (the link stays: a shared
    profile behind it is updated); a path that is neither a file nor a directory (a pipe, a device
    such as /dev/null) is written as it is, not replaced by a file; a pipe nobody reads is an error,
    not a hang. ``save`` renamed a temporary file over any of them."""
    import os
    import threading

    c = Cluster.parse("4xA5000")
    target, link = tmp_path / "shared.json", tmp_path / "link.json"
    Cluster.parse("2xA5000").save(target)
    link.symlink_to(target)
    c.save(link)
    assert link.is_symlink() and Cluster.load(target) == c
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(PlanningError, match="cannot write cluster profile .*fifo: nothing reads it"):
        c.save(fifo)
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(open(fifo).read()), daemon=True)
    reader.start()
    for _ in range(200):   # until the reader has opened its end
        try:
            c.save(fifo)
            break
        except PlanningError:
            threading.Event().wait(0.01)
    reader.join(10)
    assert got, "the reader got nothing"
    assert fifo.is_fifo() and Cluster.from_dict(json.loads(got[0])) == c
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.json", "shared.json"]  # no temporaries
    with pytest.raises(PlanningError, match="is a directory"):
        c.save(tmp_path)


def test_concurrent_saves_and_loads_see_whole_profiles(tmp_path: Path) -> None:
    """Saves at once each write a temporary file of their own and rename it over the profile: every
    save succeeds and a reader always loads one whole profile (with one fixed temporary name, a
    save failed on the other's rename and readers saw empty or mixed files)."""
    import threading

    path = tmp_path / "profile.json"
    profiles = [Cluster.parse("4xA5000"), Cluster.parse("2x4xA100-ib200")]
    profiles[0].save(path)
    errors: list[BaseException] = []
    done = threading.Event()

    def save(c: Cluster) -> None:
        try:
            for _ in range(150):
                c.save(path)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def load() -> None:
        while not done.is_set():
            try:
                assert Cluster.load(path) in profiles
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return

    writers = [threading.Thread(target=save, args=(c,)) for c in profiles]
    reader = threading.Thread(target=load)
    for t in (*writers, reader):
        t.start()
    for t in writers:
        t.join()
    done.set()
    reader.join()
    assert not errors, errors[:3]
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cluster.json"
    data = Cluster.parse("4xA5000").to_dict()
    for broken, fragment in ((dict(data, nodes=0), "nodes"), (dict(data, speed=1), "unknown field"),
                             ({k: v for k, v in data.items() if k != "device"}, "missing field"),
                             (dict(data, format="other"), "format"), ([1, 2], "JSON object")):
        path.write_text(json.dumps(broken))
        with pytest.raises(PlanningError, match=fragment) as info:
            Cluster.load(path)
        assert str(path) in str(info.value)


# --- CPU: calibration and per-rank scaling -----------------------------------------------------------

def test_calibrate_quick(calibrated: tuple[Cluster, Path]) -> None:
    c, path = calibrated
    d = c.device
    numbers = [*d.flops.values(), d.mem_bandwidth, d.spmm_bandwidth, d.launch_overhead, d.memory,
               c.intra.bandwidth, c.intra.latency]
    assert all(math.isfinite(v) and v > 0 for v in numbers)
    assert d.kind == "cpu" and d.gamma == 0.0 and c.name.startswith("cpu (calibrated ")
    assert (c.nodes, c.devices_per_node) == (1, 1) and c.cores >= 1
    single, all_cores = c.calibration["rates"]["flops"]["float32"]
    # the all-core rate is what the cores gave under the load of the moment (tests run in parallel),
    # but no measurement scales beyond the cores
    assert 0 < all_cores <= 1.5 * c.cores * single
    assert d.flops["float32"] == all_cores
    for key in ("host", "date", "torch", "gemm", "stream", "spmm", "op_overhead", "collectives"):
        assert key in c.calibration
    # what a computation loses right after a collective (the thread switches of its wait), charged
    # to compute instructions that follow waits
    switch = c.calibration["collectives"]["switch"]
    assert switch["seconds"] == max(0.0, switch["seconds_after_collective"] - switch["seconds_in_a_row"])
    assert d.runtime["switch"] == switch["seconds"] and switch["seconds_in_a_row"] > 0
    # the runtime's fixed costs, a checkpointed segment's included
    assert {"stage", "op_forward", "op_backward", "segment", "comm", "optimizer_tensor", "step"} <= set(d.runtime)
    assert all(v >= 0 for v in d.runtime.values())
    # ... at one thread (the device's) and at all cores (what a rank of that many threads pays)
    threaded = c.calibration["runtime"]
    assert set(threaded) == set(d.runtime) - {"switch"}
    assert all(threaded[k][0] == d.runtime[k] and threaded[k][1] >= 0 for k in threaded)
    assert c.rank_device(0).runtime["op_forward"] == pytest.approx(threaded["op_forward"][1 if c.cores > 1 else 0])
    assert set(c.calibration["collectives"]["fits"]) == {"all_reduce", "all_to_all"}
    # collectives are fitted on calls made as a step makes them (after computing); back to back kept
    assert set(c.calibration["collectives"]["seconds_back_to_back"]) == {"all_reduce", "all_to_all"}
    # the products of a linear layer by output width, and the loss, at one thread and all cores
    widths = [p["width"] for p in c.calibration["gemm_curve"]]
    assert widths == sorted(widths) and widths[0] <= 8 and widths[-1] >= 64
    assert [p[0] for p in d.gemm_curve] == widths
    assert all(v > 0 for p in d.gemm_curve for v in p)
    assert d.gemm_rates(16) is not None
    # and with a deep input (a first layer on dense features), over the same widths
    assert [p["width"] for p in c.calibration["gemm_deep_curve"]] == widths == [p[0] for p in d.gemm_deep_curve]
    assert d.gemm_inner == c.calibration["linear"]["inner"] < d.gemm_deep_inner == c.calibration["linear_deep"]["inner"]
    assert all(v > 0 for p in d.gemm_deep_curve for v in p)
    assert d.loss_rate == c.calibration["rates"]["loss_rate"][1] > 0 and d.loss_grad_rate > 0
    assert Cluster.load(path) == c
    assert "uncalibrated" not in str(c)


def test_parse_reuses_profile(calibrated: tuple[Cluster, Path], no_saved_profile: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    c, path = calibrated
    for profile in (path, str(path), c):
        four = Cluster.parse("4xcpu", profile=profile)
        assert four.device == c.device and four.intra == c.intra and four.calibration == c.calibration
        assert (four.devices_per_node, four.cores) == (4, c.cores)
    assert Cluster.parse("4xcpu").device == DEVICES["cpu"]           # no saved profile yet
    c.save(no_saved_profile)
    assert default_profile_path() == no_saved_profile
    assert Cluster.parse("4xcpu").device == c.device                 # the saved one is found
    assert Cluster.parse("4xcpu-eth10").intra == LINKS["eth10"]


def test_cpu_rank_device_time_shares_cores(calibrated: tuple[Cluster, Path]) -> None:
    c, _ = calibrated
    two_cores = dataclasses.replace(c, cores=2)
    rates = c.calibration["rates"]
    single = rates["flops"]["float32"][0]
    two = dataclasses.replace(two_cores, devices_per_node=2).rank_device(1)
    four = dataclasses.replace(two_cores, devices_per_node=4).rank_device(3)
    assert two.flops_for("float32") == pytest.approx(single)                 # one thread each, own core
    assert four.flops_for("float32") == pytest.approx(single / 2)            # 4 threads on 2 cores
    assert four.mem_bandwidth == pytest.approx(two.mem_bandwidth / 2)
    assert four.spmm_bandwidth == pytest.approx(two.spmm_bandwidth / 2)
    assert four.memory == c.device.memory // 4
    one = dataclasses.replace(two_cores, devices_per_node=1).rank_device(0)   # one rank, both cores
    assert one.flops_for("float32") == pytest.approx(rates["flops"]["float32"][1])


def test_rank_device_interpolates_in_threads() -> None:
    rates = {"flops": {"float32": [10.0, 40.0]}, "mem_bandwidth": [5.0, 8.0], "spmm_bandwidth": [4.0, 4.0]}
    base = Cluster(1, 1, DEVICES["cpu"], LINKS["shm"], cores=4, calibration={"rates": rates})
    two_threads = dataclasses.replace(base, threads_per_rank=2).rank_device()
    assert two_threads.flops_for("float32") == pytest.approx(20.0)
    assert two_threads.mem_bandwidth == pytest.approx(6.0)
    eight = dataclasses.replace(base, threads_per_rank=8).rank_device()      # oversubscribed: 8 on 4
    assert eight.flops_for("float32") == pytest.approx(80.0 * 0.5)
    assert eight.spmm_bandwidth == pytest.approx(4.0 * 0.5)                   # flat past all cores
    assert Cluster.parse("A100").rank_device() is DEVICES["A100"]
    placeholder = dataclasses.replace(Cluster.parse("cpu"), cores=4, devices_per_node=4)
    assert placeholder.rank_device().flops_for("float32") == pytest.approx(DEVICES["cpu"].flops["float32"] / 4)


def test_an_oversubscribed_host_time_shares_its_links() -> None:
    """Four one-thread ranks on two cores: a message waits twice as long for its peer to be
    scheduled and its copies run at half the rate; two ranks on two cores, and GPUs, see the link."""
    four = Cluster(1, 4, DEVICES["cpu"], LINKS["shm"], cores=2, threads_per_rank=1)
    assert four.oversubscription == 2.0
    shared = four.time_shared(LINKS["shm"])
    assert shared.latency == pytest.approx(2 * LINKS["shm"].latency)
    assert shared.bandwidth == pytest.approx(LINKS["shm"].bandwidth / 2)
    assert dataclasses.replace(four, devices_per_node=2).time_shared(LINKS["shm"]) is LINKS["shm"]
    assert Cluster.parse("4xA100").time_shared(LINKS["nvlink3"]) is LINKS["nvlink3"]


def test_ranks_of_a_host_share_its_memory_bound_rates() -> None:
    """Two one-thread ranks on two cores each get half the host's two-thread bandwidth (never more
    than a lone thread's); compute rates stay a lone thread's; one rank keeps the interpolation."""
    rates = {"flops": {"float32": [10.0, 20.0]}, "mem_bandwidth": [6.0, 8.0], "spmm_bandwidth": [4.0, 10.0],
             "edge_rate": [3.0, 5.0]}
    curve = [{"working_set": 1000, "bandwidth": [9.0, 12.0], "edge_rate": [2.0, 2.0]}]
    host = Cluster(1, 2, DEVICES["cpu"], LINKS["shm"], cores=2, threads_per_rank=1,
                   calibration={"rates": rates, "spmm_curve": curve})
    d = host.rank_device(1)
    assert d.flops_for("float32") == pytest.approx(10.0)
    assert d.mem_bandwidth == pytest.approx(4.0) and d.host_bandwidth == pytest.approx(4.0)
    assert d.spmm_bandwidth == pytest.approx(4.0)            # a lone thread's 4 < the host's 10 / 2
    assert d.edge_rate == pytest.approx(2.5)
    assert d.spmm_curve == ((1000, pytest.approx(6.0), pytest.approx(1.0)),)
    four = dataclasses.replace(host, devices_per_node=4).rank_device(3)   # 4 one-thread ranks on 2 cores
    assert four.mem_bandwidth == pytest.approx(2.0) and four.flops_for("float32") == pytest.approx(5.0)
    one = dataclasses.replace(host, devices_per_node=1, threads_per_rank=2).rank_device(0)
    assert one.mem_bandwidth == pytest.approx(8.0) and one.spmm_bandwidth == pytest.approx(10.0)


def test_calibrate_needs_two_ranks() -> None:
    with pytest.raises(PlanningError, match="world_size"):
        calibrate(world_size=1)


@pytest.mark.parametrize("kwargs, fragment", [
    ({"world_size": 1}, "world_size must be an integer >= 2"),
    ({"world_size": True}, "world_size must be an integer >= 2"),
    ({"world_size": 2.0}, "world_size must be an integer >= 2"),
    ({"backend": "mpi"}, "unknown backend 'mpi'; valid: gloo, nccl"),
    ({"quick": "yes"}, "quick must be True or False"),
    ({"path": 3}, "path must be a file path or None"),
    ({"path": "/"}, "path: / is a directory"),          # (it measured for 20 s, then failed to write)
    ({"path": ""}, "path: an empty path"),
    pytest.param({"backend": "nccl"}, "backend='nccl' runs between GPUs and this machine has none",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a machine "
                                                                                     "without CUDA: this one has a GPU")),
])
def test_calibrate_checks_its_arguments_before_measuring(kwargs: dict, fragment: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad argument is refused at once: nothing is launched or measured."""
    import gnncompile.calibration as calibration

    def no_launch(*args: object, **kw: object) -> None:
        raise AssertionError("calibrate launched ranks before checking its arguments")

    monkeypatch.setattr(calibration, "launch", no_launch)
    with pytest.raises(PlanningError, match=fragment):
        calibration.calibrate(**kwargs)


def test_calibrate_is_public_and_no_longer_a_cluster_method() -> None:
    import gnncompile as gc

    assert gc.calibrate is calibrate
    assert not hasattr(Cluster, "calibrate")   # it launches the runtime: above the cost models


def test_cpu_cluster_label_says_the_host_memory_is_shared() -> None:
    c = Cluster.parse("4xcpu")
    assert "host memory shared by 4 ranks" in str(c)
    assert c.rank_device(0).memory * 4 == pytest.approx(c.device.memory, rel=1e-6)


def test_local_cluster_with_more_ranks_than_gpus_shares_them(monkeypatch, fake_gpus) -> None:
    """A one-GPU machine plans 4 ranks as 4 shares of its GPU (the runtime's shared-GPU mode)."""
    a100 = DEVICES["A100-80GB"]
    fake_gpus("NVIDIA A100-SXM4-80GB", 1, a100.memory)
    monkeypatch.delenv("GNNCOMPILE_DEVICE", raising=False)
    one = Cluster.local(1)
    assert one.num_devices == 1 and one.device.name == "A100-80GB"
    four = Cluster.local(4)
    assert four.num_devices == 4 and four.device.memory == a100.memory // 4
    assert four.device.flops["float32"] == pytest.approx(a100.flops["float32"] / 4)
    assert four.intra.name == "shm" and "sharing" in four.name
    assert Cluster.from_dict(four.to_dict()) == four
    three = Cluster.shared_gpus(3, 2, a100)           # 2 ranks on one GPU, 1 on the other: cost as halves
    assert three.device.memory == a100.memory // 2
    monkeypatch.setenv("GNNCOMPILE_DEVICE", "cpu")      # ranks told to compute on the CPU: planned for it
    assert Cluster.local(4).device.kind == "cpu"
