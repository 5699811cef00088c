"""The compiled decoding loops as programs to inspect without the hardware they target.

`loop_programs` pairs the compiled loop programs (`decoding.loops.prefill` and
`decode_loop`, for the plain loop and speculative ones) with ABSTRACT arguments: weights
are `jax.ShapeDtypeStruct`s carrying their mesh shardings (`TargetPlacement`), never
materialised, so an 8B model costs nothing but tracing. `export_programs` serialises them
with `jax.export` for "cuda" or "tpu" (the Pallas kernels inside as Triton / Mosaic custom
calls, from a CPU host);
`compile_programs` compiles them for this host's devices, whose partitioned HLO shows the
collectives the sharding design implies (`count_collectives`, `layer_collectives`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eaglejax import native
from eaglejax.config import ModelConfig
from eaglejax.decoding import loops
from eaglejax.decoding.batch import cache_capacity
from eaglejax.decoding.loops import PlainLoop, SpecLoop, Weights
from eaglejax.decoding.prefill import PREFILL_CHUNK
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.draft import head
from eaglejax.draft.config import DraftConfig
from eaglejax.models import kv_cache
from eaglejax.models import gguf_blocks, quantized
from eaglejax.models.llama import ParamInfo, is_param_info, is_vocabulary, param_info
from eaglejax.models.placement import TargetPlacement
from eaglejax.programs import hlo
from eaglejax.programs.reference import eagle3_head
from eaglejax.sharding.rules import logical_spec

# the Pallas kernels' custom calls, which carry no cross-version compatibility guarantee
KERNEL_CALLS = tuple(jax.export.DisabledSafetyCheck.custom_call(target)
                     for target in ("__gpu$xla.gpu.triton", "tpu_custom_call"))
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
               "collective-permute")


def _abstract(shape: Sequence[int], dtype: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


QUANTIZED = ("int8", *gguf_blocks.INT4_KINDS)  # the weight_dtype names exported quantized


def _quantized(weight_dtype: str, info: ParamInfo) -> quantized.QuantizedMatrix:
    """The matrix `info` stored as `weight_dtype` (one of `QUANTIZED`, as
    `models.llama.store_matrix` stores it: 4-bit storage keeps vocabulary matrices in
    `gguf_blocks.VOCABULARY_KIND`) in shape structs, flat, as a loaded model holds it."""
    if weight_dtype == "int8":
        stored = quantized.Int8Matrix.abstract(info.shape)
    else:
        kind = gguf_blocks.VOCABULARY_KIND if is_vocabulary(info) \
            else gguf_blocks.INT4_KINDS[weight_dtype]
        stored = gguf_blocks.BlockMatrix.abstract(info.shape, kind)
    return jax.eval_shape(lambda m: m.restored(), stored)


def abstract_params(config: ModelConfig, mesh: Mesh, dtype: Any = jnp.bfloat16,
                    weight_dtype: str | None = None) -> tuple[ModelConfig, Any]:
    """The target as placed on `mesh` (KV heads widened where tp exceeds them) and its
    parameters as shape structs in their shardings (`TargetPlacement`). `weight_dtype`
    "int8", "int4" or "int4-sym" stores the matrices that tile as `Target.with_weight_dtype`
    does (`models.quantized`, `models.gguf_blocks` Q4_1 / Q4_0 blocks), split as
    `TargetPlacement.place_quantized` splits them."""
    placement = TargetPlacement.plan(config, mesh)
    if weight_dtype not in (None, *QUANTIZED):
        raise ValueError(f"weight_dtype must be None or one of {QUANTIZED}, got {weight_dtype!r}")

    def leaf(path, info):
        keys = tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path)
        if weight_dtype and info.matrix and quantized.tiles(info.shape):
            split = jax.eval_shape(lambda m: m.split(), _quantized(weight_dtype, info))
            arrays = split.tree_flatten()[0]
            where = placement.quantized_shardings(keys, split)
            return split.rebuilt([_abstract(a.shape, a.dtype, s) for a, s in zip(arrays, where)],
                                 split.shape)
        return _abstract(info.shape, dtype, placement.sharding(keys, info.shape))

    infos = param_info(placement.config)
    return placement.config, jax.tree_util.tree_map_with_path(leaf, infos, is_leaf=is_param_info)


def abstract_draft(draft_config: DraftConfig, mesh: Mesh, dtype: Any = jnp.bfloat16,
                   weight_dtype: Any = None) -> tuple[Any, jax.ShapeDtypeStruct]:
    """A draft head's parameters and d2t table as shape structs, replicated on `mesh` (as
    `Draft.for_target` places a head). `weight_dtype` stores its matrices as
    `Draft.with_weight_dtype` does: one of `QUANTIZED` those that tile (flat storage), a float
    dtype all of them; None: in `dtype`. Norms and other vectors keep `dtype`."""
    everywhere = NamedSharding(mesh, PartitionSpec())
    stored = weight_dtype if weight_dtype is None or isinstance(weight_dtype, str) \
        and weight_dtype in QUANTIZED else jnp.dtype(weight_dtype).name

    def leaf(info):
        if not info.matrix:
            return _abstract(info.shape, dtype, everywhere)
        if stored in QUANTIZED:
            if not quantized.tiles(info.shape):
                return _abstract(info.shape, dtype, everywhere)
            return jax.tree.map(lambda a: _abstract(a.shape, a.dtype, everywhere),
                                _quantized(stored, info))
        return _abstract(info.shape, stored or dtype, everywhere)

    params = jax.tree.map(leaf, head.param_info(draft_config), is_leaf=is_param_info)
    return params, _abstract((draft_config.draft_vocab_size,), jnp.int32, everywhere)


@dataclasses.dataclass(frozen=True)
class LoopShapes:
    """The static batch shape the loops compile for (`generate` buckets to these)."""

    batch: int = 1
    prompt_len: int = 128
    max_new_tokens: int = 128

    def capacity(self, scratch_rows: int) -> int:
        """Cache rows for a loop that needs `scratch_rows` beyond the tokens."""
        return cache_capacity(self.prompt_len, self.max_new_tokens, scratch_rows)


@dataclasses.dataclass(frozen=True)
class Program:
    """One jitted loop and the abstract arguments to trace it with. `tokens` is how many
    positions one target forward of the loop runs per row (its all-reduce payload)."""

    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    mesh: Mesh
    tokens: int

    def trace(self) -> jax.stages.Traced:
        with self.context():
            return self.fn.trace(*self.args, **self.kwargs)

    def out_shapes(self) -> Any:
        """The program's outputs as shape structs (no sharding)."""
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                            self.trace().out_info)

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """Traced over the mesh, with XLA's ops in place of the native CPU kernels."""
        with jax.set_mesh(self.mesh), native.xla_only():
            yield


def _replicated(tree: Any, mesh: Mesh) -> Any:
    everywhere = NamedSharding(mesh, PartitionSpec())
    return jax.tree.map(lambda x: _abstract(x.shape, x.dtype, everywhere), tree)


def _on_mesh(state: Any, mesh: Mesh) -> Any:
    """Shape structs of a loop state in the shardings the prefill leaves it in: KV caches
    (target: rows on dp, KV heads on tp; a drafter's: rows on dp) and every other leaf's rows
    on dp, scalars replicated."""
    def cache(c: kv_cache.KVCache, heads: str | None) -> kv_cache.KVCache:
        axes = ("batch", heads, "cache_seq", "head_dim")
        place = lambda x: _abstract(
            x.shape, x.dtype, NamedSharding(mesh, logical_spec(axes, x.shape, mesh)))
        return kv_cache.KVCache(tuple(map(place, c.k)), tuple(map(place, c.v)),
                                rows(c.lengths))

    def rows(x: Any) -> jax.ShapeDtypeStruct:
        axes = ("batch",) + (None,) * (len(x.shape) - 1) if x.shape else ()
        spec = logical_spec(axes, x.shape, mesh)
        return _abstract(x.shape, x.dtype, NamedSharding(mesh, spec))

    is_cache = lambda x: isinstance(x, kv_cache.KVCache)  # noqa: E731
    placed = jax.tree.map(lambda x: cache(x, None) if is_cache(x) else rows(x), state,
                          is_leaf=is_cache)
    return placed._replace(target_cache=cache(state.target_cache, "kv_heads"))


def loop_programs(config: ModelConfig, mesh: Mesh, shapes: LoopShapes = LoopShapes(), *,
                  specs: dict[str, SpecConfig] | None = None,
                  draft_config: DraftConfig | None = None, attn_impl: str = "pallas",
                  dtype: Any = jnp.bfloat16, greedy: bool = True,
                  weight_dtype: str | None = None,
                  draft_weight_dtype: Any = None) -> list[Program]:
    """The plain loop (prefill, decode_loop) and, for each named SpecConfig in `specs`, the
    speculative loop (spec_prefill, spec_loop with an EAGLE-3 head) of `config` placed on
    `mesh`, as abstract programs. Default specs: chain K=5 and a dynamic tree (8, 6, 60).
    `weight_dtype`: the target's matrices quantized (`abstract_params`);
    `draft_weight_dtype`: how the head stores its matrices (`abstract_draft`), by default as
    the target does (as `load_draft` stores a head; `dtype` keeps it wide)."""
    if specs is None:
        specs = {"chain5": SpecConfig.chain(5), "tree60": SpecConfig.tree(8, 6, 60)}
    placed, params = abstract_params(config, mesh, dtype, weight_dtype)
    b = shapes.batch
    inputs = _replicated((jax.ShapeDtypeStruct((b, shapes.prompt_len), jnp.int32),
                          jax.ShapeDtypeStruct((b,), jnp.int32),
                          jax.eval_shape(jax.vmap(jax.random.PRNGKey),
                                         jax.ShapeDtypeStruct((b,), jnp.uint32)),
                          jax.eval_shape(SamplingParams.make),
                          jax.ShapeDtypeStruct((), jnp.int32)), mesh)
    prompt, lengths, keys, sampling, max_new = inputs
    max_tokens = -(-shapes.max_new_tokens // 16) * 16
    common = dict(greedy=greedy, stop=StopCriteria())
    programs = []

    def add_loop(names, loop, weights):
        """The loop's prefill and decode_loop, the latter on the state the former leaves."""
        prefill = Program(names[0], loops.prefill,
                          (loop, weights, prompt, lengths, keys, sampling, max_new),
                          dict(capacity=shapes.capacity(loop.scratch_rows),
                               max_tokens=max_tokens, **common),
                          mesh, min(shapes.prompt_len, PREFILL_CHUNK))
        state = _on_mesh(prefill.out_shapes(), mesh)
        programs.extend([prefill, Program(names[1], loops.decode_loop,
                                          (loop, weights, state, sampling, max_new), common,
                                          mesh, loop.scratch_rows or 1)])

    add_loop(("prefill", "decode"), PlainLoop(placed, attn_impl), Weights(params))
    if not specs:
        return programs
    draft_config = draft_config or eagle3_head(config)
    draft_params, d2t = abstract_draft(draft_config, mesh, dtype,
                                       draft_weight_dtype or weight_dtype)
    for spec_name, spec in specs.items():
        add_loop((f"spec_prefill[{spec_name}]", f"spec_loop[{spec_name}]"),
                 SpecLoop(placed, draft_config, spec, attn_impl),
                 Weights(params, draft_params, d2t))
    return programs


def export_programs(programs: Sequence[Program],
                    platforms: Sequence[str] = ("cuda", "tpu")) -> dict[tuple[str, str], Any]:
    """`jax.export.Exported` of every program for each platform, keyed (name, platform)."""
    exported = {}
    for program in programs:
        for platform in platforms:
            with program.context():
                exported[program.name, platform] = jax.export.export(
                    program.fn, platforms=(platform,), disabled_checks=KERNEL_CALLS)(
                        *program.args, **program.kwargs)
    return exported


def compile_programs(programs: Sequence[Program]) -> dict[str, jax.stages.Compiled]:
    """Every program compiled for this host's devices (the mesh's), keyed by name."""
    compiled = {}
    for program in programs:
        with program.context():
            compiled[program.name] = program.fn.lower(*program.args,
                                                      **program.kwargs).compile()
    return compiled


def count_collectives(hlo_text: str) -> dict[str, int]:
    """How many of each collective op the (partitioned) HLO text holds; an async pair
    (`all-reduce-start` / `-done`) counts once."""
    counts = dict.fromkeys(COLLECTIVES, 0)
    for op in hlo.op_names(hlo_text):
        op = op.removesuffix("-start")
        if op in counts:
            counts[op] += 1
    return counts


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """`count_collectives` of a compiled program, split into "call" (ENTRY: once per call)
    and "step" (inside loops: once per decode step or speculation round)."""
    entry, nested = hlo.split_entry(hlo_text)
    return {"call": count_collectives(entry), "step": count_collectives(nested)}


def layer_collectives(config: ModelConfig, mesh: Mesh, shapes: LoopShapes = LoopShapes(),
                      depths: tuple[int, int] = (1, 2), names: Sequence[str] | None = None,
                      **kwargs: Any) -> dict[str, dict]:
    """Per program (`loop_programs(..., **kwargs)` compiled for this host's devices; only
    `names` if given): the `collectives` each decoder layer adds ("per_layer", from the
    programs at `depths[0]` and `depths[1]` layers) and those of no layer ("fixed": the
    embedding, logits and draft head), both split into "call" and "step". Attention is
    XLA's unless asked (the Pallas interpreter would bury the kernel in loops); the draft
    head keeps the same taps at both depths."""
    kwargs.setdefault("attn_impl", "xla")
    shallow, deep = (dataclasses.replace(config, num_layers=d) for d in depths)
    kwargs.setdefault("draft_config", eagle3_head(shallow))
    counts = []
    for model in (shallow, deep):
        programs = [p for p in loop_programs(model, mesh, shapes, **kwargs)
                    if names is None or p.name in names]
        compiled = compile_programs(programs)
        counts.append({name: collectives(c.as_text()) for name, c in compiled.items()})
    result = {}
    for name, base in counts[0].items():
        more = counts[1][name]
        per_layer = {where: {op: (more[where][op] - base[where][op]) // (depths[1] - depths[0])
                             for op in COLLECTIVES} for where in base}
        fixed = {where: {op: base[where][op] - depths[0] * per_layer[where][op]
                         for op in COLLECTIVES} for where in base}
        result[name] = {"per_layer": per_layer, "fixed": fixed}
    return result


def allreduce_bytes(batch: int, tokens: int, hidden: int, itemsize: int = 2) -> int:
    """Bytes of one residual-stream all-reduce: B x T x hidden x itemsize."""
    return batch * tokens * hidden * itemsize


def ring_allreduce_seconds(nbytes: int, devices: int, bandwidth: float = 450e9,
                           latency: float = 0.0) -> float:
    """A ring all-reduce's time: each device sends and receives 2 (n-1)/n of the payload at
    `bandwidth` bytes/s per direction, plus a fixed `latency` per call."""
    if devices <= 1:
        return 0.0
    return 2 * (devices - 1) / devices * nbytes / bandwidth + latency
