"""The persistent compilation cache and compile time reported apart from decode speed.

The CLI runs in subprocesses (JAX keeps its cache folder for the life of a process) on a
tiny random Llama with a word-level tokenizer, each with its own temporary cache folders.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import eaglejax
from eaglejax import compilation_cache
from eaglejax.cli import main
from conftest import share_native_builds
from eaglejax.errors import ConfigError

PROMPT_TOKENS = [5, 9, 2, 17, 3]


@pytest.fixture(scope="module")
def model_dir(hf_family, tmp_path_factory) -> Path:
    """A copy of the tiny random Llama with a word-level tokenizer (w1 .. w96), so the CLI
    can take a text prompt."""
    import tokenizers

    directory = tmp_path_factory.mktemp("llama-with-words")
    shutil.copytree(hf_family("llama")[0], directory, dirs_exist_ok=True)
    vocab = {"<eos>": 0, **{f"w{i}": i for i in range(1, 97)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<eos>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return directory


def _run_cli(model_dir: Path, tmp_path: Path, *flags: str, **env: str) -> str:
    """`eaglejax generate` (12 tokens) in a fresh process whose eaglejax cache root is
    tmp_path/root; its stdout and stderr."""
    environ = {k: v for k, v in os.environ.items()
               if k not in ("EAGLEJAX_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR")}
    environ.update(EAGLEJAX_CACHE=str(share_native_builds(tmp_path / "root")),
                   JAX_PLATFORMS="cpu", **env)
    proc = subprocess.run(
        [sys.executable, "-m", "eaglejax.cli", "generate", "w5 w9 w2 w17 w3", "--model",
         str(model_dir), "--no-chat", "--max-new-tokens", "12", "--ignore-eos", *flags],
        capture_output=True, text=True, env=environ)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, proc.stderr


def _assert_no_compiled_programs(tmp_path: Path) -> None:
    """eaglejax's cache root holds nothing but native kernel builds (eaglejax.native, which
    the compilation-cache switches do not govern)."""
    root = tmp_path / "root"
    assert not root.exists() or {p.name for p in root.iterdir()} <= {"native"}


def _generate(model_dir: Path, tmp_path: Path, *flags: str, **env: str) -> tuple[dict, str]:
    """The one row `eaglejax generate --json` prints and its stderr (see `_run_cli`)."""
    stdout, stderr = _run_cli(model_dir, tmp_path, "--json", *flags, **env)
    (row,) = json.loads(stdout)
    return row, stderr


def _entries(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()} if folder.exists() else set()


def _cache_hits(stderr: str) -> set[str]:
    """The programs JAX's log (JAX_LOG_COMPILES=1) says it loaded from the persistent cache."""
    return set(re.findall(r"Persistent compilation cache hit for '(\w+)'", stderr))


def test_second_process_loads_the_programs_instead_of_compiling(model_dir, tmp_path):
    # Suffix trees: a decode loop whose compile (~1.5 s) dwarfs tracing it again (~0.4 s).
    ours = tmp_path / "root" / "jax-compilation"
    first, log = _generate(model_dir, tmp_path, "--suffix", JAX_LOG_COMPILES="1")
    written = _entries(ours)
    assert {"jit_prefill", "jit_decode_loop"} <= {name.split("-")[0] for name in written}
    assert not _cache_hits(log)
    m = first["metrics"]
    assert m["compile_s"] > 0.5
    # Compiled from scratch: running the programs is a small fraction of compiling them.
    assert m["prefill_s"] + m["decode_s"] < 0.25 * m["compile_s"]

    second, log = _generate(model_dir, tmp_path, "--suffix", JAX_LOG_COMPILES="1")
    assert {"jit_prefill", "jit_decode_loop"} <= _cache_hits(log)  # JAX's word for it
    assert _entries(ours) == written  # nothing compiled, so nothing new written
    assert second["token_ids"] == first["token_ids"]
    assert second["metrics"]["compile_s"] < 0.75 * m["compile_s"]


def test_opting_out_by_environment_writes_nothing(model_dir, tmp_path):
    row, _ = _generate(model_dir, tmp_path, EAGLEJAX_COMPILATION_CACHE="0")
    assert row["metrics"]["compile_s"] > 0
    _assert_no_compiled_programs(tmp_path)


def test_opting_out_by_flag_writes_nothing_and_summary_shows_compile(model_dir, tmp_path):
    _, stderr = _run_cli(model_dir, tmp_path, "--no-compilation-cache")
    _assert_no_compiled_programs(tmp_path)
    summary = stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"\[12 tokens, finish: length, compile \d+\.\d\d s, "
                        r"prefill \d+\.\d{3} s, decode \d+\.\d tok/s, (float32|bfloat16) weights\]",
                        summary), summary


def test_a_folder_configured_in_jax_is_kept(model_dir, tmp_path):
    users = tmp_path / "users-cache"
    _generate(model_dir, tmp_path, JAX_COMPILATION_CACHE_DIR=str(users),
              JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert {"jit_prefill", "jit_decode_loop"} <= {n.split("-")[0] for n in _entries(users)}
    _assert_no_compiled_programs(tmp_path)


def test_compile_time_is_reported_apart_in_process(target_of):
    target = target_of("llama")
    kwargs = dict(target=target, max_new_tokens=20, ignore_eos=True)
    prompts = [PROMPT_TOKENS, PROMPT_TOKENS[:3], PROMPT_TOKENS[1:]]  # a shape no other test runs
    first = eaglejax.generate(prompts, **kwargs)[0].metrics
    second = eaglejax.generate(prompts, **kwargs)[0].metrics
    assert first.compile_s > 0.1  # traced and compiled, or at least loaded from disk
    assert second.compile_s < 0.1 * first.compile_s  # this process's programs are looked up
    assert second.decode_tokens_per_s == (second.new_tokens - 1) / second.decode_s


def test_default_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("EAGLEJAX_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache.default_dir() == tmp_path / "eaglejax" / "jax-compilation"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/path")  # ignored, as the XDG spec says
    assert compilation_cache.default_dir() == Path.home() / ".cache/eaglejax/jax-compilation"
    monkeypatch.setenv("EAGLEJAX_CACHE", str(tmp_path / "root"))
    assert compilation_cache.default_dir() == tmp_path / "root" / "jax-compilation"


def test_malformed_switch_is_named_before_loading(monkeypatch, capsys):
    monkeypatch.setenv("EAGLEJAX_COMPILATION_CACHE", "maybe")
    with pytest.raises(ConfigError, match="EAGLEJAX_COMPILATION_CACHE"):
        compilation_cache.enabled()
    assert main(["generate", "hi", "--model", "/tmp/no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("eaglejax: error:") and "EAGLEJAX_COMPILATION_CACHE" in err
    assert len(err.splitlines()) == 1


def test_disabling_a_cache_in_use_is_refused(monkeypatch):
    monkeypatch.delenv("EAGLEJAX_COMPILATION_CACHE", raising=False)
    monkeypatch.setattr(compilation_cache, "_our_dir", "/some/cache")
    with pytest.raises(ConfigError, match="already in use"):
        compilation_cache.disable()
    assert compilation_cache.enabled()  # the refused call changed nothing


def test_compiles_nest():
    """A compile inside a caching block (the server's warm-up compiling `auto`'s modes) goes
    on: the lock is reentrant, in the same thread only."""
    import threading

    import jax
    import jax.numpy as jnp

    def nested():
        with compilation_cache.caching_every_program():
            with compilation_cache.caching_every_program():
                jax.jit(lambda x: x + 1).lower(jnp.ones(3)).compile()
            done.set()

    done = threading.Event()
    worker = threading.Thread(target=nested, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert done.is_set(), "a nested caching_every_program deadlocked"
