"""Cheap checks of user arguments, shared by `generate()`, `Target` and the CLI.

Each check raises an `InputError` naming the argument at fault (`name`: the API argument,
or the CLI flag), and none needs a model: callers run them all before loading anything or
creating any file.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax.numpy as jnp
import numpy as np

from eaglejax.errors import InputError

SEED_LIMIT = 2**32  # seeds are uint32 PRNG keys
INT32_MAX = 2**31 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)


def is_int(value: Any) -> bool:
    """A Python or numpy integer; booleans are not integers here."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
    """A Python or numpy integer or float; booleans are not numbers here."""
    return isinstance(value, (int, float, np.integer, np.floating)) and \
        not isinstance(value, (bool, np.bool_))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def integer(name: str, value: Any, low: int, high: int = INT32_MAX) -> int:
    """`value` as an int in [low, high]."""
    if not is_int(value) or not low <= value <= high:
        raise InputError(f"{name} must be an integer in [{low}, {high}], got {_short(value)}")
    return int(value)


def real(name: str, value: Any, low: float, high: float = FLOAT32_MAX, *,
         low_open: bool = False) -> float:
    """`value` as a finite float in [low, high] ((low, high] when `low_open`)."""
    try:
        number = float(value) if is_real(value) else math.nan
    except OverflowError:  # an int beyond any float
        number = math.inf
    if not (math.isfinite(number) and low <= number <= high) or (low_open and number == low):
        if high == FLOAT32_MAX:
            bound = f"> {low:g}" if low_open else f">= {low:g}"
        else:
            bound = f"in ({low:g}, {high:g}]" if low_open else f"in [{low:g}, {high:g}]"
        raise InputError(f"{name} must be a finite number {bound}, got {_short(value)}")
    return number


def flag(name: str, value: Any) -> bool:
    """`value` as a bool (True/False, not merely truthy)."""
    if not isinstance(value, (bool, np.bool_)):
        raise InputError(f"{name} must be True or False, got {_short(value)}")
    return bool(value)


def seed(name: str, value: Any) -> int:
    """A PRNG seed: an integer in [0, 2**32)."""
    if not is_int(value):
        raise InputError(f"{name} must be an integer, got {_short(value)}")
    if not 0 <= value < SEED_LIMIT:
        raise InputError(f"{name} must lie in [0, 2**32), got {value}")
    return int(value)


def row_seeds(value: Any, batch: int, name: str = "seed") -> list[int]:
    """One seed per row from one seed or a sequence (or 1-D integer array) of `batch`."""
    if isinstance(value, np.ndarray) and value.ndim == 1:
        value = list(value)
    if is_int(value):
        return [seed(name, value)] * batch
    if not (isinstance(value, Sequence) and not isinstance(value, (str, bytes))
            and all(is_int(s) for s in value)):
        raise InputError(f"{name} must be an int or a sequence of ints (one per prompt), "
                         f"got {_short(value)}")
    if len(value) != batch:
        raise InputError(f"{name}: got {len(value)} seeds for {batch} prompts")
    return [seed(f"{name}[{i}]", s) for i, s in enumerate(value)]


def text(name: str, value: Any) -> str:
    """A string that is valid Unicode (no lone surrogates), so a tokenizer can encode it."""
    if isinstance(value, (bytes, bytearray)):
        raise InputError(f"{name} is bytes; decode it to a str first")
    if not isinstance(value, str):
        raise InputError(f"{name} must be a string, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InputError(f"{name} is not valid Unicode: lone surrogate "
                         f"{value[err.start]!r} at index {err.start}") from None
    return value


def stop_strings(value: Any, name: str = "stop") -> list[str]:
    """None, one stop string or a sequence of them, as a list of non-empty strings."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, Sequence) or isinstance(value, (bytes, bytearray)):
        raise InputError(f"{name} must be a string or a list of strings, got {_short(value)}")
    for s in value:
        if not isinstance(s, str) or not s:
            raise InputError(f"{name} strings must be non-empty strings, got {_short(s)}")
        text(name, s)
    return list(value)


def token_ids(name: str, value: Any, vocab_size: int | None = None) -> list[int]:
    """A non-empty list (or 1-D integer array) of integer token ids, in [0, vocab_size)
    when `vocab_size` is given."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer):
            raise InputError(f"{name} must be a 1-D integer array of token ids, got shape "
                             f"{value.shape} dtype {value.dtype}")
        value = value.tolist()
    elif isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise InputError(f"{name} must be a list of token ids, got {type(value).__name__}")
    for t in value:
        if not is_int(t):
            raise InputError(f"{name}: token ids must be integers, got {_short(t)} "
                             f"({type(t).__name__})")
    if not value:
        raise InputError(f"{name} is empty")
    ids = [int(t) for t in value]
    if vocab_size is not None:
        in_vocabulary(name, ids, vocab_size)
    return ids


def in_vocabulary(name: str, ids: Sequence[int], vocab_size: int) -> None:
    """InputError naming the first id that is not an integer (Python, numpy or a JAX integer
    scalar) in [0, vocab_size)."""
    for t in ids:
        if not is_int(t) and not (np.ndim(t) == 0 and np.asarray(t).dtype.kind in "iu"):
            raise InputError(f"{name}: {t!r} is not a token id (an integer); encode text with "
                             f"the tokenizer first")
        if not 0 <= t < vocab_size:
            raise InputError(f"{name}: token id {t} is outside the vocabulary [0, {vocab_size})")


def token_batch(name: str, value: Any, vocab_size: int) -> np.ndarray:
    """An int64 [batch, length] array from one row or equal-length rows of token ids
    (lists, numpy or JAX integer arrays)."""
    if hasattr(value, "__array__") and not isinstance(value, np.ndarray):
        value = np.asarray(value)  # a JAX (or other) array: its values, read once

    def is_row(v: Any) -> bool:
        return isinstance(v, np.ndarray) or (isinstance(v, Sequence) and
                                             not isinstance(v, (str, bytes, bytearray)))

    if isinstance(value, np.ndarray) and value.ndim in (1, 2) and value.size \
            and np.issubdtype(value.dtype, np.integer):
        in_vocabulary(name, [int(value.min()), int(value.max())], vocab_size)
        return value.reshape(-1, value.shape[-1]).astype(np.int64)
    if isinstance(value, np.ndarray):
        rows = list(value) if value.ndim == 2 else [value]
    elif is_row(value):
        rows = list(value) if any(is_row(v) for v in value) else [value]
    else:
        raise InputError(f"{name} must be a [batch, length] list or array of token ids, got "
                         f"{type(value).__name__}")
    if not rows:
        raise InputError(f"{name} is empty")
    ids = [token_ids(f"{name} row {i}", row, vocab_size) for i, row in enumerate(rows)]
    if len({len(row) for row in ids}) > 1:
        raise InputError(f"{name}: rows have different lengths {sorted({len(r) for r in ids})}")
    return np.asarray(ids, np.int64)


def prompt_list(value: Any) -> list[str | list[int]]:
    """Prompts as a list of strings and token-id lists (structure only: no tokenizer yet).
    One string is one prompt; a 2-D integer array is one prompt per row."""
    if isinstance(value, (bytes, bytearray)):
        raise InputError("prompts are bytes; decode them to a str first")
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, np.ndarray):
        if value.ndim != 2:
            raise InputError(f"prompts: an array of token ids must be 2-D [batch, length], "
                             f"got shape {value.shape} (one prompt: [ids])")
        value = list(value)
    if not isinstance(value, Sequence) or len(value) == 0:
        raise InputError("prompts must be a non-empty list of strings or of token-id lists")
    return [_prompt(f"prompt {i}", p) for i, p in enumerate(value)]


def _prompt(name: str, value: Any) -> str | list[int]:
    if isinstance(value, str):
        if not value.strip():
            raise InputError(f"{name} is empty")
        return text(name, value)
    if isinstance(value, (bytes, bytearray)):
        raise InputError(f"{name} is bytes; decode it to a str first")
    if is_int(value):
        raise InputError(f"{name} is a single integer; pass one token-id prompt as [[id, ...]]")
    if not isinstance(value, (Sequence, np.ndarray)):
        raise InputError(f"{name} must be a string or a list of token ids, got "
                         f"{type(value).__name__}")
    return token_ids(name, value)


class SamplingOptions(NamedTuple):
    """Validated sampling settings (temperature 0 is greedy, top_k 0 is off)."""

    temperature: float
    top_k: int
    top_p: float


def sampling(temperature: Any, top_k: Any, top_p: Any,
             name: Callable[[str], str] = str) -> SamplingOptions:
    """Temperature (finite, >= 0), top_k (integer >= 0) and top_p (in (0, 1]); `name`
    maps each argument's name to what the user typed (e.g. a CLI flag)."""
    return SamplingOptions(real(name("temperature"), temperature, 0.0),
                           integer(name("top_k"), top_k, 0),
                           real(name("top_p"), top_p, 0.0, 1.0, low_open=True))


def dtype(name: str, value: Any, allowed: Sequence[str]) -> Any:
    """`value` (a name or dtype) as a JAX dtype among `allowed` names."""
    try:
        parsed = jnp.dtype(value)
    except TypeError:
        parsed = None
    if parsed is None or parsed.name not in allowed:
        raise InputError(f"{name} must be one of {list(allowed)}, got {_short(value)}")
    return parsed


def cli_flag(argument: str) -> str:
    """The CLI flag of an API argument name: `top_k` -> `--top-k`."""
    return "--" + argument.replace("_", "-")


def existing_path(name: str, value: str | os.PathLike, directory: bool = False) -> Path:
    """A file or directory that exists (a directory when `directory`)."""
    path = Path(value).expanduser()
    if not path.exists():
        raise InputError(f"{name}: {path}: no such file or directory")
    if directory and not path.is_dir():
        raise InputError(f"{name}: {path} is not a directory")
    return path


def new_output_dir(name: str, value: str | os.PathLike) -> Path:
    """A directory that does not exist yet, or an empty one (nothing gets overwritten)."""
    path = Path(value).expanduser()
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise InputError(f"{name}: {path} already exists and is not empty; refusing to overwrite")
    return path


KINDS = {"integer": int, "real": float, "seed": int}


def bounded(default: Any, kind: str, low: float = 0, high: float | None = None, *,
            low_open: bool = False, help: str | None = None) -> Any:
    """A dataclass field whose values `check_field` bounds: an "integer" or a "real" in
    [low, high] ((low, high] when `low_open`; no `high`: unbounded), or a "seed"; a field
    whose default is None also takes None. `help` is its command-line help, where it has a
    flag: the bound lives here once, for the dataclass and its flags."""
    return dataclasses.field(default=default, metadata={
        "bounds": (kind, low, high, low_open), "help": help})


def check_field(field: dataclasses.Field, value: Any, name: str | None = None) -> Any:
    """`value` checked against `field`'s bounds (a `bounded` field), errors naming `name`
    (default: the field's name)."""
    kind, low, high, low_open = field.metadata["bounds"]
    name = name or field.name
    if value is None and field.default is None:
        return None
    if kind == "seed":
        return seed(name, value)
    if kind == "integer" and high is None:
        if not is_int(value) or not low <= value <= INT32_MAX:
            raise InputError(f"{name} must be an integer >= {int(low)}, got {_short(value)}")
        return int(value)
    if kind == "integer":
        return integer(name, value, int(low), int(high))
    return real(name, value, low, FLOAT32_MAX if high is None else high, low_open=low_open)


def check_fields(instance: Any) -> None:
    """Check every `bounded` field of a dataclass instance (from its `__post_init__`)."""
    for field in dataclasses.fields(instance):
        if "bounds" in field.metadata:
            check_field(field, getattr(instance, field.name))
