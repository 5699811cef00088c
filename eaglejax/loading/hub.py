"""Models and heads named by Hugging Face Hub id (`org/name`, `org/name@revision`).

`resolve_source` turns what a user typed into a local path: an existing file or directory
as it is (it wins over a Hub id of the same name), else an id fetched with
`huggingface_hub.snapshot_download` into the Hugging Face cache, as every peer does
(`HF_HOME`, `HF_HUB_CACHE`, `HF_HUB_OFFLINE` and `HF_TOKEN` read when it is called). Only
the files eaglejax reads are fetched: configs, tokenizer files, safetensors weights (else a
`pytorch_model.bin` or a GGUF file), eaglejax's own checkpoint files; never `original/`
or Mistral's `consolidated` copies.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from eaglejax.errors import EaglejaxError, LoadError

_HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_])(?:@(?P<revision>[^@\s]+))?",
                     re.ASCII)

_ALWAYS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "tokenizer.model", "chat_template.jinja",
           "chat_template.json", "eaglejax.json", "params/*", "d2t.npy"]
_SAFETENSORS = ["*.safetensors", "*.safetensors.index.json"]
_NO_SAFETENSORS = ["pytorch_model.bin", "*.gguf"]  # what eaglejax reads besides safetensors
_IGNORE = ["original/*", "consolidated*"]


@dataclass(frozen=True)
class ResolvedSource:
    """Where a model or head lives on this machine, and what named it."""

    path: Path  # the file or directory to read
    hub_id: str | None = None  # "org/name" when it came from the Hugging Face Hub
    revision: str | None = None  # the revision asked for (None: the default branch)
    description: str = ""  # one line: what is used, from where

    @property
    def name(self) -> str:
        """The name to report: the Hub id as given (with its revision), else the path."""
        if self.hub_id is None:
            return str(self.path)
        return self.hub_id if self.revision is None else f"{self.hub_id}@{self.revision}"


def is_hub_id(value: str | os.PathLike) -> bool:
    """Whether `value` is shaped like a Hub id, `org/name` or `org/name@revision`, and is not
    a path under a folder of this machine (`checkpoints/my-head` where `checkpoints/` is
    here: a local path, missing or not, never a question to the Hub; with a revision it is
    an id)."""
    return _hub_match(value) is not None


def _hub_match(value: str | os.PathLike) -> re.Match | None:
    match = _HUB_ID.fullmatch(value) if isinstance(value, str) else None
    if match is None or (match["revision"] is None
                         and Path(match["repo"].split("/")[0]).expanduser().is_dir()):
        return None
    return match


def resolve_source(path_or_id: str | os.PathLike) -> ResolvedSource:
    """An existing local path as it is; else a Hub id's snapshot in the Hugging Face cache
    (fetched unless `HF_HUB_OFFLINE` is set); else the path, missing (the caller's loader
    says so). LoadError, one line naming the id, for a gated, missing or uncached repository
    or revision, or a snapshot that lacks what eaglejax reads."""
    path = Path(path_or_id).expanduser()
    match = _hub_match(path_or_id)
    if match is None or path.exists():
        kind = "directory" if path.is_dir() else "file"
        shaped = isinstance(path_or_id, str) and _HUB_ID.fullmatch(path_or_id)
        why = f"; the Hugging Face repository {path_or_id} is not used" \
            if shaped and path.exists() else ""
        return ResolvedSource(path, description=f"the local {kind} {path.absolute()}{why}")
    return _from_hub(match["repo"], match["revision"])


@contextlib.contextmanager
def named_errors(source: ResolvedSource) -> Iterator[None]:
    """Inside, an eaglejax error about a file of a Hub snapshot also names the Hub id."""
    try:
        yield
    except EaglejaxError as err:
        if source.hub_id is None:
            raise
        raise type(err)(f"{source.name} (Hugging Face): {err}") from None


def hub_cache() -> Path:
    """The Hugging Face cache folder, from the environment as it is now."""
    from huggingface_hub import constants

    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    return Path(constants.HF_HUB_CACHE)


def _offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return constants.HF_HUB_OFFLINE or flag.strip().upper() in {"1", "ON", "YES", "TRUE"}


def _from_hub(repo_id: str, revision: str | None) -> ResolvedSource:
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    name = repo_id if revision is None else f"{repo_id}@{revision}"
    cache = hub_cache()
    repo_dir = cache / f"models--{repo_id.replace('/', '--')}"
    why_local = "HF_HUB_OFFLINE is set (unset it to download)" if _offline() else None
    try:
        files = None if why_local else _repo_files(repo_id, revision)
        if files is None:
            why_local = why_local or "the Hugging Face Hub cannot be reached"
            files = _cached_files(repo_dir, revision)
        folder = Path(snapshot_download(
            repo_id, revision=revision, cache_dir=cache, local_files_only=bool(why_local),
            allow_patterns=_allow_patterns(name, files), ignore_patterns=_IGNORE,
            library_name="eaglejax"))
    except GatedRepoError:
        raise LoadError(f"{name}: a gated Hugging Face repository; accept its terms at "
                        f"https://huggingface.co/{repo_id}, then log in (`hf auth login`) or "
                        f"set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise LoadError(f"{name}: no such local file or directory, and no such Hugging Face "
                        f"repository (or a private one: log in with `hf auth login` or set "
                        f"HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise LoadError(f"{name}: the Hugging Face repository {repo_id} has no revision "
                        f"{revision!r}") from None
    except LocalEntryNotFoundError as err:
        if files is not None:  # the snapshot is there, some of its files are not
            raise LoadError(f"{name}: its snapshot in the Hugging Face cache ({repo_dir}) "
                            f"lacks files ({_first_line(err)}), and {why_local}") from None
        where = f"revision {revision or 'main'!r} is not in the Hugging Face cache " \
            f"({repo_dir})" if repo_dir.is_dir() else f"not in the Hugging Face cache ({cache})"
        raise LoadError(f"{name}: {where}, and {why_local}") from None
    except (OSError, ValueError) as err:  # the network, the disk, a malformed revision
        raise LoadError(f"{name}: cannot fetch it from the Hugging Face Hub: "
                        f"{_first_line(err)}") from None
    path = _model_path(name, folder)
    return ResolvedSource(path, repo_id, revision, f"{repo_id}@{revision or 'main'} from the "
                                                   f"Hugging Face cache ({path})")


def _repo_files(repo_id: str, revision: str | None) -> list[str] | None:
    """The repository's files, asked of the Hub; None when the Hub cannot be reached."""
    from huggingface_hub import HfApi
    from huggingface_hub.utils import RepositoryNotFoundError, RevisionNotFoundError

    try:
        return HfApi(library_name="eaglejax").list_repo_files(repo_id, revision=revision)
    except (RepositoryNotFoundError, RevisionNotFoundError):  # gated repositories too
        raise
    except Exception:  # connection, timeout, server errors (their types vary by version)
        return None


def _cached_files(repo_dir: Path, revision: str | None) -> list[str] | None:
    """The files of a cached snapshot (None when it is not cached)."""
    revision = revision or "main"
    ref = repo_dir / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = repo_dir / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    return [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if not p.is_dir()]


def _allow_patterns(name: str, files: list[str] | None) -> list[str]:
    """What to fetch of a repository holding `files` (None: unknown, safetensors assumed).
    LoadError for a repository of several GGUF files and nothing else eaglejax reads."""
    def kept(f: str) -> bool:
        return not (f.startswith("original/") or f.startswith("consolidated"))

    if files is None or any(f.endswith(".safetensors") and kept(f) for f in files):
        return _ALWAYS + _SAFETENSORS
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if len(ggufs) > 1 and "config.json" not in files:
        shown = ", ".join(ggufs[:4]) + (", ..." if len(ggufs) > 4 else "")
        raise LoadError(f"{name}: the repository holds {len(ggufs)} GGUF files ({shown}); "
                        f"fetch the one you want (`hf download {name.split('@')[0]} FILE`) "
                        f"and pass its path")
    return _ALWAYS + _NO_SAFETENSORS


def _model_path(name: str, folder: Path) -> Path:
    """The snapshot folder, or its one GGUF file; LoadError when neither holds a model."""
    if (folder / "config.json").is_file() or (folder / "eaglejax.json").is_file():
        return folder
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1 and ggufs[0].is_file():
        return ggufs[0]
    raise LoadError(f"{name}: its snapshot in the Hugging Face cache ({folder}) has no "
                    f"config.json, eaglejax.json or GGUF file (a download cut short? fetch it "
                    f"again with HF_HUB_OFFLINE unset)")


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
