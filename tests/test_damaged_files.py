"""Damaged files, runs and paths: every case is a one-line LoadError naming the file at
fault, or a recovery that loses nothing the user saved.

Damages tried on every file of a saved target, a saved head and a training checkpoint:
cut to half its size, overwritten with zeros, deleted."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import threading
import warnings
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import eaglejax
from eaglejax.cli import main
from eaglejax.config import ModelConfig
from eaglejax.draft.draft import new_eagle3_draft
from eaglejax.errors import LoadError
from eaglejax.loading.orbax_io import describe_failure
from eaglejax.loading.safetensors_file import SafetensorsFile, save_safetensors
from eaglejax.models.llama import init_params
from eaglejax.target import Target
from eaglejax.tokenizer import Tokenizer
from eaglejax.training import trainer
from eaglejax.training.data import Example, pack
from eaglejax.training.run import append_log, open_run, read_log, truncate_log
from eaglejax.training.trainer import TrainConfig, train

V = 64
DAMAGES = ("truncate", "zero", "delete")


def damage(path: Path, how: str) -> None:
    """Cut `path` to half its size, overwrite it with zeros, or delete it."""
    size = path.stat().st_size
    if how == "delete":
        path.unlink()
        return
    with open(path, "r+b") as f:
        if how == "truncate":
            f.truncate(size // 2)
        else:
            f.write(b"\0" * size)


def damages_of(path: Path) -> tuple[str, ...]:
    """The damages that change `path` (cutting or zeroing an empty file changes nothing)."""
    return DAMAGES if path.stat().st_size else ("delete",)


def files_of(directory: Path) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in directory.rglob("*")
                  if p.is_file())


def assert_one_line(err: pytest.ExceptionInfo, *names: str) -> None:
    """The error is one short line, names every one of `names`, and carries no TensorStore
    spec."""
    message = str(err.value)
    assert "\n" not in message and len(message) < 600, message
    assert "TensorStore" not in message and "tensorstore_spec" not in message, message
    for name in names:
        assert name in message, (name, message)


def assert_same_tree(a, b) -> None:
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def tiny_target() -> Target:
    """A random 4-layer Llama with a 64-token vocabulary and no tokenizer."""
    config = ModelConfig("llama", V, 32, 64, 4, 2, 1, 16, max_position_embeddings=64)
    return Target(config, init_params(config, jax.random.PRNGKey(0), scale=0.1), None, "tiny")


@pytest.fixture(scope="module")
def saved_target(tmp_path_factory) -> tuple[Path, Target]:
    """The tiny target's shape with a word-level tokenizer, saved as an eaglejax checkpoint
    (parameters, tokenizer.json, tokenizer_config.json)."""
    import tokenizers

    words = tmp_path_factory.mktemp("tokenizer")
    vocab = {"<eos>": 0, **{f"w{i}": i for i in range(1, V)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<eos>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.save(str(words / "tokenizer.json"))
    (words / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    tokenizer = Tokenizer.from_hf_dir(words)
    config = ModelConfig("llama", V, 16, 32, 1, 2, 1, 8, max_position_embeddings=64)
    target = Target(config, init_params(config, jax.random.PRNGKey(1), scale=0.1), tokenizer,
                    "tiny-with-tokenizer", tuple(tokenizer.eos_token_ids))
    path = tmp_path_factory.mktemp("target") / "saved"
    target.save(str(path))
    return path, target


@pytest.fixture(scope="module")
def saved_head(tmp_path_factory, tiny_target) -> tuple[Path, object]:
    """A random EAGLE-3 head for the tiny target, saved in eaglejax format."""
    draft = new_eagle3_draft(tiny_target, used_tokens=np.arange(0, V, 2), seed=3)
    path = tmp_path_factory.mktemp("head") / "saved"
    draft.save(str(path))
    return path, draft


def _load_target(path: Path):
    return eaglejax.load_target(path).params


def _load_head(tiny_target):
    return lambda path: eaglejax.load_draft(path, target=tiny_target).params


def _without_checksums(path: Path) -> None:
    """Make `path` look like a checkpoint saved before checksums were recorded."""
    manifest = json.loads((path / "eaglejax.json").read_text())
    del manifest["files"]
    (path / "eaglejax.json").write_text(json.dumps(manifest))


# --------------------------------------------------------------- saved targets and heads


@pytest.mark.parametrize("kind", ["target", "head"])
def test_every_damaged_file_of_a_checkpoint_is_named(kind, saved_target, saved_head,
                                                     tiny_target, tmp_path):
    source, original = saved_target if kind == "target" else saved_head
    load = _load_target if kind == "target" else _load_head(tiny_target)
    assert_same_tree(load(source), original.params)  # intact: loads, checksums agree
    for rel in files_of(source):
        for how in damages_of(source / rel):
            copy = tmp_path / f"{rel.replace('/', '_')}-{how}"
            shutil.copytree(source, copy)
            damage(copy / rel, how)
            with pytest.raises(LoadError) as err:
                load(copy)
            named = copy / "eaglejax.json" if rel == "eaglejax.json" else copy / rel
            assert_one_line(err, str(named))
            shutil.rmtree(copy)
    assert_same_tree(load(source), original.params)  # loading writes nothing


@pytest.mark.parametrize("kind", ["target", "head"])
def test_checkpoints_without_checksums_fail_in_one_line_or_load_intact(
        kind, saved_target, saved_head, tiny_target, tmp_path, capfd):
    """Checkpoints written before checksums were recorded: every damage is a one-line
    LoadError, or it touched a file the parameters do not come from and they load exactly."""
    source, original = saved_target if kind == "target" else saved_head
    load = _load_target if kind == "target" else _load_head(tiny_target)
    legacy = tmp_path / "legacy"
    shutil.copytree(source, legacy)
    _without_checksums(legacy)
    outcomes = {}
    for rel in files_of(legacy):
        for how in damages_of(legacy / rel):
            copy = tmp_path / "copy"
            shutil.copytree(legacy, copy)
            damage(copy / rel, how)
            try:
                params = load(copy)
            except LoadError as err:
                assert "\n" not in str(err) and "TensorStore" not in str(err), str(err)
                assert str(copy) in str(err)
                outcomes[rel, how] = "error"
            else:
                assert_same_tree(params, original.params)
                outcomes[rel, how] = "intact"
            shutil.rmtree(copy)
    assert outcomes["eaglejax.json", "truncate"] == "error"
    assert sum(o == "error" for (rel, _), o in outcomes.items() if rel.startswith("params/")) >= 6
    gc.collect()  # finalises the coroutines a failed restore leaves unfinished
    assert "Traceback" not in capfd.readouterr().err  # orbax's asyncio debris is dropped


def test_orbax_failures_are_described_in_one_line():
    try:
        try:
            raise ValueError('DATA_LOSS: Error reading "fc/0.0" [tensorstore_spec=\'{"a": 1}\']')
        except ValueError as inner:
            raise Exception("Encountered error. See full TensorStore details: <spec\n"
                            "of many lines>") from inner
    except Exception as err:
        assert describe_failure(err) == 'ValueError: DATA_LOSS: Error reading "fc/0.0"'


# ------------------------------------------------------------------- GGUF and safetensors


def test_damaged_gguf_is_named(smollm_path, tmp_path):
    data = Path(smollm_path).read_bytes()
    path = tmp_path / "model.gguf"
    cuts = [0, 3, 23, 100, 10_000, len(data) // 2]  # magic, header, metadata, tensor data
    variants = [data[:n] for n in cuts] + [b"\0" * len(data), data[:4] + b"\0" * 1_000_000]
    for blob in variants:
        path.write_bytes(blob)
        with pytest.raises(LoadError) as err:
            eaglejax.load_target(path)
        assert_one_line(err, str(path))
    path.unlink()
    with pytest.raises(LoadError) as err:
        eaglejax.load_target(path)
    assert_one_line(err, str(path))


def test_damaged_safetensors_is_named(hf_family, tmp_path):
    source = hf_family("llama")[0]
    for rel in ("model.safetensors", "config.json"):
        for how in DAMAGES:
            copy = tmp_path / f"{rel}-{how}"
            shutil.copytree(source, copy)
            damage(copy / rel, how)
            with pytest.raises(LoadError) as err:
                eaglejax.load_target(copy)
            named = copy if (rel, how) == ("model.safetensors", "delete") else copy / rel
            assert_one_line(err, str(named))


def _sharded(source: Path, directory: Path, second: str) -> Path:
    """`source`'s weights split in two shards, the index naming the second `second`."""
    directory.mkdir()
    shutil.copy(source / "config.json", directory)
    st = SafetensorsFile(source / "model.safetensors")
    names = sorted(st.shapes())
    halves = {"model-1.safetensors": names[::2], second: names[1::2]}
    for shard, keys in halves.items():
        if shard == second and (directory / shard).resolve().parent != directory.resolve():
            continue  # written by the caller
        save_safetensors(directory / shard, {k: np.asarray(st.get(k)) for k in keys})
    index = {"weight_map": {k: shard for shard, keys in halves.items() for k in keys}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return directory


def test_shards_must_lie_inside_the_model_folder(hf_family, tmp_path):
    source = hf_family("llama")[0]
    reference = eaglejax.load_target(source).params
    inside = _sharded(source, tmp_path / "inside", "model-2.safetensors")
    assert_same_tree(eaglejax.load_target(inside).params, reference)
    (inside / "sub").mkdir()  # a link that stays inside the folder is fine
    os.rename(inside / "model-2.safetensors", inside / "sub" / "real.safetensors")
    os.symlink("sub/real.safetensors", inside / "model-2.safetensors")
    assert_same_tree(eaglejax.load_target(inside).params, reference)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(inside / "sub" / "real.safetensors", outside)
    for name, link in (("../outside.safetensors", False), (str(outside), False),
                       ("model-2.safetensors", True)):
        folder = _sharded(source, tmp_path / f"case{len(list(tmp_path.iterdir()))}", name)
        if link:
            (folder / name).unlink()
            os.symlink(outside, folder / name)
        with pytest.raises(LoadError) as err:
            eaglejax.load_target(folder)
        assert_one_line(err, str(folder / "model.safetensors.index.json"), repr(name))


def test_shards_in_the_hugging_face_cache_may_link_to_its_blobs(hf_family, tmp_path):
    """The hub cache keeps files in models--x/blobs/ and links to them from
    snapshots/<revision>/: that layout loads."""
    source = hf_family("llama")[0]
    repo = tmp_path / "models--org--tiny"
    snapshot = _sharded(source, tmp_path / "plain", "model-2.safetensors")
    (repo / "snapshots").mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in list(snapshot.iterdir()):
        blob = repo / "blobs" / f"blob-{file.name}"
        file.rename(blob)
        os.symlink(Path("..") / ".." / "blobs" / blob.name, snapshot / file.name)
    snapshot.rename(repo / "snapshots" / "abc123")
    loaded = eaglejax.load_target(repo / "snapshots" / "abc123").params
    assert_same_tree(loaded, eaglejax.load_target(source).params)


def _returns_promptly(fn, fifo: Path):
    """fn()'s LoadError; fails (instead of hanging) if fn blocks reading the FIFO."""
    outcome = {}

    def run():
        try:
            fn()
        except Exception as err:  # recorded for the assertion below
            outcome["error"] = err
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=30)
    if thread.is_alive():
        with open(fifo, "wb"):  # release the reader
            pass
        thread.join()
        pytest.fail(f"reading {fifo} blocked")
    assert isinstance(outcome.get("error"), LoadError), outcome
    return outcome["error"]


def test_named_pipes_are_refused(hf_family, saved_head, tiny_target, tmp_path, capsys):
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    err = _returns_promptly(lambda: eaglejax.load_target(fifo), fifo)
    assert str(err) == f"{fifo}: is a named pipe, not a regular file"
    code = main(["generate", "--model", str(fifo), "hi"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"eaglejax: error: {err}"

    hf = tmp_path / "hf"
    shutil.copytree(hf_family("llama")[0], hf)
    for name in ("model.safetensors", "config.json"):
        (hf / name).rename(hf / f"{name}.real")
        os.mkfifo(hf / name)
        err = _returns_promptly(lambda: eaglejax.load_target(hf), hf / name)
        assert str(err).startswith(f"{hf / name}: is a named pipe")
        (hf / name).unlink()
        (hf / f"{name}.real").rename(hf / name)

    head = tmp_path / "head"
    shutil.copytree(saved_head[0], head)
    (head / "d2t.npy").unlink()
    os.mkfifo(head / "d2t.npy")
    err = _returns_promptly(lambda: eaglejax.load_draft(head, target=tiny_target),
                            head / "d2t.npy")
    assert str(err).startswith(f"{head / 'd2t.npy'}: is a named pipe")


# --------------------------------------------------------------------------- training runs


def test_log_with_a_torn_last_line_is_repaired(tmp_path):
    entries = [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 2.25}, {"step": 3, "loss": 2.0}]
    for entry in entries:
        append_log(tmp_path, entry)
    log = tmp_path / "log.jsonl"
    whole = log.read_bytes()
    for torn in (b'{"step": 4, "lo', b"\0" * 40, b'[1, 2]\n', b'{"step": 4.5}\n'):
        log.write_bytes(whole + torn)
        with pytest.warns(UserWarning, match=re.escape(f"{log}: dropped line 4, written only "
                                                       f"in part")):
            assert read_log(tmp_path) == entries
    log.write_bytes(whole + b'{"step": 4, "lo')
    with pytest.warns(UserWarning, match="dropped line 4"):
        truncate_log(tmp_path, 2)  # resuming from step 2
    assert log.read_bytes() == whole[:whole.index(b'{"step": 3')]
    append_log(tmp_path, {"step": 3, "loss": 2.0})
    assert log.read_bytes() == whole
    truncate_log(tmp_path, 0)  # starting over: no entry survives
    assert log.read_bytes() == b""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl"]  # no temporary left


def test_log_damaged_before_its_last_line_is_named(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n')
    with pytest.raises(LoadError) as err:
        read_log(tmp_path)
    assert_one_line(err, f"{log}, line 2")
    with pytest.raises(LoadError):
        truncate_log(tmp_path, 3)
    assert log.read_text() == '{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n'  # untouched


def test_damaged_run_json_is_named_and_kept(tmp_path):
    identity = {"settings": {"lr": 1e-3}, "data": "abc"}
    run = open_run(tmp_path / "run", identity)
    assert sorted(p.name for p in run.iterdir()) == ["run.json"]  # no temporary left
    run_file = run / "run.json"
    intact = run_file.read_bytes()
    for blob in (intact[: len(intact) // 2], b"\0" * len(intact), b"[1, 2]", b"\xff\xfe"):
        run_file.write_bytes(blob)
        with pytest.raises(LoadError) as err:
            open_run(run, identity)
        assert_one_line(err, str(run_file), "start a new run in another directory")
        assert run_file.read_bytes() == blob
    run_file.write_bytes(intact)
    assert open_run(run, identity) == run


CONFIG = TrainConfig(seq_len=32, batch_size=2, steps=6, lr=1e-3, draft_vocab_size=16,
                     ttt_length=2, checkpoint_every=2, keep_checkpoints=2, log_every=1,
                     eval_every=0)


@pytest.fixture(scope="module")
def rows():
    rs = np.random.RandomState(0)
    examples = [Example(rs.randint(0, V, 32).astype(np.int32),
                        np.array([False] * 4 + [True] * 28)) for _ in range(16)]
    return pack(examples, 32)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_target, rows):
    """A straight 6-step run: checkpoints at steps 4 and 6 are kept."""
    out = tmp_path_factory.mktemp("train") / "run"
    return train(tiny_target, rows, out, CONFIG, progress=False)


def _interrupted_copy(finished_run, path: Path) -> Path:
    """The finished run as if killed before writing its head."""
    shutil.copytree(finished_run.out, path)
    shutil.rmtree(path / "head")
    return path


def test_damaged_run_resumes_from_its_last_intact_checkpoint(finished_run, tiny_target, rows,
                                                             tmp_path, capsys):
    run = _interrupted_copy(finished_run, tmp_path / "run")
    state_files = sorted((run / "checkpoints" / "6" / "state").rglob("*"),
                         key=lambda p: p.stat().st_size if p.is_file() else 0)
    damage(state_files[-1], "truncate")
    damaged = {rel: (run / "checkpoints" / "6" / rel).read_bytes()
               for rel in files_of(run / "checkpoints" / "6")}
    with open(run / "log.jsonl", "ab") as f:
        f.write(b'{"step": 7, "loss"')  # and the log was torn
    capsys.readouterr()
    with pytest.warns(UserWarning) as warned:
        resumed = train(tiny_target, rows, run, CONFIG, progress=False)
    messages = [str(w.message) for w in warned]
    assert any(m.startswith(f"{run / 'checkpoints' / '6'}: damaged (") and
               m.endswith(f"moved to {run / 'damaged-checkpoints' / '6'}, resuming from step 4")
               for m in messages), messages
    assert any("dropped line 7" in m for m in messages), messages
    assert "resuming at step 4" in capsys.readouterr().err
    assert_same_tree(resumed.draft.params, finished_run.draft.params)  # bit-identical

    def curve(log):
        return [(e["step"], e["loss"], e["step_acc"], e["tokens_seen"]) for e in log]
    assert curve(resumed.log) == curve(finished_run.log)
    assert [e["step"] for e in resumed.log] == list(range(1, 7))
    set_aside = run / "damaged-checkpoints" / "6"  # kept byte for byte
    assert {rel: (set_aside / rel).read_bytes() for rel in files_of(set_aside)} == damaged
    assert sorted(os.listdir(run / "checkpoints")) == ["4", "6"]


def _fresh_state(tiny_target, rows) -> trainer.TrainState:
    vocab = trainer._draft_vocab(tiny_target, rows, CONFIG, None)
    draft = new_eagle3_draft(tiny_target, used_tokens=vocab.used, num_layers=1, seed=0)
    return trainer.TrainState(draft.params, trainer.make_optimizer(CONFIG).init(draft.params))


def _resume(run: Path, fresh):
    with ocp.CheckpointManager(run / "checkpoints", item_names=("state", "meta")) as manager:
        return trainer._resume(manager, run, fresh)


def test_every_damaged_checkpoint_file_falls_back_or_restores_exactly(finished_run, tiny_target,
                                                                     rows, tmp_path):
    fresh = _fresh_state(tiny_target, rows)
    source = _interrupted_copy(finished_run, tmp_path / "source")
    step, intact, tokens = _resume(source, fresh)
    assert step == 6
    assert_same_tree(intact.params, finished_run.draft.params)
    fell_back = 0
    for rel in files_of(source / "checkpoints" / "6"):
        for how in damages_of(source / "checkpoints" / "6" / rel):
            run = tmp_path / "run"
            shutil.copytree(source, run)
            damage(run / "checkpoints" / "6" / rel, how)
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")
                step, state, _ = _resume(run, fresh)
            damage_warnings = [w for w in warned if "checkpoints/6: damaged" in str(w.message)]
            if step == 4:
                fell_back += 1
                assert (run / "damaged-checkpoints" / "6").is_dir(), (rel, how)
                assert len(damage_warnings) == 1, (rel, how)
            else:  # the damage touched nothing the state is restored from
                assert step == 6 and not damage_warnings, (rel, how)
                assert_same_tree(state, intact)
            shutil.rmtree(run)
    assert fell_back >= 10


def test_garbled_checkpoint_state_is_caught_by_its_checksum(finished_run, tiny_target, rows,
                                                           tmp_path):
    """Flipping bytes in a compressed array can restore silently wrong values; the CRC-32
    in the checkpoint's meta catches it."""
    run = _interrupted_copy(finished_run, tmp_path / "run")
    meta = run / "checkpoints" / "6" / "meta" / "metadata"
    recorded = json.loads(meta.read_text())
    meta.write_text(json.dumps({**recorded, "state_crc32": recorded["state_crc32"] ^ 1}))
    with pytest.warns(UserWarning, match=r"checkpoints/6: damaged \(ValueError: its state "
                                         r"differs from when it was saved"):
        step, _, _ = _resume(run, _fresh_state(tiny_target, rows))
    assert step == 4


def test_run_whose_every_checkpoint_is_damaged_is_refused_untouched(finished_run, tiny_target,
                                                                   rows, tmp_path):
    run = _interrupted_copy(finished_run, tmp_path / "run")
    for step in ("4", "6"):
        (run / "checkpoints" / step / "meta" / "metadata").write_text("{")
    before = {rel: (run / rel).read_bytes() for rel in files_of(run)}
    with pytest.raises(LoadError) as err:
        train(tiny_target, rows, run, CONFIG, progress=False)
    assert_one_line(err, str(run / "checkpoints"), "step 6:", "step 4:", "no intact checkpoint")
    assert {rel: (run / rel).read_bytes() for rel in files_of(run)} == before
