"""Runs gnncompile's CUDA kernels (``kernels/csrc/spmm.cu``) on the CPU, for tests on machines without a GPU.

:func:`emulator` compiles the kernel source with g++ against ``tests/cuda_emu.h`` (every CUDA
thread an OS thread, shuffles real exchanges; see there), once per source and header (cached in
the temporary directory under a file lock), and returns a runner that executes
:class:`gnncompile.kernels.cuda.Launch` records on CPU tensors: the same launch plans, kernel
instances and argument packing that :class:`~gnncompile.kernels.cuda.CupyRunner` sends to a GPU.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import numpy as np

from gnncompile.kernels import cuda

HEADER = Path(__file__).with_name("cuda_emu.h")
_CTYPES = {np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.int64): ctypes.c_int64,
           np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
           np.dtype(np.uint8): ctypes.c_uint8, np.dtype(np.float32): ctypes.c_float,
           np.dtype(np.float64): ctypes.c_double}


def kernel_names() -> list[str]:
    """Every kernel instance the launch plans can name (what the GPU module holds)."""
    return list(cuda.kernel_instances())


class Emulator:
    """A runner for :class:`~gnncompile.kernels.cuda.Launch` records over CPU tensors."""

    def __init__(self, library: Path) -> None:
        self._lib = ctypes.CDLL(str(library))
        self._lib.emu_launch.restype = ctypes.c_int
        self.launches: list[cuda.Launch] = []

    def __call__(self, launch: cuda.Launch) -> None:
        self.launches.append(launch)
        cargs = []
        for a in launch.args:
            kind = _CTYPES.get(np.asarray(a).dtype)
            if kind is None:
                raise TypeError(f"{launch.kernel}: argument {a!r} of type {type(a).__name__} is not a NumPy "
                                f"scalar of {sorted(str(t) for t in _CTYPES)} (CuPy would pack it with another size)")
            cargs.append(kind(a))
        params = (ctypes.c_void_p * len(cargs))(*[ctypes.addressof(c) for c in cargs])
        error = ctypes.create_string_buffer(512)
        rc = self._lib.emu_launch(launch.kernel.encode(), *[ctypes.c_uint(v) for v in launch.grid + launch.block],
                                  params, error, ctypes.c_int(len(error)))
        if rc:
            raise RuntimeError(f"{launch}: {error.value.decode()}")


def _build(out: Path) -> None:
    reg = out.with_suffix(".cpp")
    lines = [f'#include "{cuda.SOURCE}"']
    lines += [f'EMU_REGISTER("{n}", {n})' for n in kernel_names()]
    reg.write_text("\n".join(lines) + "\n")
    tmp = out.with_suffix(".tmp.so")
    cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-include", str(HEADER), str(reg), "-o", str(tmp)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"building the CUDA emulation failed:\n{proc.stderr[-4000:]}")
    tmp.rename(out)


_emulator: Optional[Emulator] = None


def emulator() -> Emulator:
    """The emulation runner (built on first use; raises when g++ is missing)."""
    global _emulator
    if _emulator is None:
        if shutil.which("g++") is None:
            raise RuntimeError("the CUDA emulation needs g++")
        h = hashlib.sha256()
        for p in (Path(cuda.SOURCE), HEADER, Path(__file__)):
            h.update(p.read_bytes())
        folder = Path(tempfile.gettempdir()) / "gnncompile_cuda_emu"
        folder.mkdir(exist_ok=True)
        lib = folder / f"emu_{h.hexdigest()[:16]}.so"
        with open(folder / "build.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not lib.exists():
                _build(lib)
        _emulator = Emulator(lib)
    return _emulator


def nvrtc_library() -> Optional[Path]:
    """NVRTC's shared library (the ``nvidia-cuda-nvrtc`` wheel of the dev extras, or a CUDA toolkit's), or None."""
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(root).glob("cu*/lib/libnvrtc.so*")) + sorted(Path(root).glob("cuda_nvrtc/lib/libnvrtc.so*"))
        if found:
            return found[0]
    import ctypes.util

    name = ctypes.util.find_library("nvrtc")
    return Path(name) if name else None


def nvrtc_compile(source: str, names: list[str], options: list[str]) -> tuple[int, str, dict[str, str]]:
    """Compile ``source`` with NVRTC as CuPy's ``RawModule`` does (no headers, ``names`` as name
    expressions): ``(result code, log, lowered name of each expression)``; 0 is success."""
    lib = ctypes.CDLL(str(nvrtc_library()))
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"spmm.cu", 0, None, None)
    if rc:
        return rc, "nvrtcCreateProgram failed", {}
    try:
        for n in names:
            lib.nvrtcAddNameExpression(prog, n.encode())
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        lowered = {}
        if rc == 0:
            for n in names:
                ptr = ctypes.c_char_p()
                lib.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(ptr))
                lowered[n] = ptr.value.decode() if ptr.value else ""
        return rc, log.value.decode(errors="replace"), lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
