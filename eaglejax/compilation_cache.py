"""JAX's persistent compilation cache for eaglejax's compiled prefill and decode loops.

A one-shot `eaglejax generate` spends most of its time compiling; with the cache on, the
next process loads the same programs from disk instead. The folder is
`$EAGLEJAX_CACHE/jax-compilation`, else `$XDG_CACHE_HOME/eaglejax/jax-compilation`, else
`~/.cache/eaglejax/jax-compilation`.

eaglejax points JAX at that folder when it first compiles a loop, not at import: importing
eaglejax changes no JAX setting, and a cache folder the user gave JAX before the first
`generate` (`jax_compilation_cache_dir`, `$JAX_COMPILATION_CACHE_DIR`) is used as it is,
with the user's thresholds. JAX opens the folder at its first cache read, not at its first
compile, so the eager operations that run while a model loads do not get in the way. In
eaglejax's own folder every eaglejax program is written whatever its compile time or size
(JAX's default skips programs compiled in under a second); other programs keep JAX's
thresholds. Opt out with `EAGLEJAX_COMPILATION_CACHE=0`, `disable()` or the CLI's
`--no-compilation-cache`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import jax

from eaglejax.errors import ConfigError

SWITCH_ENV = "EAGLEJAX_COMPILATION_CACHE"
ROOT_ENV = "EAGLEJAX_CACHE"
_OFF = ("0", "false", "no", "off")
_ON = ("", "1", "true", "yes", "on")
_MIN_TIME = "jax_persistent_cache_min_compile_time_secs"
_MIN_SIZE = "jax_persistent_cache_min_entry_size_bytes"

# Guards the state below and the thresholds while compiling; reentrant: the server's warm-up
# holds it around compiles that take it again.
_lock = threading.RLock()
_disabled = False
_our_dir: str | None = None  # the folder eaglejax gave JAX, once it has


def cache_root() -> Path:
    """eaglejax's cache folder: $EAGLEJAX_CACHE, else $XDG_CACHE_HOME/eaglejax, else
    ~/.cache/eaglejax."""
    root = os.environ.get(ROOT_ENV)
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "eaglejax"


def default_dir() -> Path:
    """eaglejax's compilation cache folder (see the module docstring)."""
    return cache_root() / "jax-compilation"


def switched_on(variable: str) -> bool:
    """An on/off environment variable that is on when unset (1/true/yes/on or 0/false/no/off,
    any case); ConfigError naming the variable for any other value."""
    value = os.environ.get(variable, "").strip().lower()
    if value not in _ON + _OFF:
        raise ConfigError(f"${variable} must be 1 or 0, got {value!r}")
    return value not in _OFF


def enabled() -> bool:
    """False after `disable()` or with $EAGLEJAX_COMPILATION_CACHE off; ConfigError naming
    the variable for a value that is neither on nor off."""
    return switched_on(SWITCH_ENV) and not _disabled


def disable() -> None:
    """Keep eaglejax from turning JAX's persistent cache on in this process; call it before
    the first `generate` (ConfigError once eaglejax's cache is in use: JAX keeps an opened
    cache for the life of the process)."""
    global _disabled
    with _lock:
        if _our_dir is not None:
            raise ConfigError(f"the compilation cache {_our_dir} is already in use in this "
                              f"process; set {SWITCH_ENV}=0 before the first generate")
        _disabled = True


def _use_our_folder() -> bool:
    """Give JAX eaglejax's folder unless it has one or the user opted out (once per process);
    True when the folder in use is eaglejax's."""
    global _our_dir
    current = jax.config.jax_compilation_cache_dir
    if _our_dir is None and current is None and enabled():
        _our_dir = str(default_dir())
        jax.config.update("jax_compilation_cache_dir", _our_dir)
        current = _our_dir
    return _our_dir is not None and current == _our_dir


@contextlib.contextmanager
def caching_every_program() -> Iterator[None]:
    """Around each eaglejax compile: turn the cache on at first use and, in eaglejax's own
    folder, write the program however quickly it compiled. Compiles inside are serialised
    (the thresholds are process-wide settings)."""
    with _lock:
        if not _use_our_folder():
            yield
            return
        saved = {name: getattr(jax.config, name) for name in (_MIN_TIME, _MIN_SIZE)}
        jax.config.update(_MIN_TIME, 0.0)
        jax.config.update(_MIN_SIZE, -1)  # -1: no size limit (0 lets JAX pick one)
        try:
            yield
        finally:
            for name, value in saved.items():
                jax.config.update(name, value)
