"""Compile a C++ XLA FFI kernel of this folder into a shared library, once per source and
machine, and load it.

The library is built with `-march=native` (the kernels are tuned to the CPU that runs
them) into `<eaglejax cache>/native/<key>/`, where the key hashes the source and the
headers beside it (`*.h`), the jaxlib version, the compiler and the CPU; a build goes to a
temporary name and is renamed into place, so concurrent processes never load a
half-written file. `$CXX` picks the compiler (default `g++`, then `c++`, then `clang++`);
`EAGLEJAX_NATIVE=0` turns native kernels off.
Loading a target on CPU (or the first kernel asked for) starts the builds of every kernel
in the folder at once in the background, one compiler process per core (a cold start spent
about 16 s of compiler time when there were six kernels: half of it on two cores). A failed build is reported once, when its kernel is
loaded (a warning with the compiler's message), and that kernel returns None.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import jax
import jaxlib

from eaglejax import hardware
from eaglejax.compilation_cache import cache_root, switched_on

SWITCH_ENV = "EAGLEJAX_NATIVE"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
_SOURCE_DIR = Path(__file__).parent
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_builds: dict[Path, concurrent.futures.Future] = {}  # by source, started together


def enabled() -> bool:
    """False with $EAGLEJAX_NATIVE off; ConfigError naming the variable for other values."""
    return switched_on(SWITCH_ENV)


def compiler() -> str | None:
    """The C++ compiler to use, or None when there is none."""
    for name in filter(None, (os.environ.get("CXX"), "g++", "c++", "clang++")):
        if path := shutil.which(name):
            return path
    return None


def _build(source: Path, cxx: str) -> Path:
    headers = [header.read_bytes() for header in sorted(source.parent.glob("*.h"))]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(b"\0".join([
        source.read_bytes(), *headers,
        jaxlib.__version__.encode(), version.encode(), " ".join(FLAGS).encode(),
        repr(sorted(hardware.isa_features())).encode(), hardware.cpu_model().encode(),
    ])).hexdigest()[:16]
    target = cache_root() / "native" / key / f"{source.stem}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
        partial = Path(tmp.name)
    try:
        command = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(partial)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def _start(sources: list[Path], cxx: str) -> None:
    """Start the builds of `sources` not started yet, one compiler process per core."""
    pending = [source for source in dict.fromkeys(sources) if source not in _builds]
    if pending:
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1)
        for source in pending:
            _builds[source] = pool.submit(_build, source, cxx)
        pool.shutdown(wait=False)


def start_builds() -> None:
    """Start building every kernel in the background, without waiting (`load_target` does,
    so the compiler runs while the model loads); nothing when kernels are switched off or
    there is no compiler."""
    cxx = compiler()
    if enabled() and cxx is not None:
        with _lock:
            _start(sorted(_SOURCE_DIR.glob("*.cc")), cxx)


def _started_build(source: Path, cxx: str) -> concurrent.futures.Future:
    """The build of `source`, started (with every other kernel beside it not yet started)
    if it was not."""
    _start([*sorted(source.parent.glob("*.cc")), source], cxx)
    return _builds[source]


def load(name: str) -> ctypes.CDLL | None:
    """The built library of `<name>.cc`, or None (switched off, no compiler, or the build
    failed: warned once)."""
    with _lock:
        if name not in _loaded:
            _loaded[name] = None
            cxx = compiler()
            if enabled() and cxx is not None:
                try:
                    built = _started_build(_SOURCE_DIR / f"{name}.cc", cxx).result()
                    _loaded[name] = ctypes.cdll.LoadLibrary(str(built))
                except (OSError, RuntimeError) as err:
                    warnings.warn(f"eaglejax: native kernel {name} unavailable, using XLA's "
                                  f"instead: {err}", RuntimeWarning, stacklevel=2)
        return _loaded[name]


def register(name: str, targets: dict[str, str]) -> bool:
    """Load `<name>.cc`'s library and register each XLA FFI target name -> handler symbol
    for the CPU; False when the library is unavailable."""
    library = load(name)
    if library is None:
        return False
    for target, symbol in targets.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                    platform="cpu")
    return True
