"""The peer harness (benchmarks/peers): its bookkeeping, without building or running peers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers"))

import common  # noqa: E402
import run_peers  # noqa: E402
import setup_peers  # noqa: E402


def _row(engine: str, mode: str, batch: int, tps: float, outputs: list[list[int]],
         al: float = 1.0) -> dict[str, Any]:
    return {"engine": engine, "mode": mode, "prompt_set": "mt_bench", "batch": batch,
            "status": "ok", "tokens_per_s": tps, "acceptance_length": al, "outputs": outputs}


def test_emission_clock_counts_tokens_after_first_emission() -> None:
    clock = common.EmissionClock(2)
    clock.emit(0, 1)
    clock.emit(1, 1)
    clock.emit(0, 3)
    clock.emit(1, 1)
    tokens, seconds = clock.timing()
    assert tokens == 4 and seconds >= 0.0


def test_compare_al_check_and_failed_rows_in_table() -> None:
    rows = [_row("eaglejax", "plain", 1, 10.0, [[1, 2], [3, 4]]),
            _row("eaglejax", "eagle3 K=3", 1, 12.0, [[1, 2], [3, 4]], 1.4),
            _row("vllm", "eagle3 K=3", 1, 5.0, [[1, 2], [3, 5]], 1.41)]
    data: dict[str, Any] = {"runs": []}
    run_peers.fill_failures(data, "llama.cpp", ["plain"], ["mt_bench"], [1], "exit 1: boom")
    rows += [{"engine": "llama.cpp", **r} for r in data["runs"]]
    run_peers.compare(rows)
    assert rows[2]["ratio_to_eaglejax_plain"] == pytest.approx(0.5)
    assert rows[2]["identical_to_eaglejax_plain"] == "1/2"
    (check,) = run_peers.al_check(rows)
    assert check["vllm_al"] == 1.41 and check["identical"] == "1/2"
    report = {"machine": {"cpu": "x", "cores": 2}, "max_new_tokens": 2, "hf_target_source": "t",
              "prompt_sets": {"mt_bench": [{"category": "writing"}]}, "rows": rows,
              "al_check": [check], "engines": {"llama.cpp": {"runner_s": 1.0}}}
    table = run_peers.markdown(report)
    assert "| llama.cpp | plain | 1 | failed [1] |" in table and "[1] llama.cpp: exit 1" in table


def test_failed_setup_is_reported_not_raised(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(cmd: list[str], log: Path) -> None:
        raise RuntimeError("pip exited 1: no matching distribution")

    monkeypatch.setattr(setup_peers, "_run", fail)
    result = setup_peers.ensure_peer("llamacpp", tmp_path)
    assert result["ready"] is False and "no matching distribution" in result["error"]


def test_mix_prompts_cover_every_category() -> None:
    from eaglejax.datasets import shared_datasets_dir
    from eaglejax.errors import InputError

    try:
        shared_datasets_dir()
    except InputError:
        pytest.skip("../shared/datasets is missing")
    import prompts

    questions = prompts.mix_questions(6)
    assert [q.category for q in questions] == list(prompts.MIX_ORDER)
