"""Accelerator decode speed predicted from XLA's cost analysis of the compiled programs.

No accelerator is needed: the plain decode step and one speculative round (the library's
own `plain.decode_step` and `speculative.verified_round`, one step each, since XLA's cost
analysis counts a while loop's body once at most) are lowered with abstract inputs
(`jax.ShapeDtypeStruct`: no weight is ever allocated) and compiled for the CPU; their
"bytes accessed" and "flops" give a roofline time max(bytes / bandwidth, flops / peak).
Plain tokens/s = batch / t_step; speculative tokens/s = batch * AL / t_round, with the
average acceptance length AL (tokens per round, bonus included) an explicit assumption.

How the CPU compile is made to count what an accelerator moves:
  * only XLA's own operations (`native.xla_only()`, attn_impl "xla"): the native CPU
    kernels are custom calls whose bytes and FLOPs XLA cannot see;
  * float32 compute, bytes scaled to 16-bit storage (x 2/4): XLA:CPU widens bfloat16
    matmul operands to float32 first (a converted copy of every weight per call, about 5x
    the bytes), which no accelerator does; a float32 matmul reads its operands as stored.
    FLOPs do not depend on the dtype. (The few float32 intermediates of a bfloat16
    program, logits and norms, are halved with the rest: negligible here.)
  * XLA's fusion cost model counts the whole table a fused gather reads and the whole
    buffer a fused scatter updates in place (embedding lookups, KV-cache writes); only the
    gathered rows and the updates move, so the difference, read off the optimised HLO, is
    taken off (`fused_overcount`);
  * the XLA attention path reads every slot of its cache, where an accelerator kernel
    (Pallas, FlashAttention) reads the valid prefix: caches are compiled with exactly
    `context` slots, so their reads are those of a longer cache holding `context` tokens;
  * the XLA attention path also writes its scores and probabilities to memory, which a
    fused kernel (the library's Pallas kernels on GPU/TPU) keeps on chip. With
    attention="fused" (the default) the bytes come from a second compile in which the
    attention is a stand-in with a fused kernel's traffic (`fused_attention_traffic`: it
    reads q, the cache and the new K/V once and writes the output); FLOPs always come from
    the real XLA attention. attention="xla" takes both from the XLA path.

Quantized weight storage (`storage` "int8" or "int4", or a loaded target's own) is
weight-only quantization as accelerators run it: the target's matrices are read as stored
and dequantized to bfloat16 in each matmul's prologue, so the FLOPs stay bfloat16's and
each read of them moves their stored bytes instead of 2 a weight (`WeightBytes`; norms,
draft heads, draft models and the KV cache stay bfloat16). The costs are compiled once in
bfloat16 and the difference is taken off every read of the target's weights: one per plain
step or round, plus a drafter's reads of the target's output head (`head_reads`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from eaglejax import native
from eaglejax.config import ModelConfig
from eaglejax.decoding.loops import Loop, PlainLoop, SpecLoop, Weights
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.draft import head
from eaglejax.draft.config import DraftConfig
from eaglejax.errors import InputError
from eaglejax.models import llama, quantized
from eaglejax.programs import hlo
from eaglejax.programs.reference import dflash_head, eagle3_head, llama31_8b, llama32_1b


@dataclasses.dataclass(frozen=True)
class Device:
    """An accelerator's published peaks: HBM bytes/s and dense bfloat16 FLOP/s, and its HBM
    capacity in bytes."""

    name: str
    bandwidth: float
    peak_flops: float
    memory: float
    source: str


DEVICES = {d.name: d for d in (
    # NVIDIA H100 Tensor Core GPU datasheet, SXM5: 80 GB of HBM3 at 3.35 TB/s; BF16 Tensor
    # Core 1,979 TFLOPS with 2:4 sparsity, i.e. 989.4 dense.
    Device("h100", 3.35e12, 989.4e12, 80e9, "NVIDIA H100 SXM datasheet"),
    # NVIDIA H200 datasheet, SXM: 141 GB of HBM3e at 4.8 TB/s; the H100's tensor cores.
    Device("h200", 4.8e12, 989.4e12, 141e9, "NVIDIA H200 SXM datasheet"),
    # cloud.google.com/tpu/docs/v5e: 197 TFLOPs bf16 per chip, HBM2 16 GB, 819 GBps.
    Device("tpu-v5e", 819e9, 197e12, 16e9, "Cloud TPU v5e docs"),
    # cloud.google.com/tpu/docs/v5p: 459 TFLOPs bf16 per chip, HBM2e 95 GB, 2,765 GBps.
    Device("tpu-v5p", 2765e9, 459e12, 95e9, "Cloud TPU v5p docs"),
)}

# SGLang's EAGLE-3 announcement: Llama-3.1-8B-Instruct, MT-bench, one H100, batch 1.
PUBLISHED = {"device": "h100", "batch": 1, "source": "SGLang, EAGLE-3 on MT-bench",
             "plain_tokens_per_s": 158.34, "eagle3_tokens_per_s": 373.25}

COMPILE_DTYPE = jnp.float32  # see the module docstring
STORAGE_BYTES = 2  # bfloat16 weights and KV cache
STORAGES = ("bfloat16", "int8", "int4")  # the target's weight storage (module docstring)
MAX_TOKENS = 128  # the output buffer's length (a few hundred bytes per row)
PROMPT = 16  # the prompt length the abstract state is shaped by (nothing is prefilled)
ATTENTION = ("fused", "xla")


@dataclasses.dataclass(frozen=True)
class Cost:
    """One program's cost with 16-bit storage: bytes moved with a fused attention kernel
    and with XLA's attention path, and FLOPs."""

    bytes: float
    flops: float
    xla_attention_bytes: float

    def moved(self, attention: str) -> float:
        """The bytes for `attention` ("fused" or "xla")."""
        return self.bytes if attention == "fused" else self.xla_attention_bytes


def parameter_bytes(config: ModelConfig, itemsize: int = STORAGE_BYTES) -> int:
    """Bytes of a target's parameters at `itemsize` bytes each."""
    infos = jax.tree.leaves(llama.param_info(config), is_leaf=llama.is_param_info)
    return itemsize * sum(math.prod(i.shape) for i in infos)


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """A target's parameter bytes in `storage`: all of them (`total`), its matrices'
    (`matrices`, of `matrix_weights` weights), what one forward reads whole (`read`: all
    but an untied embedding table, whose lookups read a few rows) and its output head's
    (`head`)."""

    storage: str
    total: float
    matrices: float
    matrix_weights: int
    read: float
    head: float

    @property
    def bits_per_weight(self) -> float:
        """The matrices' stored bits per weight (scales and minimums included)."""
        return 8 * self.matrices / self.matrix_weights


def _stored_bytes(info: llama.ParamInfo, storage: str) -> float:
    """Bytes of one parameter in `storage` as the library stores it: int8 1 a weight and a
    float32 scale per output row, int4 5/8 a weight (4-bit values, a float16 scale and
    minimum per 32) but vocabulary matrices 34/32 (Q8_0: 8-bit values and a float16 scale
    per 32, `llama.is_vocabulary`); vectors, and matrices whose shape does not tile, 2 a
    weight."""
    n = math.prod(info.shape)
    if not info.matrix or storage == "bfloat16" or not quantized.tiles(info.shape):
        return STORAGE_BYTES * n
    if storage == "int8":
        return n + 4 * (n // info.shape[-1])
    return n * 34 / 32 if llama.is_vocabulary(info) else n * 5 / 8


def weight_bytes(config: ModelConfig, storage: str = "bfloat16", params: Any = None
                 ) -> WeightBytes:
    """`config`'s `WeightBytes` in `storage` (`STORAGES`); with `params` (a loaded
    target's, `storage` naming them, e.g. "Q4_1 + Q8_0 blocks"), the nbytes of the matrices
    it keeps quantized and 2 bytes a weight for the rest."""
    if params is None and storage not in STORAGES:
        raise InputError(f"storage must be one of {STORAGES}, got {storage!r}")
    infos = llama.param_info(config)
    if params is None:
        sizes = jax.tree.map(lambda i: _stored_bytes(i, storage), infos,
                             is_leaf=llama.is_param_info)
    else:
        sizes = jax.tree.map(lambda i, p: p.nbytes if quantized.is_int8(p)
                             else STORAGE_BYTES * math.prod(i.shape),
                             infos, params, is_leaf=llama.is_param_info)
    pairs = list(zip(jax.tree.leaves(infos, is_leaf=llama.is_param_info),
                     jax.tree.leaves(sizes)))
    total = sum(size for _, size in pairs)
    return WeightBytes(
        storage, total, sum(size for i, size in pairs if i.matrix),
        sum(math.prod(i.shape) for i, _ in pairs if i.matrix),
        total - (0 if config.tie_word_embeddings else sizes["embed"]),
        sizes.get("lm_head", sizes["embed"]))


def head_reads(draft: DraftConfig | ModelConfig | None, spec: SpecConfig | None) -> int:
    """Reads of the target's output head by one round's drafting: one for a DFlash drafter
    without its own (one forward), one per draft depth for an EAGLE-1/2 head; none for
    EAGLE-3 heads (their own `lm_head`) and draft models."""
    if not isinstance(draft, DraftConfig) or spec is None or draft.kind == "eagle3" \
            or (draft.kind == "dflash" and draft.reduced_vocab):
        return 0
    return 1 if draft.kind == "dflash" else spec.draft_depth


def quantized_bytes(moved: float, config: ModelConfig, stored: WeightBytes,
                    drafter_head_reads: int = 0) -> float:
    """A program's `moved` bytes (bfloat16 weights) with the target's weights in `stored`:
    less their saving on one read of them and `drafter_head_reads` more of the head."""
    bf16 = weight_bytes(config)
    return moved - (bf16.read - stored.read) - drafter_head_reads * (bf16.head - stored.head)


def _describe_storage(stored: WeightBytes) -> str:
    if stored.storage == "bfloat16":
        return "bfloat16 weights and KV cache"
    return (f"{stored.storage} target matrices ({stored.bits_per_weight:.2f} bits a weight, "
            f"dequantized to bfloat16 in each matmul: bfloat16 FLOPs); norms, draft heads, "
            f"draft models and the KV cache in bfloat16")


def _abstract(infos: Any) -> Any:
    return jax.tree.map(lambda i: jax.ShapeDtypeStruct(i.shape, COMPILE_DTYPE), infos,
                        is_leaf=llama.is_param_info)


# --- reading the compiled program --------------------------------------------------------

_FUSION_CALLS = re.compile(r"\bfusion\(.*calls=%([\w.\-]+)")


def _sole_parameter(name: str, found: dict[str, hlo.Instruction], reads: dict[str, int]
                    ) -> hlo.Instruction | None:
    """The fusion parameter `name` is (through bitcasts) when nothing else reads it."""
    while name in found and reads.get(name, 0) == 1:
        instr = found[name]
        if instr.opcode == "parameter":
            return instr
        if instr.opcode != "bitcast":
            return None
        name = instr.operands[0]
    return None


def fused_overcount(hlo_text: str) -> float:
    """Bytes XLA's cost analysis counts beyond what fused gathers and scatters move.

    Inside a fusion, a parameter that only a gather reads is counted whole (an embedding
    table for a few rows), and a scatter at the fusion's root that updates a parameter in
    place (a KV-cache write) is counted as reading and writing the whole buffer; only the
    gathered rows and the updates move."""
    blocks, _ = hlo.computations(hlo_text)
    fused = {m.group(1) for lines in blocks.values() for line in lines
             if (m := _FUSION_CALLS.search(line))}
    extra = 0.0
    for name in fused:
        found, reads = hlo.instructions(blocks.get(name, []))
        for instr in found.values():
            if instr.opcode == "gather":
                table = _sole_parameter(instr.operands[0], found, reads)
                if table is not None:
                    extra += max(table.nbytes - instr.nbytes, 0)
            elif instr.opcode == "scatter" and instr.root and len(instr.operands) == 3:
                buffer = _sole_parameter(instr.operands[0], found, reads)
                updates = found.get(instr.operands[2])
                if buffer is not None and updates is not None:
                    extra += max(buffer.nbytes + instr.nbytes - updates.nbytes, 0)
    return extra


def analysed(compiled: Any) -> tuple[float, float]:
    """(bytes, flops) of a compiled float32 program at `STORAGE_BYTES` per element, without
    `fused_overcount`. `cost_analysis()` is one dict, or a list of them (one per module),
    depending on the JAX version."""
    analysis = compiled.cost_analysis()
    parts = analysis if isinstance(analysis, (list, tuple)) else [analysis]
    counted = sum(float(p.get("bytes accessed", 0.0)) for p in parts)
    flops = sum(float(p.get("flops", 0.0)) for p in parts)
    scale = STORAGE_BYTES / jnp.dtype(COMPILE_DTYPE).itemsize
    return (counted - fused_overcount(compiled.as_text())) * scale, flops


# --- the programs ------------------------------------------------------------------------

def fused_attention_traffic(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                            cache_lengths: jax.Array, k_new: jax.Array, v_new: jax.Array,
                            mask: jax.Array, *, impl: str = "auto",
                            tables: jax.Array | None = None, staged: bool = False,
                            cache_mask: jax.Array | None = None) -> jax.Array:
    """A stand-in for `attention` that moves what a fused kernel moves: q, the cache, the
    new K/V and the masks read once, an output of q's shape written (its value is
    meaningless; the FLOPs are taken from the real attention). Programs traced for the
    roofline keep slot caches (`tables` None)."""
    if tables is not None:
        raise ValueError("the roofline traces slot caches, not paged ones")
    group = q.shape[2] // k_new.shape[2]
    summary = jnp.sum(k_cache, axis=2) + jnp.sum(v_cache, axis=2) + jnp.sum(k_new + v_new, 1)
    seen = jnp.sum(mask, axis=-1).astype(q.dtype)[..., None, None]  # [B,T,1,1]
    if cache_mask is not None:
        seen = seen + jnp.sum(cache_mask, axis=-1).astype(q.dtype)[..., None, None]
    return q * seen + jnp.repeat(summary, group, axis=1)[:, None].astype(q.dtype)


@contextlib.contextmanager
def _attention(kind: str) -> Iterator[None]:
    """Trace with XLA's operations; with kind "fused", with `fused_attention_traffic` in
    place of the decoder layers' attention (target and head alike)."""
    saved = llama.attention
    if kind == "fused":
        llama.attention = fused_attention_traffic
    llama.decoder_layer_call.clear_cache()  # its traces hold the attention they called
    try:
        with native.xla_only():
            yield
    finally:
        llama.attention = saved
        llama.decoder_layer_call.clear_cache()


def _cost(step: Callable, args: tuple, donate: int) -> Cost:
    """`Cost` of `step(*args)` compiled twice (fused-attention traffic, XLA attention),
    donating args[donate]: the state is updated in place, as inside the decode loop."""
    measured = {}
    for kind in ATTENTION:
        def fresh(*a):  # a new function each time: jit would reuse the other kind's trace
            return step(*a)

        with _attention(kind):
            compiled = jax.jit(fresh, donate_argnums=(donate,)).lower(*args).compile()
        measured[kind] = analysed(compiled)
    return Cost(measured["fused"][0], measured["xla"][1], measured["xla"][0])


def _inputs(batch: int) -> tuple[Any, ...]:
    """Abstract prompt, prompt lengths, row keys, sampling settings and max_new_tokens."""
    i32 = jnp.int32
    keys = jax.eval_shape(lambda: jax.vmap(jax.random.PRNGKey)(jnp.zeros((batch,), jnp.uint32)))
    return (jax.ShapeDtypeStruct((batch, PROMPT), i32), jax.ShapeDtypeStruct((batch,), i32),
            keys, jax.eval_shape(SamplingParams.make), jax.ShapeDtypeStruct((), i32))


def _step_cost(loop: Loop, weights: Weights, batch: int, context: int) -> Cost:
    """One greedy step of `loop` (`Loop.step`) over caches of `context` slots, from the
    state its prefill leaves (traced abstractly)."""
    prompt, lengths, keys, sampling, max_new = _inputs(batch)
    common = dict(greedy=True, stop=StopCriteria())
    state = jax.eval_shape(lambda w, *inputs: loop.prefill_state(
        w, *inputs, capacity=context, max_tokens=MAX_TOKENS, **common),
        weights, prompt, lengths, keys, sampling, max_new)

    def step(weights, state, sampling, max_new):
        return loop.step(weights, sampling, max_new, **common)(state)

    return _cost(step, (weights, state, sampling, max_new), donate=1)


@functools.cache
def plain_step_cost(config: ModelConfig, batch: int, context: int) -> Cost:
    """One plain decode step (`plain.decode_step`, greedy: a 1-token target forward,
    lm_head, argmax, the token recorded) over caches of `context` slots (cached: a cost
    depends on the shapes only)."""
    weights = Weights(_abstract(llama.param_info(config)))
    return _step_cost(PlainLoop(config, "xla"), weights, batch, context)


@functools.cache
def spec_round_cost(config: ModelConfig, draft: DraftConfig | ModelConfig, spec: SpecConfig,
                    batch: int, context: int) -> Cost:
    """One speculative round (`speculative.verified_round`, greedy: draft, verify every node
    in one target forward, commit, catch the head (or draft model) up) over caches of
    `context` slots (cached)."""
    if isinstance(draft, ModelConfig):  # a draft model, over the ids both vocabularies hold
        info, shared = llama.param_info(draft), min(draft.vocab_size, config.vocab_size)
    else:
        info, shared = head.param_info(draft), draft.draft_vocab_size
    weights = Weights(_abstract(llama.param_info(config)), _abstract(info),
                      jax.ShapeDtypeStruct((shared,), jnp.int32))
    return _step_cost(SpecLoop(config, draft, spec, "xla"), weights, batch, context)


# --- the prediction ----------------------------------------------------------------------

def device(name: str) -> Device:
    """The `DEVICES` entry `name` (InputError naming the known devices otherwise)."""
    key = str(name).lower()
    if key not in DEVICES:
        raise InputError(f"--roofline: unknown device {name!r}; known devices: "
                         f"{', '.join(DEVICES)}")
    return DEVICES[key]


def seconds(moved: float, flops: float, dev: Device, efficiency: float = 1.0) -> float:
    """Roofline time max(bytes / bandwidth, flops / peak), both at `efficiency` of peak."""
    return max(moved / dev.bandwidth, flops / dev.peak_flops) / efficiency


def tokens_per_second(batch: int, step_seconds: float, accept_length: float = 1.0) -> float:
    """Tokens per second of `batch` rows that each gain `accept_length` tokens per step."""
    return batch * accept_length / step_seconds


def roofline(devices: list[str], batches: tuple[int, ...] = (1, 8), *, context: int = 1024,
             chain: SpecConfig = SpecConfig.chain(5), chain_al: float = 3.5,
             parallel: SpecConfig = SpecConfig.parallel(5), parallel_al: float | None = None,
             tree: SpecConfig = SpecConfig.tree(top_k=10, depth=6, total_tokens=60),
             tree_al: float = 6.0, efficiency: float = 1.0, attention: str = "fused",
             config: ModelConfig | None = None, draft: DraftConfig | None = None,
             draft_model: ModelConfig | None = None, draft_model_name: str = "Llama-3.2-1B",
             model_chain: SpecConfig = SpecConfig.draft_model(4), model_chain_al: float = 3.0,
             dflash: SpecConfig = SpecConfig.dflash(15), dflash_al: float = 5.0,
             storage: str = "bfloat16") -> dict[str, Any]:
    """Predicted decode speed of the plain step, a chain round, a P-EAGLE parallel chain
    round, a tree round, a DFlash block round and a draft model's chain round for every
    batch and device, as a JSON-ready report.

    Defaults: Llama-3.1-8B and its public EAGLE-3 head (`llama31_8b`, `eagle3_head`), 1024
    cached tokens, chain K=5 at an assumed AL of 3.5, the same head drafting its K=5 tokens
    in one forward as a P-EAGLE head at the chain's AL unless `parallel_al` is given (the
    rounds then differ by their cost alone), a 60-node EAGLE-2 tree at AL 6.0 (the EAGLE-3
    paper's Llama-3.1-8B figure, rounded), a DFlash drafter of its authors' shape
    (`dflash_head`: five layers, blocks of 16) drafting 15 tokens at an assumed AL of 5.0
    (published: 3.3 on MT-bench and 5.0-6.4 on gsm8k for Qwen3-8B, 7.0 for Llama-3.1-8B on
    gsm8k), and Llama-3.2-1B drafting a chain of K=4 at an
    assumed AL of 3.0 (about 0.75 of its tokens accepted in turn; with a given `config`,
    the draft model's row needs `draft_model`, named `draft_model_name`); `efficiency`
    scales both peaks (1.0: the pure roofline, an upper bound on speed); `attention` and
    the target's weight `storage` (`STORAGES`) as in the module docstring. "weights" gives
    the target's weight bytes in that storage and whether they fit each device's HBM."""
    devs = [device(d) for d in devices]
    if not 0 < efficiency <= 1:
        raise InputError(f"efficiency must be in (0, 1], got {efficiency!r}")
    if attention not in ATTENTION:
        raise InputError(f"attention must be one of {ATTENTION}, got {attention!r}")
    given_config = config
    config = llama31_8b() if config is None else config
    stored = weight_bytes(config, storage)
    draft = eagle3_head(config) if draft is None else draft
    parallel_draft = dataclasses.replace(draft, mask_token_id=draft.draft_vocab_size - 1)
    parallel_al = chain_al if parallel_al is None else parallel_al
    if draft_model is None and given_config is None:
        draft_model = llama32_1b()
    dflash_draft = dflash_head(config)
    # (label, AL, the drafter's reads of the target's output head, cost at a batch)
    programs = [("plain step", 1.0, 0, lambda b: plain_step_cost(config, b, context)),
                (chain.describe(), chain_al, head_reads(draft, chain),
                 lambda b: spec_round_cost(config, draft, chain, b, context)),
                (parallel.describe(), parallel_al, head_reads(parallel_draft, parallel),
                 lambda b: spec_round_cost(config, parallel_draft, parallel, b, context)),
                (tree.describe(), tree_al, head_reads(draft, tree),
                 lambda b: spec_round_cost(config, draft, tree, b, context)),
                (f"DFlash 5 layers, {dflash.describe()}", dflash_al,
                 head_reads(dflash_draft, dflash),
                 lambda b: spec_round_cost(config, dflash_draft, dflash, b, context))]
    if draft_model is not None:
        programs.append((f"{draft_model_name} {model_chain.describe()}", model_chain_al, 0,
                         lambda b: spec_round_cost(config, draft_model, model_chain, b,
                                                   context)))
    rows = []
    for batch in batches:
        costs = [(label, al, reads, cost(batch)) for label, al, reads, cost in programs]
        for dev in devs:
            plain_rate = None
            for label, al, reads, cost in costs:
                moved = quantized_bytes(cost.moved(attention), config, stored, reads)
                xla_moved = quantized_bytes(cost.xla_attention_bytes, config, stored, reads)
                t = seconds(moved, cost.flops, dev, efficiency)
                rate = tokens_per_second(batch, t, al)
                plain_rate = rate if plain_rate is None else plain_rate
                memory_bound = moved / dev.bandwidth >= cost.flops / dev.peak_flops
                rows.append(dict(device=dev.name, batch=batch, program=label,
                                 gb_accessed=moved / 1e9,
                                 gb_xla_attention=xla_moved / 1e9,
                                 gflops=cost.flops / 1e9, ms=t * 1e3, tokens_per_s=rate,
                                 speedup=rate / plain_rate, accept_length=al,
                                 bound="memory" if memory_bound else "compute"))
    return {
        "model": f"{config.model_type} L={config.num_layers} H={config.hidden_size} "
                 f"V={config.vocab_size}, EAGLE-3 head DV={draft.draft_vocab_size}",
        "assumptions": {"context_tokens": context, "storage": _describe_storage(stored),
                        "weight_storage": storage,
                        "decoding": "greedy", "attention": attention,
                        "chain": chain.describe(), "chain_accept_length": chain_al,
                        "parallel": parallel.describe(), "parallel_accept_length": parallel_al,
                        "tree": tree.describe(), "tree_accept_length": tree_al,
                        "dflash": dflash.describe(), "dflash_accept_length": dflash_al,
                        "draft_model": None if draft_model is None else
                        f"{draft_model_name} {model_chain.describe()}",
                        "draft_model_accept_length": model_chain_al,
                        "efficiency": efficiency},
        "devices": {d.name: dataclasses.asdict(d) for d in devs},
        "weights": {"storage": storage, "gb": stored.total / 1e9,
                    "bits_per_weight": stored.bits_per_weight,
                    "fits": {d.name: stored.total <= d.memory for d in devs}},
        "published": PUBLISHED,
        "rows": rows,
    }


# What `jax.Device.device_kind` says on each device (lower case), to tell a run on the
# device a prediction is for from a run elsewhere.
DEVICE_KINDS = {"h100": ("h100",), "h200": ("h200",), "tpu-v5e": ("v5 lite", "v5e"),
                "tpu-v5p": ("v5p",)}


def runs_on(device_name: str, device_kind: str) -> bool:
    """Whether a device reporting `device_kind` is the `DEVICES` entry `device_name`."""
    kind = device_kind.lower()
    return any(marker in kind for marker in DEVICE_KINDS.get(device(device_name).name, ()))


def platform_of(device_name: str) -> str:
    """The JAX platform of a `DEVICES` entry: "tpu" or "gpu"."""
    return "tpu" if device(device_name).name.startswith("tpu") else "gpu"


def predict(device_name: str, config: ModelConfig, *, batch: int, context: int,
            draft: DraftConfig | ModelConfig | None = None, spec: SpecConfig | None = None,
            accept_length: float = 1.0, attention: str = "fused",
            storage: str | WeightBytes = "bfloat16") -> list[dict[str, Any]]:
    """Roofline rows for one model as it runs: its plain step and, with `draft` and `spec`,
    one round at `accept_length` (e.g. a run's measured AL), at `batch` rows and `context`
    cached tokens (greedy; the target's weights in `storage`, a `STORAGES` name or a loaded
    target's `weight_bytes`; see the module docstring), with the weights' bytes and whether
    they fit the device."""
    dev = device(device_name)
    stored = storage if isinstance(storage, WeightBytes) else weight_bytes(config, storage)
    programs = [("plain step", 1.0, 0, plain_step_cost(config, batch, context))]
    if draft is not None and spec is not None:
        programs.append((spec.describe(), accept_length, head_reads(draft, spec),
                         spec_round_cost(config, draft, spec, batch, context)))
    rows = []
    for label, al, reads, cost in programs:
        moved = quantized_bytes(cost.moved(attention), config, stored, reads)
        t = seconds(moved, cost.flops, dev)
        rows.append(dict(device=dev.name, batch=batch, program=label, accept_length=al,
                         gb_accessed=moved / 1e9, gflops=cost.flops / 1e9, ms=t * 1e3,
                         tokens_per_s=tokens_per_second(batch, t, al),
                         bound="memory" if moved / dev.bandwidth >= cost.flops / dev.peak_flops
                         else "compute", storage=stored.storage,
                         weights_gb=stored.total / 1e9, weights_fit=stored.total <= dev.memory))
    return rows


def format_report(report: dict[str, Any]) -> str:
    """The report as a text table with its assumptions and the published reference."""
    title = (f"{'device':<8} {'batch':>5}  {'program':<32} {'GB':>6} {'GFLOP':>7} {'ms':>6} "
             f"{'tok/s':>7} {'speed-up':>8}  {'bound':<7} {'GB(xla-attn)':>12}")
    lines = [f"Roofline from XLA's cost analysis of the CPU-compiled programs: "
             f"{report['model']}", title, "-" * len(title)]
    for r in report["rows"]:
        lines.append(f"{r['device']:<8} {r['batch']:>5}  {r['program']:<32} "
                     f"{r['gb_accessed']:>6.2f} {r['gflops']:>7.0f} {r['ms']:>6.2f} "
                     f"{r['tokens_per_s']:>7.0f} {r['speedup']:>7.2f}x  {r['bound']:<7} "
                     f"{r['gb_xla_attention']:>12.2f}")
    a = report["assumptions"]
    lines += ["", f"assumptions: {a['context_tokens']} cached tokens; {a['storage']}; "
                  f"{a['decoding']}; {a['attention']} attention; AL {a['chain_accept_length']} "
                  f"for {a['chain']}, AL {a['parallel_accept_length']} for {a['parallel']} "
                  f"(the same head as P-EAGLE), AL {a['tree_accept_length']} for {a['tree']}, "
                  f"AL {a['dflash_accept_length']} for DFlash {a['dflash']}"
                  + (f", AL {a['draft_model_accept_length']} for {a['draft_model']}"
                     if a["draft_model"] else "")
                  + f"; {a['efficiency']:.0%} of peak bandwidth and FLOPs"]
    w = report["weights"]
    lines.append(f"target weights in {w['storage']}: {w['gb']:.2f} GB; "
                 + ", ".join(f"{'fit' if fits else 'do not fit'} the {name}'s "
                             f"{report['devices'][name]['memory'] / 1e9:.0f} GB"
                             for name, fits in w["fits"].items()))
    for d in report["devices"].values():
        lines.append(f"{d['name']}: {d['bandwidth'] / 1e12:.3f} TB/s, "
                     f"{d['peak_flops'] / 1e12:.1f} TFLOP/s bf16 dense, "
                     f"{d['memory'] / 1e9:.0f} GB HBM ({d['source']})")
    p = report["published"]
    if p["device"] in report["devices"]:
        lines.append(f"published ({p['source']}, {p['device']}, batch {p['batch']}): plain "
                     f"{p['plain_tokens_per_s']} tok/s, EAGLE-3 {p['eagle3_tokens_per_s']} "
                     f"tok/s ({p['eagle3_tokens_per_s'] / p['plain_tokens_per_s']:.2f}x)")
    return "\n".join(lines)


def report(devices: str | list[str], as_json: bool = False, **kwargs: Any) -> str:
    """`eaglejax bench --roofline DEVICE`, `eaglejax roofline DEVICE...`: the table (or
    JSON) for the devices (`roofline`'s keyword arguments)."""
    result = roofline([devices] if isinstance(devices, str) else list(devices), **kwargs)
    return json.dumps(result, indent=2) if as_json else format_report(result)
