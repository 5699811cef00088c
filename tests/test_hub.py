"""Models and heads named by Hugging Face Hub id, read from a Hugging Face cache built on disk
in the layout huggingface_hub writes (`models--org--name/blobs/<sha256>`,
`snapshots/<commit>/<file>` linking to the blobs, `refs/<branch or tag>` holding the commit),
with HF_HUB_OFFLINE=1: nothing is downloaded, and nothing is written to the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import tokenizers

import eaglejax
from eaglejax.cli import main
from eaglejax.draft import export_speculators, load_draft
from eaglejax.draft.draft import new_eagle3_draft
from eaglejax.errors import LoadError
from eaglejax.loading import hub
from eaglejax.tokenizer import Tokenizer
from hf_oracle import make_hf_model

MODEL, HEAD = "org/tiny-llama", "org/tiny-head"
MAIN, V1 = "a" * 40, "b" * 40  # the commits of `main` and of tag `v1` (another model)
TOKENS = np.array([[1, 5, 9, 17, 33, 2, 64]])
TEMPLATE = ("{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}assistant{% endif %}")


def _cache_repo(cache: Path, repo_id: str, commit: str, files: Path,
                refs: tuple[str, ...]) -> Path:
    """Put the files of folder `files` into `cache` as snapshot `commit` of `repo_id`,
    as huggingface_hub does, with `refs` naming the commit; returns the snapshot."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for file in sorted(p for p in files.rglob("*") if p.is_file()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / file.relative_to(files)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def _model_files(directory: Path, seed: int) -> Path:
    """A tiny random transformers Llama (safetensors) with a word-level tokenizer."""
    make_hf_model("llama", directory, seed=seed)
    vocab = {"<unk>": 0, "user": 1, "w2": 2, "assistant": 3, "system": 4,
             **{f"w{i}": i for i in range(5, 97)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    Tokenizer(backend, chat_template=TEMPLATE, unk_token="<unk>").save(directory)
    return directory


def _listing(cache: Path) -> list[tuple[str, float]]:
    return sorted((str(p), p.lstat().st_mtime) for p in cache.rglob("*"))


@dataclasses.dataclass
class Cache:
    root: Path
    snapshots: dict[str, Path]  # "org/name@revision" -> its snapshot folder
    listing: list[tuple[str, float]]  # every path in the cache and its mtime, once built


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The Hugging Face cache, and this module's environment pointing at it, offline: the
    tiny Llama (`main`, and tag `v1` another model), a speculators EAGLE-3 head whose
    config names the Llama by Hub id, a repository whose weights blob is missing and
    GGUF-only ones."""
    root = tmp_path_factory.mktemp("hf")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HOME", str(root / "home"))
        env.setenv("HF_HUB_CACHE", str(root / "hub"))
        env.setenv("HF_HUB_OFFLINE", "1")
        hub_dir, files = root / "hub", root / "files"
        snapshots = {
            f"{MODEL}@main": _cache_repo(hub_dir, MODEL, MAIN, _model_files(files / "m", 0),
                                         ("main",)),
            f"{MODEL}@v1": _cache_repo(hub_dir, MODEL, V1, _model_files(files / "v1", 1),
                                       ("v1",)),
        }
        target = eaglejax.load_target(MODEL)  # the export names it as its verifier
        export_speculators(new_eagle3_draft(target, seed=3), files / "head")
        snapshots[f"{HEAD}@main"] = _cache_repo(hub_dir, HEAD, MAIN, files / "head", ("main",))
        broken = _cache_repo(hub_dir, "org/broken", MAIN, files / "m", ("main",))
        (broken / "model.safetensors").resolve().unlink()  # a download cut short
        (files / "one").mkdir()
        (files / "one" / "tiny.Q4_0.gguf").write_bytes(b"GGUF")
        snapshots["org/one-gguf@main"] = _cache_repo(hub_dir, "org/one-gguf", MAIN,
                                                     files / "one", ("main",))
        (files / "one" / "tiny.Q8_0.gguf").write_bytes(b"GGUF")
        _cache_repo(hub_dir, "org/two-ggufs", MAIN, files / "one", ("main",))
        yield Cache(hub_dir, snapshots, _listing(hub_dir))


@pytest.fixture(autouse=True)
def nothing_downloaded(cache):
    """Every test leaves the cache as it was: no file fetched, no ref written."""
    yield
    assert _listing(cache.root) == cache.listing


@pytest.mark.parametrize("name,snapshot", [
    (MODEL, f"{MODEL}@main"),
    (f"{MODEL}@v1", f"{MODEL}@v1"),
    (f"{MODEL}@{MAIN}", f"{MODEL}@main"),
])
def test_hub_id_loads_the_cached_snapshot(cache, name, snapshot):
    target = eaglejax.load_target(name)
    direct = eaglejax.load_target(cache.snapshots[snapshot])
    np.testing.assert_array_equal(np.asarray(target.logits(TOKENS)),
                                  np.asarray(direct.logits(TOKENS)))
    assert target.source == name  # what exports name as the verifier
    assert target.tokenizer.encode("w5 w9") == [5, 9]


def test_revisions_are_different_models(cache):
    main_, v1 = (eaglejax.load_target(f"{MODEL}@{rev}").logits(TOKENS) for rev in ("main", "v1"))
    assert not np.array_equal(np.asarray(main_), np.asarray(v1))


@pytest.mark.parametrize("name,says", [
    (f"{MODEL}@nope", "revision 'nope' is not in the Hugging Face cache"),
    ("org/not-cached", "not in the Hugging Face cache"),
    ("org/broken", "no weights found"),
    ("org/two-ggufs", "the repository holds 2 GGUF files"),
])
def test_failures_are_one_line_naming_the_id(cache, name, says, capsys):
    with pytest.raises(LoadError) as err:
        eaglejax.load_target(name)
    message = str(err.value)
    assert message.startswith(name) and says in message and "\n" not in message
    assert main(["generate", "hi", "--model", name]) == 2
    err = capsys.readouterr().err  # after at most the line saying which snapshot it read
    assert err.strip().splitlines()[-1] == f"eaglejax: error: {message}"
    assert "Traceback" not in err and err.count("\n") <= 2


@pytest.mark.parametrize("error,says", [
    ("GatedRepoError", "a gated Hugging Face repository; accept its terms"),
    ("RepositoryNotFoundError", "no such Hugging Face repository"),
    ("RevisionNotFoundError", "has no revision 'v9'"),
])
def test_hub_answers_are_one_line_naming_the_id(cache, monkeypatch, error, says):
    from huggingface_hub import utils

    def answer(repo_id, revision):
        cls = getattr(utils, error)  # made without the HTTP response its __init__ wants,
        raised = cls.__new__(cls)  # whose type differs across huggingface_hub versions
        Exception.__init__(raised, f"{error} for {repo_id}\nwith details")
        raise raised

    monkeypatch.setattr(hub, "_offline", lambda: False)
    monkeypatch.setattr(hub, "_repo_files", answer)  # what the Hub would answer online
    with pytest.raises(LoadError) as err:
        hub.resolve_source("org/elsewhere@v9")
    message = str(err.value)
    assert message.startswith("org/elsewhere@v9") and says in message and "\n" not in message


@pytest.mark.parametrize("listing,fetched", [
    (["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
      "model.safetensors.index.json", "tokenizer.json", "README.md", "pytorch_model.bin",
      "original/consolidated.00.pth", "original/model.safetensors", "consolidated.safetensors",
      "model.gguf"],
     ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
      "model.safetensors.index.json", "tokenizer.json"]),
    (["config.json", "pytorch_model.bin", "README.md", "original/params.json"],  # a reference head
     ["config.json", "pytorch_model.bin"]),
])
def test_online_only_what_eaglejax_reads_is_fetched(cache, monkeypatch, listing, fetched):
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    asked = {}

    def download(repo_id, **kwargs):
        asked.update(kwargs)
        return str(cache.snapshots[f"{MODEL}@main"])

    monkeypatch.setattr(hub, "_offline", lambda: False)
    monkeypatch.setattr(hub, "_repo_files", lambda repo_id, revision: listing)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    hub.resolve_source("org/online@v2")
    assert asked["revision"] == "v2" and not asked["local_files_only"]
    assert sorted(filter_repo_objects(listing, allow_patterns=asked["allow_patterns"],
                                      ignore_patterns=asked["ignore_patterns"])) == fetched


def test_a_local_directory_of_the_same_name_wins(cache, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(cache.snapshots[f"{MODEL}@v1"], MODEL)  # v1's files, under main's id
    source = hub.resolve_source(MODEL)
    assert source.hub_id is None and source.path == Path(MODEL)
    assert "is not used" in source.description
    target = eaglejax.load_target(MODEL)
    np.testing.assert_array_equal(
        np.asarray(target.logits(TOKENS)),
        np.asarray(eaglejax.load_target(f"{MODEL}@v1").logits(TOKENS)))


def test_a_path_under_a_local_folder_is_never_asked_of_the_hub(cache, monkeypatch, tmp_path):
    """`checkpoints/typo` where `checkpoints/` is here: a missing local path, at once."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    assert not hub.is_hub_id("checkpoints/typo") and hub.is_hub_id(MODEL)
    source = hub.resolve_source("checkpoints/typo")
    assert source.hub_id is None and source.path == Path("checkpoints/typo")
    with pytest.raises(LoadError, match="checkpoints/typo: no such file or directory"):
        load_draft("checkpoints/typo", target=eaglejax.load_target(MODEL))


def test_a_gguf_only_repository_resolves_to_its_file(cache):
    source = hub.resolve_source("org/one-gguf")
    assert source.path == cache.snapshots["org/one-gguf@main"] / "tiny.Q4_0.gguf"
    assert source.description.startswith("org/one-gguf@main from the Hugging Face cache")


def test_load_draft_by_hub_id(cache):
    target = eaglejax.load_target(MODEL)
    draft = load_draft(HEAD, target=target)
    direct = load_draft(cache.snapshots[f"{HEAD}@main"], target=target)
    assert draft.source == HEAD
    features = target.features(TOKENS, draft.config.tap_layers)
    np.testing.assert_array_equal(np.asarray(draft.logits(TOKENS[:, 1:], features[:, :-1])),
                                  np.asarray(direct.logits(TOKENS[:, 1:], features[:, :-1])))
    config = json.loads((cache.snapshots[f"{HEAD}@main"] / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == MODEL


def test_cli_without_model_uses_the_heads_verifier(cache, capsys):
    code = main(["generate", "w5 w9", "--draft", HEAD, "--max-new-tokens", "2",
                 "--num-draft-tokens", "2", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    lines = captured.err.splitlines()
    assert f"draft: {HEAD}@main from the Hugging Face cache " \
           f"({cache.snapshots[f'{HEAD}@main']})" in lines
    assert f"model: {MODEL}@main from the Hugging Face cache ({cache.snapshots[f'{MODEL}@main']})" \
           f" (the verifier --draft {HEAD} names)" in lines
    assert len(json.loads(captured.out)[0]["token_ids"]) == 2
