"""The accelerator roofline (`eaglejax.programs.roofline`): costs read from the compiled programs,
the prediction arithmetic, and `eaglejax bench --roofline DEVICE`."""

import dataclasses
import json
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import eaglejax

from eaglejax import cli
from eaglejax.config import ModelConfig
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.draft import head
from eaglejax.errors import InputError
from eaglejax.models import llama
from eaglejax.models.kv_cache import write_block
from eaglejax.programs import roofline

CONTEXT = 64


def tiny(num_layers: int = 2) -> ModelConfig:
    """A Llama whose decoder layers hold most of its bytes (small vocabulary)."""
    return ModelConfig("llama", vocab_size=256, hidden_size=128, intermediate_size=512,
                       num_layers=num_layers, num_heads=4, num_kv_heads=2, head_dim=32)


TINY = tiny(4)  # enough layers for the EAGLE-3 taps (2, L//2, L-3)
TINY_HEAD = roofline.eagle3_head(TINY, draft_vocab=128)
TINY_DRAFT_MODEL = dataclasses.replace(tiny(1), intermediate_size=1024)


def layer_bytes(config: ModelConfig) -> int:
    """bfloat16 bytes of one decoder layer's parameters."""
    infos = jax.tree.leaves(llama.param_info(config)["layers"][0], is_leaf=llama.is_param_info)
    return 2 * sum(math.prod(i.shape) for i in infos)


def cache_bytes(config: ModelConfig, batch: int, context: int, layers: int) -> int:
    """bfloat16 bytes of `layers` layers' K and V caches."""
    return 2 * 2 * layers * batch * config.num_kv_heads * context * config.head_dim


def embed_bytes(config: ModelConfig) -> int:
    return 2 * config.vocab_size * config.hidden_size


def matrices(config: ModelConfig) -> list[tuple[int, int]]:
    """[rows, columns] of every matrix a decode step reads whole, from the config's sizes:
    each layer's qkv, o, gate+up and down projections, and the (untied) output head."""
    c = config
    layer = [(c.num_kv_heads * (c.num_heads // c.num_kv_heads + 2) * c.head_dim,
              c.hidden_size), (c.hidden_size, c.num_heads * c.head_dim),
             (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]
    return layer * c.num_layers + [(c.vocab_size, c.hidden_size)]


def bf16_bytes(shapes: list[tuple[int, int]]) -> int:
    return sum(2 * n * k for n, k in shapes)


def bits(shapes: list[tuple[int, int]], storage: str, vocabulary: int = 0) -> float:
    """Bits a weight of the matrices `shapes` in `storage`, the last `vocabulary` of them
    over the vocabulary: int8 8 and a float32 scale per row; int4 4 and a float16 scale and
    minimum per 32, but a vocabulary matrix 8 and a float16 scale per 32 (Q8_0)."""
    def one(i: int, n: int, k: int) -> float:
        if storage == "bfloat16":
            return 16 * n * k
        if storage == "int8":
            return 8 * n * k + 32 * n
        return (8 + 16 / 32 if i >= len(shapes) - vocabulary else 4 + 32 / 32) * n * k

    return sum(one(i, n, k) for i, (n, k) in enumerate(shapes)) / sum(n * k for n, k in shapes)


def saved(shapes: list[tuple[int, int]], storage: str, vocabulary: int = 0) -> float:
    """Bytes one read of `shapes` saves in `storage` (`bits`): their bytes times
    (1 - bits/16)."""
    return bf16_bytes(shapes) * (1 - bits(shapes, storage, vocabulary) / 16)


# --- the costs come from the compiled programs ------------------------------------------

def test_each_added_layer_costs_its_weights_and_cache():
    # One decode step reads every weight matrix once and its layer's cache once; the
    # activations of one token are a few KB, so per added layer the bytes grow by the
    # layer's parameters and cache within 5%.
    two, four = (roofline.plain_step_cost(tiny(n), 1, CONTEXT) for n in (2, 4))
    per_layer = layer_bytes(tiny()) + cache_bytes(tiny(), 1, CONTEXT, 1)
    assert (four.bytes - two.bytes) / (2 * per_layer) == pytest.approx(1.0, abs=0.05)
    assert 1.7 < four.bytes / two.bytes < 2.0  # the lm_head and embedding row do not double
    assert four.flops / two.flops == pytest.approx(2.0, abs=0.1)


def test_doubling_the_batch_doubles_flops_not_weight_bytes():
    one, two = (roofline.plain_step_cost(tiny(), b, CONTEXT) for b in (1, 2))
    assert two.flops / one.flops == pytest.approx(2.0, abs=0.05)
    # Weights are read once for all rows: only the second row's cache (32 KB here) and
    # activations add, a few percent of the step's 1.1 MB.
    assert 0 < two.bytes - one.bytes < 0.1 * one.bytes


def test_a_step_reads_every_weight_once():
    config = tiny()
    cost = roofline.plain_step_cost(config, 1, CONTEXT)
    # Everything but the embedding table, of which a step reads one row per token.
    weights = roofline.parameter_bytes(config) - embed_bytes(config)
    assert weights <= cost.bytes <= 1.05 * (weights + cache_bytes(config, 1, CONTEXT, 2))
    # XLA's attention writes its scores to memory, which the fused-kernel traffic does not.
    assert cost.xla_attention_bytes > cost.bytes


def test_speculative_rounds_cost_more_than_a_step():
    # The report's shapes (the costs are cached: `tiny_report` compiles them once).
    step = roofline.plain_step_cost(TINY, 1, 1024)
    chain = roofline.spec_round_cost(TINY, TINY_HEAD, SpecConfig.chain(5), 1, 1024)
    tree = roofline.spec_round_cost(TINY, TINY_HEAD, SpecConfig.tree(10, 6, 60), 1, 1024)
    head_weights = 2 * sum(math.prod(i.shape) for i in jax.tree.leaves(
        head.param_info(TINY_HEAD), is_leaf=llama.is_param_info))
    # The target's weights once, the head's at least once per drafting step.
    assert chain.bytes > step.bytes + head_weights
    assert tree.flops > chain.flops > 6 * step.flops  # 6 and 60 verified tokens


def test_a_draft_model_round_reads_the_draft_model_k_times(tiny_report):
    """A draft model's chain of K runs the model K times a round (the catch-up's forward
    over the accepted block, then K-1 single steps): K reads of its weights and cache on
    top of the target's verify."""
    # the report's context: every other program's cost is cached by `tiny_report`
    report = roofline.roofline(["h100"], batches=(1,), config=TINY, draft=TINY_HEAD,
                               draft_model=TINY_DRAFT_MODEL, draft_model_name="tiny",
                               model_chain_al=2.5)
    rows = {r["program"]: r for r in report["rows"]}
    row = rows["tiny draft_model K=4"]
    assert row["accept_length"] == 2.5 and report["assumptions"]["draft_model"] == \
        "tiny draft_model K=4"
    extra = (row["gb_accessed"] - rows["plain step"]["gb_accessed"]) * 1e9
    weights = roofline.parameter_bytes(TINY_DRAFT_MODEL) - embed_bytes(TINY_DRAFT_MODEL)
    cache = cache_bytes(TINY_DRAFT_MODEL, 1, 1024, TINY_DRAFT_MODEL.num_layers)
    # K reads of the weights at least; with the caches read (and the scratch copy the
    # chain's steps write into), still short of K + 2 = 6 forwards' worth
    assert 4 * weights <= extra <= 6 * (weights + cache), (extra, weights, cache)


def test_a_dflash_round_reads_its_drafter_and_the_output_head_once(tiny_report):
    """One DFlash forward a round: the drafter's weights once, and the target's output head
    once more for the block's proposals (besides the target's verify); its cache's reads
    and writes (counted up to about twice on these tiny shapes) stay far below a second
    read of the drafter, let alone the 15 a chain of single steps would take."""
    rows = {r["program"]: r for r in tiny_report["rows"]
            if r["device"] == "h100" and r["batch"] == 1}
    extra = (rows["DFlash 5 layers, dflash K=15"]["gb_accessed"]
             - rows["plain step"]["gb_accessed"]) * 1e9
    config = roofline.dflash_head(TINY)
    drafter = 2 * sum(math.prod(i.shape) for i in jax.tree.leaves(
        head.param_info(config), is_leaf=llama.is_param_info))
    output_head = embed_bytes(TINY)
    cache = cache_bytes(TINY, 1, 1024, config.decoder.num_layers)
    assert drafter + output_head <= extra <= 2 * (drafter + output_head + cache), (
        extra, drafter, output_head, cache)


def test_8b_decode_step_matches_its_weights():
    # The real shapes (about 10 s): the step moves the weights (less the embedding table)
    # and the 1024-token cache, and does 2 FLOPs per weight plus the attention's.
    config = roofline.llama31_8b()
    cost = roofline.plain_step_cost(config, 1, 1024)
    weights = roofline.parameter_bytes(config) - embed_bytes(config)
    cache = cache_bytes(config, 1, 1024, config.num_layers)
    assert weights <= cost.bytes <= 1.01 * (weights + cache)
    attention = 4 * config.num_heads * 1024 * config.head_dim * config.num_layers
    assert cost.flops == pytest.approx(weights + attention, rel=0.02)  # 2 FLOPs / 2 bytes


@pytest.mark.parametrize("storage", ["bfloat16", "int8", "int4"])
def test_8b_weights_fit_per_storage(storage):
    """Llama-3.1-8B's weights: 16.06 GB in bfloat16 (over a v5e's 16 GB), about 8 in int8
    and 5.5 in int4 (its embedding and output head in Q8_0); the plain step (cached by the
    test above) moves the difference less."""
    config = roofline.llama31_8b()
    rows = {d: roofline.predict(d, config, batch=1, context=1024, storage=storage)[0]
            for d in ("h100", "tpu-v5e")}
    gb = {"bfloat16": 16.06, "int8": 8.04, "int4": 5.48}[storage]
    assert rows["h100"]["weights_gb"] == pytest.approx(gb, abs=0.005)
    assert rows["h100"]["weights_fit"] and rows["h100"]["storage"] == storage
    assert rows["tpu-v5e"]["weights_fit"] is (storage != "bfloat16")
    bf16 = roofline.predict("h100", config, batch=1, context=1024)[0]
    assert (bf16["gb_accessed"] - rows["h100"]["gb_accessed"]) * 1e9 == pytest.approx(
        saved(matrices(config), storage, vocabulary=1))


def test_fused_gathers_and_scatters_count_only_what_moves():
    table = jax.ShapeDtypeStruct((1000, 512), jnp.float32)
    rows = jax.ShapeDtypeStruct((8,), jnp.int32)
    gather = jax.jit(lambda t, i: t[i] * 2.0).lower(table, rows).compile()
    counted = roofline.analysed(gather)[0] * 2  # back to float32 bytes
    assert counted < 4 * 8 * 512 * 4  # the 8 rows, not the 2 MB table
    cache = jax.ShapeDtypeStruct((8, 2, 1000, 32), jnp.float32)
    new = jax.ShapeDtypeStruct((8, 3, 2, 32), jnp.float32)
    scatter = jax.jit(write_block, donate_argnums=0).lower(cache, new, rows).compile()
    assert roofline.analysed(scatter)[0] * 2 < 6 * 8 * 3 * 2 * 32 * 4  # not the 2 MB cache


@pytest.mark.parametrize("form", [dict, list])
def test_cost_analysis_dict_and_list_forms(form):
    class Compiled:
        def cost_analysis(self):
            analysis = {"bytes accessed": 400.0, "flops": 7.0}
            return analysis if form is dict else [analysis]

        def as_text(self):
            return ""

    assert roofline.analysed(Compiled()) == (200.0, 7.0)  # float32 bytes -> bfloat16


# --- the prediction ---------------------------------------------------------------------

def test_roofline_arithmetic():
    h100 = roofline.device("H100")
    assert roofline.seconds(3.35e12, 1.0, h100) == pytest.approx(1.0)  # memory-bound
    assert roofline.seconds(1.0, 989.4e12 * 2, h100) == pytest.approx(2.0)  # compute-bound
    assert roofline.seconds(3.35e12, 0.0, h100, efficiency=0.5) == pytest.approx(2.0)
    assert roofline.tokens_per_second(8, 0.02) == pytest.approx(400.0)
    assert roofline.tokens_per_second(1, 0.02, accept_length=3.5) == pytest.approx(175.0)


@pytest.fixture(scope="module")
def tiny_report():
    return roofline.roofline(["h100", "tpu-v5e"], config=TINY, draft=TINY_HEAD)


def test_report_rows_follow_the_roofline(tiny_report):
    rows = tiny_report["rows"]
    assert len(rows) == 2 * 2 * 5  # batches x devices x programs
    for row in rows:
        dev = roofline.DEVICES[row["device"]]
        t = max(row["gb_accessed"] * 1e9 / dev.bandwidth, row["gflops"] * 1e9 / dev.peak_flops)
        assert row["ms"] == pytest.approx(t * 1e3)
        assert row["tokens_per_s"] == pytest.approx(row["batch"] * row["accept_length"] / t)
    plain = [r for r in rows if r["program"] == "plain step"]
    assert all(r["speedup"] == 1.0 and r["accept_length"] == 1.0 for r in plain)
    assert {r["accept_length"] for r in rows} == {1.0, 3.5, 5.0, 6.0}
    a = tiny_report["assumptions"]
    assert (a["chain"], a["parallel"], a["tree"]) == (
        "chain K=5", "parallel K=5", "tree top_k=10 depth=6 total=60")


def test_parallel_round_reads_the_head_once(tiny_report):
    """The chain runs the head K times a round, reading its weights K times; P-EAGLE's one
    forward reads them once: the parallel round moves at least (K - 1) head reads less.
    Same verification, same AL by default."""
    rows = {(r["device"], r["batch"], r["program"]): r for r in tiny_report["rows"]}
    chain, parallel = rows["h100", 1, "chain K=5"], rows["h100", 1, "parallel K=5"]
    infos = jax.tree.leaves(head.param_info(TINY_HEAD), is_leaf=llama.is_param_info)
    head_read = 2 * sum(math.prod(i.shape) for i in infos if i.shape[0] != TINY.vocab_size)
    saved = (chain["gb_accessed"] - parallel["gb_accessed"]) * 1e9
    # at least four reads of the head's weights; at most twice that, as each chain step's
    # other traffic (activations, its cache rows and logits) is smaller than the weights
    assert 4 * head_read <= saved <= 8 * head_read
    assert parallel["accept_length"] == chain["accept_length"]


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_quantized_rows_read_fewer_weight_bytes(tiny_report, storage):
    """Each program reads the target's matrices once in `storage` rather than bfloat16
    (the DFlash drafter the output head once more): its bytes drop by their bytes times
    1 - bits/16, FLOPs unchanged; memory-bound steps speed up by the byte ratio. Computed
    from the bfloat16 costs `tiny_report` compiled."""
    report = roofline.roofline(["h100", "tpu-v5e"], config=TINY, draft=TINY_HEAD,
                               storage=storage)
    assert report["assumptions"]["weight_storage"] == storage
    assert report["assumptions"]["storage"].startswith(f"{storage} target matrices")
    head = [(TINY.vocab_size, TINY.hidden_size)]
    step_saved = saved(matrices(TINY), storage, vocabulary=1)
    head_saved = saved(head, storage, vocabulary=1)
    for bf16, row in zip(tiny_report["rows"], report["rows"], strict=True):
        assert (bf16["device"], bf16["batch"], bf16["program"]) == \
            (row["device"], row["batch"], row["program"])
        extra = head_saved if row["program"].startswith("DFlash") else 0
        for key in ("gb_accessed", "gb_xla_attention"):
            assert (bf16[key] - row[key]) * 1e9 == pytest.approx(step_saved + extra)
        assert row["gflops"] == bf16["gflops"]
        if row["program"] == "plain step" and bf16["bound"] == "memory":
            assert row["bound"] == "memory"
            assert row["tokens_per_s"] / bf16["tokens_per_s"] == pytest.approx(
                bf16["gb_accessed"] / row["gb_accessed"])
    assert sum(r["program"] == "plain step" and r["bound"] == "memory"
               for r in report["rows"]) >= 2
    weights = report["weights"]
    stored = matrices(TINY) + head  # and the embedding table
    assert weights["bits_per_weight"] == pytest.approx(bits(stored, storage, vocabulary=2))
    assert weights["gb"] * 1e9 == pytest.approx(
        roofline.parameter_bytes(TINY) - saved(stored, storage, vocabulary=2))
    assert weights["fits"] == {"h100": True, "tpu-v5e": True}
    text = roofline.format_report(report)
    assert f"target weights in {storage}: {weights['gb']:.2f} GB; fit the h100's 80 GB, " \
        "fit the tpu-v5e's 16 GB" in text


def test_bfloat16_is_the_default_storage(tiny_report):
    assert tiny_report["assumptions"]["storage"] == "bfloat16 weights and KV cache"
    assert tiny_report["weights"]["bits_per_weight"] == 16.0
    assert tiny_report["weights"]["gb"] * 1e9 == roofline.parameter_bytes(TINY)
    assert roofline.roofline(["h100", "tpu-v5e"], config=TINY, draft=TINY_HEAD,
                             storage="bfloat16")["rows"] == tiny_report["rows"]
    assert [d.memory for d in roofline.DEVICES.values()] == [80e9, 141e9, 16e9, 95e9]


@pytest.mark.parametrize("storage", ["int8", "int4"])
def test_a_loaded_targets_bytes_are_its_arrays(target_of, storage):
    """A quantized target's `WeightBytes` come from its stored arrays and match the
    formula for the same storage; a float target's are bfloat16's."""
    from eaglejax.bench import target_weight_bytes

    target = target_of("llama")
    assert target_weight_bytes(target) == roofline.weight_bytes(target.config)
    stored = target_weight_bytes(target.with_weight_dtype(storage))
    assert stored.storage == {"int8": "int8", "int4": "Q4_1 blocks"}[storage]
    assert dataclasses.replace(stored, storage=storage) == \
        roofline.weight_bytes(target.config, storage)


def test_bad_arguments_are_refused():
    with pytest.raises(InputError, match="known devices: h100, h200"):
        roofline.roofline(["a100"])
    with pytest.raises(InputError, match="efficiency"):
        roofline.roofline(["h100"], efficiency=1.5)
    with pytest.raises(InputError, match="attention"):
        roofline.roofline(["h100"], attention="flash")
    with pytest.raises(InputError, match="storage"):
        roofline.roofline(["h100"], storage="int2")


# --- the CLI ----------------------------------------------------------------------------

@pytest.fixture
def tiny_models(monkeypatch, tiny_report):
    """`bench --roofline` on the tiny shapes (their costs are cached by `tiny_report`)."""
    monkeypatch.setattr(roofline, "llama31_8b", lambda: TINY)
    monkeypatch.setattr(roofline, "eagle3_head", lambda target: TINY_HEAD)
    monkeypatch.setattr(roofline, "llama32_1b", lambda: TINY_DRAFT_MODEL)


def test_cli_prints_the_table(tiny_models, capsys):
    assert cli.main(["bench", "--roofline", "h100"]) == 0
    out = capsys.readouterr().out
    assert "plain step" in out and "tree top_k=10 depth=6 total=60" in out
    assert "h100" in out and "AL 3.5 for chain K=5" in out
    assert "Llama-3.2-1B draft_model K=4" in out and "AL 3.0 for Llama-3.2-1B" in out
    assert "DFlash 5 layers, dflash K=15" in out and "AL 5.0 for DFlash dflash K=15" in out
    assert "published" in out and "158.34" in out and "373.25" in out
    assert "tpu-v5e" not in out.split("assumptions")[0]


def test_cli_json(tiny_models, capsys):
    assert cli.main(["bench", "--roofline", "h100", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {r["device"] for r in report["rows"]} == {"h100"}
    assert report["published"]["eagle3_tokens_per_s"] == 373.25


def test_cli_roofline_storage(tiny_models, capsys):
    """`eaglejax roofline DEVICE... --storage S --batch-size B`, and `bench --roofline`'s
    --weight-dtype without a model."""
    argv = ["roofline", "h100", "tpu-v5e", "--storage", "int8", "--batch-size", "1"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "int8 target matrices" in out and "target weights in int8:" in out
    table = out.split("assumptions")[0]
    assert "h100" in table and "tpu-v5e" in table and "    8  " not in table
    assert cli.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["weights"]["storage"] == "int8" and {r["batch"] for r in report["rows"]} == {1}
    assert cli.main(["bench", "--roofline", "h100", "--weight-dtype", "int4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weights"]["storage"] == "int4"
    assert cli.main(["bench", "--roofline", "h100", "--weight-dtype", "float16"]) == 2
    assert "bfloat16, int8, int4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["roofline", "h100", "--storage", "int2"])


def test_cli_unknown_device(capsys):
    assert cli.main(["bench", "--roofline", "a100"]) == 2
    err = capsys.readouterr().err
    assert "--roofline" in err and "'a100'" in err
    assert "h100, h200, tpu-v5e, tpu-v5p" in err


def test_cli_unknown_device_exit_status():
    proc = subprocess.run([sys.executable, "-m", "eaglejax.cli", "bench", "--roofline", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "unknown device 'x'; known devices: h100, h200, tpu-v5e, tpu-v5p" in proc.stderr


def test_predict_rows_follow_the_costs():
    """One model as it runs: its plain step, and a round at the acceptance length given."""
    spec = SpecConfig.chain(2)
    plain, chain = roofline.predict("h100", TINY, batch=1, context=CONTEXT, draft=TINY_HEAD,
                                    spec=spec, accept_length=2.5)
    h100 = roofline.DEVICES["h100"]
    for row, al, cost in ((plain, 1.0, roofline.plain_step_cost(TINY, 1, CONTEXT)),
                          (chain, 2.5, roofline.spec_round_cost(TINY, TINY_HEAD, spec, 1,
                                                                CONTEXT))):
        t = roofline.seconds(cost.moved("fused"), cost.flops, h100)
        assert row["ms"] == pytest.approx(1e3 * t)
        assert row["tokens_per_s"] == pytest.approx(al / t)
    assert chain["program"] == spec.describe() and chain["accept_length"] == 2.5
    assert [r["program"] for r in roofline.predict("h100", TINY, batch=1, context=CONTEXT)] \
        == ["plain step"]


@pytest.mark.parametrize("name,kind,same", [
    ("h100", "NVIDIA H100 80GB HBM3", True), ("h200", "NVIDIA H200", True),
    ("h100", "NVIDIA H200", False), ("tpu-v5e", "TPU v5 lite", True),
    ("tpu-v5p", "TPU v5 lite", False), ("h100", "cpu", False)])
def test_a_run_is_matched_to_the_device_predicted(name, kind, same):
    assert roofline.runs_on(name, kind) is same
    assert roofline.platform_of(name) == ("tpu" if name.startswith("tpu") else "gpu")


def test_bench_puts_the_run_beside_its_roofline(tmp_path, capsys):
    """`bench --model M --draft random --tree ... --roofline h100`: the run as usual, and
    beside it the roofline of this model and shape at the acceptance it measured, with
    measured over predicted; on a CPU the run is said not to be on the device."""
    from test_hub import _model_files

    from eaglejax.bench import describe_beside_roofline

    model = _model_files(tmp_path / "model", seed=3)
    argv = ["bench", "--model", str(model), "--draft", "random", "--tree", "2,2,3",
            "--num-prompts", "1", "--max-new-tokens", "4", "--roofline", "h100"]
    assert cli.main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    beside = report["roofline"]
    plain, tree = beside["rows"]
    assert tree["program"] == report["speculative"] == "tree top_k=2 depth=2 total=3"
    assert report["identical_tokens"] is True  # the tree from the command line decodes plainly
    assert tree["accept_length"] == report["acceptance_length"]
    assert plain["measured_tokens_per_s"] == report["plain_decode_tokens_per_s"]
    assert tree["measured_tokens_per_s"] == report["spec_decode_tokens_per_s"]
    assert tree["measured_over_predicted"] == pytest.approx(
        report["spec_decode_tokens_per_s"] / tree["tokens_per_s"])
    config = eaglejax.load_target(str(model)).config
    (expected,) = roofline.predict("h100", config, batch=1,
                                   context=report["mean_context_tokens"])
    assert plain["tokens_per_s"] == pytest.approx(expected["tokens_per_s"])
    assert plain["storage"] == "bfloat16" and plain["weights_fit"] is True
    assert beside["same_device"] is (jax.default_backend() == "gpu" and roofline.runs_on(
        "h100", jax.devices()[0].device_kind))
    text = describe_beside_roofline(beside)
    assert "roofline for h100 (bfloat16 weights" in text and "at AL" in text
    assert ("not measured on the h100" in text) is not beside["same_device"]
