"""Every program in examples/ runs, with the small arguments CI affords: each in a fresh
interpreter as a user would start it, exit code 0 and the line that shows it did its job.

`RUNS` names every file in examples/: either the arguments and the check of its run here,
or the test elsewhere that runs it. A new example without a CI run fails
`test_every_example_has_a_run`."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import tokenizers

from hf_oracle import make_hf_model
from test_multihost import _free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 600
TEMPLATE = ("{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}assistant{% endif %}")
CONVERSATIONS = [  # words of the tiny model's vocabulary (w5 .. w96)
    [("user", "w5 w6 w7 w8"), ("assistant", "w10 w11 w12 w13 w14 w15")],
    [("user", "w20 w21"), ("assistant", "w30 w31 w32 w33"), ("user", "w40"),
     ("assistant", "w41 w42 w43 w44 w45")],
    [("system", "w50"), ("user", "w51 w52 w53"), ("assistant", "w60 w61 w62 w63 w64 w65")],
]


@dataclasses.dataclass
class Run:
    """An example's CI run: its arguments (given the tiny chat model's directory and a
    temporary folder), extra environment, and a check of its output."""

    args: Callable[[Path, Path], list[str]]
    check: Callable[[str, Path, Path], None]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    slow: bool = False  # over ~20 s on 2 cores, or the real SmolLM2


def _acceptance_length(out: str) -> float:
    return float(re.search(r"acceptance length: ([0-9.]+)", out).group(1))


def _check_speculative_decoding(out: str, model: Path, tmp: Path) -> None:
    assert _acceptance_length(out) >= 1.0, out


def _check_parallel_drafting(out: str, model: Path, tmp: Path) -> None:
    assert "tokens identical to plain decoding: True" in out, out
    assert _acceptance_length(out) >= 1.0, out


def _check_serve_on_a_mesh(out: str, model: Path, tmp: Path) -> None:
    assert "tp=2 x dp=1 mesh" in out, out
    answer = re.search(r"^A: (.*)$", out, flags=re.M).group(1)
    assert answer.strip(), out
    assert out.rstrip().endswith("server stopped"), out


def _chats(tmp: Path) -> Path:
    """Three conversations in the OpenAI messages shape."""
    path = tmp / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in conv]})
                            + "\n" for conv in CONVERSATIONS))
    return path


def _check_train_your_own_head(out: str, model: Path, tmp: Path) -> None:
    import eaglejax

    exported = tmp / "head" / "speculators"
    assert "--speculative-config" in out and str(exported) in out, out
    config = json.loads((exported / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    target = eaglejax.load_target(model)
    draft = eaglejax.load_draft(exported, target=target)
    assert draft.config.kind == "eagle3" and draft.config.draft_vocab_size == 64


SHIPPED_EAGLE3 = ROOT / "checkpoints" / "smollm2-135m-instruct-eagle3"
RUNS: dict[str, Run | str] = {
    "custom_drafter.py": "tests/test_drafters.py::test_the_custom_drafter_example_runs",
    "serve_multihost.py": "tests/test_examples.py::test_serve_multihost",
    "speculative_decoding.py": Run(
        lambda model, tmp: ["--model", "smollm2-135m-instruct", "--draft", str(SHIPPED_EAGLE3),
                            "--max-new-tokens", "8"],
        _check_speculative_decoding, slow=True),
    "parallel_drafting.py": Run(
        lambda model, tmp: ["--model", "smollm2-135m-instruct", "--max-new-tokens", "8"],
        _check_parallel_drafting, slow=True),
    "serve_on_a_mesh.py": Run(
        lambda model, tmp: ["--model", str(model), "--no-draft", "--tp", "2", "--port", "0",
                            "--num-slots", "2", "--capacity", "64", "--max-tokens", "8",
                            "--question", "w5 w6 w7"],
        _check_serve_on_a_mesh,
        env={"XLA_FLAGS": os.environ.get("XLA_FLAGS", "")
             + " --xla_force_host_platform_device_count=8"}),
    "train_your_own_head.py": Run(
        lambda model, tmp: [str(_chats(tmp)), "--target", str(model), "--out", str(tmp / "head"),
                            "--steps", "2", "--seq-len", "32", "--batch-size", "2",
                            "--ttt-length", "2", "--draft-vocab-size", "64"],
        _check_train_your_own_head),
}


def test_every_example_has_a_run():
    files = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert sorted(RUNS) == files, "add the example to RUNS with its CI run"
    for name, run in RUNS.items():
        if isinstance(run, str):  # run by another test: that test exists and names it
            path, test = run.split("::")
            source = (ROOT / path).read_text()
            assert f"def {test}(" in source, run
            assert name.removesuffix(".py") in source, f"{run} does not run {name}"


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    """A tiny random transformers Llama with a word-level tokenizer (user, assistant, system,
    w2 .. w96; w2 is EOS) and a chat template."""
    from eaglejax.tokenizer import Tokenizer

    directory = tmp_path_factory.mktemp("chat-model")
    make_hf_model("llama", directory, seed=0)
    vocab = {"<unk>": 0, "user": 1, "w2": 2, "assistant": 3, "system": 4,
             **{f"w{i}": i for i in range(5, 97)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    Tokenizer(backend, chat_template=TEMPLATE, unk_token="<unk>").save(directory)
    return directory


def _runs_here() -> list:
    return [pytest.param(name, run, id=name.removesuffix(".py"),
                         marks=[pytest.mark.slow] if run.slow else [])
            for name, run in RUNS.items() if isinstance(run, Run)]


@pytest.mark.parametrize("name, run", _runs_here())
def test_example_runs(name, run, chat_model, tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLES / name), *run.args(chat_model, tmp_path)],
                          cwd=ROOT, env={**os.environ, **run.env}, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run.check(proc.stdout, chat_model, tmp_path)


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_serve_multihost(chat_model):
    """examples/serve_multihost.py: two CPU processes of two devices serve one tp=2 x dp=2
    mesh; process 0 answers a chat request; Ctrl-C stops both, exit code 0.
    (tests/test_multihost.py checks the two processes' tokens against one process's.)"""
    port = _free_port()
    argv = [sys.executable, str(EXAMPLES / "serve_multihost.py"), "--num-processes", "2",
            "--cpu-devices", "2", "--", "--model", str(chat_model), "--tp", "2", "--dp", "2",
            "--port", str(port), "--no-draft", "--num-slots", "2", "--capacity", "32"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # a group of its own
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        reply = _post(f"{url}/v1/chat/completions", {
            "model": chat_model.name, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "w5 w6 w7"}]})
        assert reply["choices"][0]["message"]["content"].strip()
        assert reply["usage"]["completion_tokens"] > 0
        proc.send_signal(signal.SIGINT)
        out = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:  # the launcher and the two servers it started
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
