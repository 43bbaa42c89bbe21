"""The native CPU kernels' build key (`gnncompile.kernels.native_extension_name`) and build line.

Two checkouts or virtual environments must never share (and so rebuild) one extension build: the
extension name is a hash of the source and its path, the torch build, the interpreter and the flags. Nothing
here compiles: the loader is exercised with torch's ``load`` replaced by a stub.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

from gnncompile import kernels

SOURCE = b"// kernels\nint f() { return 1; }\n"
TORCH = "2.13.0 /venv-a/lib/python3.11/site-packages/torch"
PY = "/venv-a/bin/python 3.11.9 (main) [GCC 12]"


def test_name_is_a_stable_valid_module_name() -> None:
    name = kernels.native_extension_name(SOURCE, TORCH, PY)
    assert name == kernels.native_extension_name(SOURCE, TORCH, PY)
    assert name.startswith("gnncompile_native_") and name.isidentifier()
    assert len(name) == len("gnncompile_native_") + 12


CHANGES = {
    "source": SOURCE + b"// edited\n",
    "torch_version": "2.13.0 /venv-b/lib/python3.11/site-packages/torch",  # another venv, same torch version
    "interpreter": "/venv-b/bin/python 3.11.9 (main) [GCC 12]",
    "flags": ("-O2",),
    "source_path": "/checkout-b/gnncompile/kernels/csrc/spmm.cpp",  # another checkout of the same source
}


@pytest.mark.parametrize("changed", sorted(CHANGES))
def test_name_changes_with_every_input(changed: str) -> None:
    args: dict[str, Any] = dict(source=SOURCE, torch_version=TORCH, interpreter=PY, flags=("-O3",),
                                source_path="/checkout-a/gnncompile/kernels/csrc/spmm.cpp")
    base = kernels.native_extension_name(**args)
    args[changed] = CHANGES[changed]
    assert kernels.native_extension_name(**args) != base


def test_parts_are_delimited() -> None:
    """Moving bytes from one part to the next must change the key (no ambiguous concatenation)."""
    assert kernels.native_extension_name(b"ab", "c", PY) != kernels.native_extension_name(b"a", "bc", PY)


def test_build_key_describes_this_environment() -> None:
    key = kernels._native_build_key()
    source, torch_id, interpreter = key["source"], key["torch_version"], key["interpreter"]
    with open(kernels._NATIVE_SOURCE, "rb") as f:
        assert source == f.read()
    assert key["source_path"] == os.path.realpath(kernels._NATIVE_SOURCE)
    assert torch.__version__ in torch_id and os.path.dirname(torch.__file__) in torch_id
    assert sys.executable in interpreter and sys.version in interpreter


@pytest.fixture
def fake_load(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> list[dict[str, Any]]:
    """``torch.utils.cpp_extension.load`` replaced by a recorder; the extension cache in ``tmp_path``."""
    import torch.utils.cpp_extension as cpp_extension

    calls: list[dict[str, Any]] = []

    def load(name: str, sources: list[str], **kwargs: Any) -> object:
        calls.append(dict(name=name, sources=sources, **kwargs))
        return object()

    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "_native_module", None)
    monkeypatch.setattr(kernels, "_native_error", None)
    return calls


def test_loader_builds_under_the_keyed_name_and_says_so_once(fake_load: list[dict[str, Any]], tmp_path: Any,
                                                             capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    name = kernels.native_extension_name(**kernels._native_build_key())
    kernels._load_native()
    (call,) = fake_load
    assert call["name"] == name
    assert call["build_directory"] == os.path.join(str(tmp_path), name)
    assert call["sources"] == [kernels._NATIVE_SOURCE]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "gnncompile: building native CPU kernels" in err
    # a build already in the cache is loaded without the line
    with open(os.path.join(str(tmp_path), name, f"{name}.so"), "w"):
        pass
    monkeypatch.setattr(kernels, "_native_module", None)
    kernels._load_native()
    assert len(fake_load) == 2 and capsys.readouterr().err == ""


def test_gpu_extras_pick_the_cupy_build_by_cuda_major_and_cpu_setup_installs_none() -> None:
    import tomllib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert [d.split(">")[0] for d in extras["gpu-cuda12"]] == ["cupy-cuda12x"]
    assert [d.split(">")[0] for d in extras["gpu-cuda13"]] == ["cupy-cuda13x"]
    assert extras["gpu"] == extras["gpu-cuda12"]
    assert not any("cupy" in d for name in ("dev", "pyg") for d in extras[name])
    with open(os.path.join(root, "scripts", "setup.sh")) as f:
        assert "cupy" not in f.read()


def test_a_killed_builds_lock_does_not_hang_the_next_load(fake_load: list[dict[str, Any]], tmp_path: Any) -> None:
    """torch's build lock left by a killed build is removed (our flock shows nobody is building)."""
    name = kernels.native_extension_name(**kernels._native_build_key())
    build_dir = os.path.join(str(tmp_path), name)
    os.makedirs(build_dir)
    with open(os.path.join(build_dir, "lock"), "w"):
        pass
    kernels._load_native()
    assert len(fake_load) == 1 and not os.path.exists(os.path.join(build_dir, "lock"))


def test_a_loaded_build_is_imported_directly_by_later_processes(tmp_path: Any) -> None:
    """Once torch's build has been loaded (the mark beside it), a new process imports the library
    itself: without ``torch.utils.cpp_extension`` (which imports setuptools, a fifth of a second in
    every rank) and with the same module."""
    import subprocess

    try:
        module = kernels._load_native()
    except kernels.KernelError as exc:
        pytest.skip(f"the native C++ kernels did not build on this machine: {exc}")
    code = ("import sys, gnncompile.kernels as k; m = k._load_native(); "
            "print(m.__file__, 'torch.utils.cpp_extension' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == [module.__file__, "False"]


def test_a_missing_mark_or_a_broken_library_goes_through_torch(tmp_path: Any) -> None:
    """Without the mark (a build not loaded yet, maybe unfinished) or with a library that does not
    import, :func:`kernels._import_built` declines and the loader goes through torch's ``load``."""
    name = "gnncompile_native_000000000000"
    with open(tmp_path / f"{name}.so", "wb") as f:
        f.write(b"\x7fELF truncated")
    assert kernels._import_built(name, str(tmp_path)) is None
    (tmp_path / kernels._BUILT_MARK).write_text(f"{name}.so\n")
    assert kernels._import_built(name, str(tmp_path)) is None and name not in sys.modules


def test_the_default_cache_is_torchs() -> None:
    from torch.utils.cpp_extension import get_default_build_root

    assert kernels._default_extensions_root() == get_default_build_root()
