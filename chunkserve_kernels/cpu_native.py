"""The native CPU kernels (chunkserve_kernels/csrc/*.cpp): built once per machine, loaded once per process,
and used per --cpu-kernels for float32 decode attention and K/V writes (the torch backend), the
decoder's residual add + RMSNorm (models/layers.RMSNorm), a few-row float32 product (the linear
plan's "gemv" kernel, models/linear_plan.py) and, for small pure-decode steps, whole decoder
layers (cpu_layer.cpp's DecodeLayers: the same ops without Python between them; models/llama.py).

Why built here rather than shipped: the ops are a few dozen lines of plain C++ compiled with
-march=native (the compiler vectorises them for the CPU at hand: 16-float vectors with AVX512,
8 with AVX2; measured on both), and a
prebuilt library would need one build per CPU class and torch version. Building takes ~10 s
on 2 cores (no pybind, only torch's library headers) and needs a C++ compiler and ninja; the
result is kept in torch's extensions folder ($TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions) under a name that hashes everything it depends on (the source,
the flags, torch's version, the CPU), so a later start, another test or another executor on
the same machine loads it in milliseconds, and a change of any of those builds anew.

Where the build fails (no compiler, no ninja, an unusual platform) `load` says why and the
aten ops serve: `--cpu-kernels auto` logs it, `native` refuses to start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import threading
from pathlib import Path

import torch

from chunkserve_contracts.cpu import cpu_info

log = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name("csrc") / n
    for n in (
        "cpu_attention.cpp",
        "cpu_rotary.cpp",
        "cpu_silu.cpp",
        "cpu_argmax.cpp",
        "cpu_linear.cpp",
        "cpu_layer.cpp",
    )
)
HEADERS = tuple(Path(__file__).with_name("csrc") / n for n in ("cpu_ops.h", "cpu_attention_tiles.h"))
# -fassociative-math (with its prerequisites) lets the float sums vectorise; not -ffast-math,
# which would also assume no infinities (the softmax starts from -inf) and, on GCC < 13, link
# crtfastmath into the library: loading it would switch the whole process to flush-to-zero.
CFLAGS = (
    "-O3",
    "-march=native",
    "-fopenmp",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fassociative-math",
    "-fno-signed-zeros",
    "-freciprocal-math",
)
LDFLAGS = ("-fopenmp", "-lmvec")  # libmvec: glibc's vector expf, see the source

_lock = threading.Lock()
_state: dict[str, object] = {}  # "loaded": True, or "error": why the load failed (once per process)


def build_name() -> str:
    """The library's name: what it is built from and for, hashed."""
    key = "\n".join(
        [
            *(src.read_text() for src in SOURCES + HEADERS),
            " ".join(CFLAGS),
            " ".join(LDFLAGS),
            torch.__version__,
            cpu_info().describe(),  # -march=native code is valid only on CPUs with these flags
        ]
    )
    return "chunkserve_cpu_" + hashlib.sha256(key.encode()).hexdigest()[:16]


def build_root() -> Path:
    """Where built libraries are kept: torch's extensions folder, as torch's own builder uses."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / "chunkserve"


def _with_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` wheel puts it in the virtualenv's bin,
    which is not on PATH when the venv's python is run without activating it."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def load() -> str | None:
    """Builds (first time on this machine) and loads the ops; None when they are usable as
    `torch.ops.chunkserve.*`, else why not. Safe to call repeatedly and from threads: one
    attempt per process (a TORCH_LIBRARY namespace registers once)."""
    with _lock:
        if "loaded" in _state:
            return None
        if "error" in _state:
            return str(_state["error"])
        try:
            _load()
            _state["loaded"] = True
            return None
        except Exception as e:  # noqa: BLE001 - any failure means "use the aten path", said once
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
            _state["error"] = reason
            return reason


def _load() -> None:
    if platform.system() != "Linux":
        raise RuntimeError(f"built and tested on Linux only (this is {platform.system()})")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise RuntimeError("no C++ compiler (c++ / $CXX) on PATH")
    from torch.utils import cpp_extension

    _with_ninja_on_path()
    name = build_name()
    folder = build_root() / name
    built = folder / f"{name}.so"
    if built.exists():  # a previous process built it: load without running the builder at all
        try:
            torch.ops.load_library(str(built))
            return
        except OSError:  # half-written by a build in progress: the builder below waits for it
            pass
    folder.mkdir(parents=True, exist_ok=True)
    log.info("building the native CPU kernels (once per machine, ~10 s) in %s", folder)
    cpp_extension.load(
        name=name,
        sources=[str(src) for src in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(folder),
        is_python_module=False,
        verbose=False,
    )


def loaded() -> bool:
    """Whether `load` succeeded in this process."""
    return "loaded" in _state
