"""The Llama-family decoder (Llama 2/3, Mistral, SmolLM2, Qwen2, Qwen3) as pure functions.

Parameters are a plain dict pytree with one dict per layer; `param_info(config)` gives
the same tree of `ParamInfo` (shape, logical axes for sharding, initialiser, dtype role).
One `forward` serves prefill, single-token decode and tree verification: it takes any
number of new tokens per row with explicit positions and an optional mask among them,
attends over the cache's valid prefix, and returns the new K/V rows without writing
them (the caller commits what it accepts). `forward_chunked` runs a long prompt through
`forward` a block at a time, so attention memory stays bounded by the block size.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from eaglejax.config import ModelConfig
from eaglejax.models.attention import AttentionImpl, attention, resolve_impl
from eaglejax.models.kv_cache import KVCache, stage as stage_rows
from eaglejax.models.rope import apply_rope, inverse_frequencies, rope_tables
from eaglejax import native
from eaglejax.models import gguf_blocks, quantized
from eaglejax.models.gguf_blocks import BlockMatrix, PartsMatrix
from eaglejax.models.quantized import Int8Matrix, QuantizedMatrix
from eaglejax.native import cache_attention, embedding_rows as embedding_rows_kernel, few_row_matmul
from eaglejax.native import block_matmul, int8_matmul
from eaglejax.sharding.rules import over_mesh

Params = dict[str, Any]


class ForwardOutput(NamedTuple):
    """hidden: final-normed [B,T,H]; k_new/v_new: per layer [B,T,kv,D]; taps: [B,T,n*H] or None.

    cache: the input cache with the new rows staged after each row's valid prefix (lengths
    unchanged: the caller commits what it accepts); None when no cache was given.
    """

    hidden: jax.Array
    k_new: tuple[jax.Array, ...]
    v_new: tuple[jax.Array, ...]
    taps: jax.Array | None
    cache: KVCache | None


class ParamInfo(NamedTuple):
    """The abstract description of one parameter.

    axes: its logical axis names (`eaglejax.sharding.rules` maps them to mesh axes);
    init: "normal" (normal * scale) or "ones"; matrix: True for the matrices, stored in the
    weight dtype (which may be 16-bit under float32 compute), False for the vectors (norms,
    biases), kept in the compute dtype.
    """

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str = "normal"
    matrix: bool = True


def is_param_info(x: Any) -> bool:
    """Whether x is a `ParamInfo` (the `is_leaf` of trees of them: a NamedTuple is a node)."""
    return isinstance(x, ParamInfo)


def param_info(config: ModelConfig) -> Params:
    """Every parameter's `ParamInfo`, in the same tree structure as the params.

    Projections are `[out..., in]` like PyTorch's (contracting the last, contiguous dim is
    the fastest matrix-vector product on CPUs). Queries, keys and values share one matrix
    grouped by KV head: `wqkv[j]` holds the `kv_group` query heads that read KV head j,
    then its key, then its value, so sharding over "kv_heads" keeps every group on one
    device. `wo`'s "heads" dim is heads * head_dim wide. Gate and up share `w_gate_up`.
    """
    c = config
    sizes = {"embed": c.hidden_size, "norm": c.hidden_size, "heads": c.num_heads * c.head_dim,
             "kv_heads": c.num_kv_heads, "qkv": c.kv_group + 2, "head_dim": c.head_dim,
             "gate_up": 2, "mlp": c.intermediate_size, "vocab": c.vocab_size}

    def info(*axes: str, init: str = "normal", matrix: bool = True) -> ParamInfo:
        return ParamInfo(tuple(sizes[a] for a in axes), axes, init, matrix)

    norm = info("norm", init="ones", matrix=False)
    layer = {"attn_norm": norm, "mlp_norm": norm,
             "wqkv": info("kv_heads", "qkv", "head_dim", "embed"), "wo": info("embed", "heads"),
             "w_gate_up": info("gate_up", "mlp", "embed"), "w_down": info("embed", "mlp")}
    if c.attention_bias:
        layer["bqkv"] = info("kv_heads", "qkv", "head_dim", matrix=False)
    if c.qk_norm:
        layer["q_norm"] = layer["k_norm"] = info("head_dim", init="ones", matrix=False)
    infos: Params = {"embed": info("vocab", "embed"),
                     "layers": [dict(layer) for _ in range(c.num_layers)], "final_norm": norm}
    if not c.tie_word_embeddings:
        infos["lm_head"] = info("vocab", "embed")
    return infos


def logical_axes(config: ModelConfig) -> Params:
    """Logical axis names of every parameter, in the same tree structure as the params."""
    return jax.tree.map(lambda i: i.axes, param_info(config), is_leaf=is_param_info)


def param_shapes(config: ModelConfig) -> Params:
    """The shape of every parameter (the contract loaders and converters check against)."""
    return jax.tree.map(lambda i: i.shape, param_info(config), is_leaf=is_param_info)


def random_params(infos: Params, key: jax.Array, dtype: jnp.dtype, scale: float) -> Params:
    """Arrays in `dtype` for a tree of `ParamInfo`, each by its `init`."""
    flat, treedef = jax.tree.flatten(infos, is_leaf=is_param_info)
    keys = jax.random.split(key, len(flat))
    arrays = [
        jnp.ones(i.shape, dtype) if i.init == "ones"
        else (scale * jax.random.normal(k, i.shape)).astype(dtype)
        for k, i in zip(keys, flat)
    ]
    return jax.tree.unflatten(treedef, arrays)


def init_params(config: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.float32,
                scale: float = 0.02) -> Params:
    """Random parameters (normal * scale; norms at 1) for tests and experiments."""
    return random_params(param_info(config), key, dtype, scale)


def four_bit_kind(dtype: Any) -> str | None:
    """The block kind 4-bit storage `dtype` keeps layer matrices in (int4: Q4_1, "int4-sym":
    Q4_0: `gguf_blocks.INT4_KINDS`); None for any other storage."""
    if isinstance(dtype, str):
        return gguf_blocks.INT4_KINDS.get(dtype)
    return gguf_blocks.INT4_KINDS["int4"] if jnp.dtype(dtype) == jnp.int4 else None


def store_matrix(leaf: Any, dtype: Any, host: bool = False, vocabulary: bool = False) -> Any:
    """One matrix stored in `dtype` (`WeightStorage`): int8 `quantized.quantize`, int4 and
    "int4-sym" `gguf_blocks.quantize` (`four_bit_kind`; a `vocabulary` matrix, the embedding
    or an output head, in `gguf_blocks.VOCABULARY_KIND`) where its shape tiles (`host`: their
    arrays kept on the host), else as it is; a float dtype cast."""
    kind = four_bit_kind(dtype)
    if kind is not None:
        kind = gguf_blocks.VOCABULARY_KIND if vocabulary else kind
        return gguf_blocks.quantize(leaf, kind, host) if gguf_blocks.tiles(leaf.shape) else leaf
    if jnp.dtype(dtype) == jnp.int8:
        return quantized.quantize(leaf, host) if quantized.tiles(leaf.shape) else leaf
    return leaf.astype(dtype)


def is_vocabulary(info: ParamInfo) -> bool:
    """Whether `info` is a matrix over a vocabulary (embedding, output head, a draft head's
    output over its draft vocabulary), which 4-bit storage keeps in 8 bits."""
    return info.matrix and any(axis in ("vocab", "draft_vocab") for axis in info.axes)


def is_quantizing(dtype: Any) -> bool:
    """Whether storing a matrix in `dtype` quantizes it (int8, int4, "int4-sym")."""
    return four_bit_kind(dtype) is not None or jnp.dtype(dtype) == jnp.int8


def store_matrices(infos: Params, params: Params, dtype: Any,
                   place: Callable[[tuple, Any], Any] | None = None) -> Params:
    """`params` with every matrix (per its `ParamInfo` in `infos`) stored in `dtype`
    (`store_matrix`); norms and other vectors as they are. `place(path, matrix)` puts each
    quantized matrix, quantized on the host, where it belongs (a mesh:
    `placement.TargetPlacement.place`) as soon as it is made."""
    def store(path: Any, info: ParamInfo, leaf: jax.Array) -> Any:
        if not info.matrix:
            return leaf
        stored = store_matrix(leaf, dtype, host=place is not None,
                              vocabulary=is_vocabulary(info))
        if place is None or not isinstance(stored, QuantizedMatrix):
            return stored
        return place(tuple(getattr(k, "key", getattr(k, "idx", None)) for k in path), stored)

    return jax.tree_util.tree_map_with_path(store, infos, params, is_leaf=is_param_info)


def compute_dtype(params: Params) -> jnp.dtype:
    """The dtype of activations and the KV cache: the final norm's. Matrices may be stored
    in 16 bits under float32 compute (`linear`)."""
    return params["final_norm"].dtype


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, returned in x's dtype."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def embedding_rows(table: jax.Array, tokens: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows of an embedding `table` [V, H] for `tokens`, in `dtype`; a bfloat16 table under
    float32 compute on CPU reads only those rows (`native.embedding_rows`: XLA:CPU would
    widen the whole table once per program call); an int8 or GGUF block table dequantizes
    only those rows."""
    if isinstance(table, QuantizedMatrix):
        return table.rows(tokens).astype(dtype)
    if embedding_rows_kernel.applies(table, dtype):
        return embedding_rows_kernel.rows(table, tokens)
    return table[tokens].astype(dtype)


def causal_mask(batch: int, t_new: int) -> jax.Array:
    """[B,T,T] lower-triangular mask among new tokens."""
    tri = jnp.tril(jnp.ones((t_new, t_new), dtype=bool))
    return jnp.broadcast_to(tri, (batch, t_new, t_new))


def linear(x: jax.Array, weight: jax.Array, *, norm: jax.Array | None = None,
           eps: float = 0.0, gated: bool = False,
           residual: jax.Array | None = None) -> jax.Array:
    """x [..., in] times a PyTorch-layout weight [out, in], optionally with the operations a
    decoder layer does around it: `norm` (a scale [in]) RMS-norms x first (`rms_norm` with
    `eps`); `gated` takes x = [gate | up] [..., 2 in] and multiplies silu(gate) * up;
    `residual` [..., out] is added to the product.

    The weight stays 2-D and is the matmul's left operand: XLA:CPU then reads it in place
    (a higher-rank weight gets a transposed copy every call) and multiplies a few rows
    (verification blocks) markedly faster than with the weight on the right.
    A 16-bit weight under float32 activations is stored-only: see `split_precision_linear`;
    an int8 weight (`models.quantized`) or a GGUF file's blocks kept as stored
    (`models.gguf_blocks`) multiply x quantized to int8 in blocks of 32; a fused matrix
    kept in parts of different block kinds (`gguf_blocks.PartsMatrix`) multiplies each.
    A few rows of float32 x on CPU go to the native kernels (`eaglejax.native.few_row_matmul`
    for float32 or bfloat16 weights, `native.int8_matmul` for int8, `native.block_matmul` for
    GGUF blocks), the surrounding operations with them.
    """
    if isinstance(weight, PartsMatrix):  # each part its own product, side by side
        y = weight.joined([linear(x, part.reshape(-1, part.shape[-1]), norm=norm, eps=eps,
                                  gated=gated) for part in weight.parts])
        return y if residual is None else residual + y
    if isinstance(weight, QuantizedMatrix):
        weight = weight.flat()  # as the products read it (a mesh may keep it split)
    if isinstance(weight, Int8Matrix):
        product = quantized.product
    elif isinstance(weight, BlockMatrix):
        product = gguf_blocks.product
    elif x.dtype == jnp.float32 and weight.dtype in (jnp.bfloat16, jnp.float16):
        product = split_precision_linear
    else:
        product = _dot

    def reference(rows: jax.Array, weight: jax.Array, norm: jax.Array | None,
                  residual: jax.Array | None) -> jax.Array:
        if norm is not None:
            rows = rms_norm(rows, norm, eps)
        if gated:
            gate, up = jnp.split(rows, 2, axis=-1)
            rows = jax.nn.silu(gate) * up
        y = product(rows, weight)
        return y if residual is None else residual + y

    if isinstance(weight, Int8Matrix):
        if int8_matmul.applies(x):
            def stored(rows, packed, scales, norm, residual):
                return reference(rows, Int8Matrix(packed, scales, weight.shape), norm, residual)

            return int8_matmul.linear(x, weight.packed, weight.scales, stored, norm=norm,
                                      eps=eps, gated=gated, residual=residual)
        return reference(x, weight, norm, residual)
    if isinstance(weight, BlockMatrix):
        if block_matmul.applies(x):
            def kept(rows, packed, scales, mins, supers, norm, residual):
                return reference(rows, BlockMatrix(packed, scales, mins, supers, weight.shape,
                                                   weight.kind), norm, residual)

            flat, kind = weight.flat(), weight.block_kind
            return block_matmul.linear(x, flat.packed, flat.scales, flat.mins, flat.supers,
                                       kept, offset=kind.offset, bits=kind.bits, norm=norm,
                                       eps=eps, gated=gated, residual=residual)
        return reference(x, weight, norm, residual)
    if few_row_matmul.applies(x, weight):
        return few_row_matmul.linear(x, weight, reference, norm=norm, eps=eps, gated=gated,
                                     residual=residual)
    return reference(x, weight, norm, residual)


def _dot(x: jax.Array, weight: jax.Array) -> jax.Array:
    return jnp.einsum("oi,...i->...o", weight, x)


def split_precision_linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """Float32 x [..., in] times a 16-bit weight [out, in], never widening the weight.

    x is split into a 16-bit head and the 16-bit rounding of its remainder (x ~= hi + lo
    to about 2^-16 relative, against float32's 2^-24); both multiply the 16-bit weight in
    one product with float32 accumulation, and the two halves of the result are summed.
    The weight is read once at half the bytes of float32, and no float32 copy of it is
    made (widening the weight first costs more than it saves on XLA:CPU).
    """
    rows = x.reshape(-1, x.shape[-1])
    hi = rows.astype(weight.dtype)
    lo = (rows - hi.astype(jnp.float32)).astype(weight.dtype)
    both = jnp.einsum("oi,ri->ro", weight, jnp.concatenate([hi, lo]),
                      preferred_element_type=jnp.float32)
    n = rows.shape[0]
    return (both[:n] + both[n:]).reshape(*x.shape[:-1], weight.shape[0])


def qkv_block(config: ModelConfig, h: jax.Array, layer: Params,
              attn_input: jax.Array | None = None) -> jax.Array:
    """A layer's projection of residual h [B,T,H] (RMS-normed first) to its queries, keys and
    values, [B,T,Hkv,G+2,D] as `wqkv` groups them, bias added, before any rotation.
    `attn_input` replaces `attn_norm(h)` (EAGLE heads feed their first layer something
    else; its width may differ from H)."""
    batch, t_new, _ = h.shape
    wqkv = layer["wqkv"]
    matrix = wqkv.reshape(-1, wqkv.shape[-1])
    if attn_input is None:
        qkv = linear(h, matrix, norm=layer["attn_norm"], eps=config.rms_norm_eps)
    else:
        qkv = linear(attn_input, matrix)
    qkv = qkv.reshape(batch, t_new, *wqkv.shape[:-1])
    return qkv + layer["bqkv"] if config.attention_bias else qkv


def rotated_heads(config: ModelConfig, rope: tuple[jax.Array, jax.Array], qkv: jax.Array,
                  layer: Params) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B,T,Hq,D], k and v [B,T,Hkv,D] from a `qkv_block`, normed (if the model does) and
    rotated."""
    c = config
    batch, t_new = qkv.shape[:2]
    q = qkv[:, :, :, :-2].reshape(batch, t_new, c.num_heads, c.head_dim)
    k, v = qkv[:, :, :, -2], qkv[:, :, :, -1]
    if c.qk_norm:
        q, k = (rms_norm(q, layer["q_norm"], c.rms_norm_eps),
                rms_norm(k, layer["k_norm"], c.rms_norm_eps))
    return apply_rope(q, *rope), apply_rope(k, *rope), v


def qkv_projection(config: ModelConfig, rope: tuple[jax.Array, jax.Array], h: jax.Array,
                   layer: Params, attn_input: jax.Array | None = None):
    """A layer's attention inputs from residual h [B,T,H]: q [B,T,Hq,D], k and v
    [B,T,Hkv,D], normed (if the model does) and rotated (`qkv_block`, `rotated_heads`)."""
    return rotated_heads(config, rope, qkv_block(config, h, layer, attn_input), layer)


def attention_output_and_mlp(config: ModelConfig, h: jax.Array, layer: Params,
                             attn: jax.Array) -> jax.Array:
    """The rest of a layer: h + wo(attn), then the gated MLP's residual update."""
    batch, t_new, _ = h.shape
    eps = config.rms_norm_eps
    h = linear(attn.reshape(batch, t_new, -1), layer["wo"], residual=h)
    w_gate_up = layer["w_gate_up"]
    if over_mesh():  # two products: merging [2, I, H] to [2I, H] would reshard the split I
        x = rms_norm(h, layer["mlp_norm"], eps)
        gate, up = linear(x, w_gate_up[0]), linear(x, w_gate_up[1])
        return h + linear(jax.nn.silu(gate) * up, layer["w_down"])
    gate_up = linear(h, w_gate_up.reshape(-1, config.hidden_size), norm=layer["mlp_norm"],
                     eps=eps)
    return linear(gate_up, layer["w_down"], gated=True, residual=h)


def decoder_layer(config: ModelConfig, rope: tuple[jax.Array, jax.Array], h: jax.Array,
                  layer: Params, k_cache: jax.Array, v_cache: jax.Array,
                  cache_lengths: jax.Array, mask: jax.Array, impl: AttentionImpl,
                  attn_input: jax.Array | None = None, stage: bool = True,
                  tables: jax.Array | None = None, cache_mask: jax.Array | None = None):
    """One pre-norm decoder layer over residual h [B,T,H]; returns (h, k, v, k_buf, v_buf).
    `attn_input`: see `qkv_block`. On CPU, a few new tokens over a cache take the attention
    step (rotation, staging, attention) in one native call. `stage=False` leaves the cache
    as it is (k_buf, v_buf are the caches given): for a caller that drops the staged cache,
    which would otherwise cost XLA a copy of the cache for each call that writes it. With
    block `tables`, k/v_cache are a paged cache's pools (`kv_cache.KVCache`). `cache_mask`
    [B,T,S]: cache keys each query may see besides the lengths (`attention`)."""
    qkv = qkv_block(config, h, layer, attn_input)

    def attention_step(qkv, cos, sin, k_cache, v_cache, cache_lengths, mask, tables=None):
        q, k, v = rotated_heads(config, (cos[:, :, None], sin[:, :, None]), qkv, layer)
        staged = stage and k_cache.shape[2] > 0
        if staged:
            # Stage the new rows first so the attention reads the updated buffer: XLA then
            # updates the cache in place instead of copying it (and a paged kernel reads
            # the new rows from the pools).
            k_cache = stage_rows(k_cache, k, cache_lengths, tables)
            v_cache = stage_rows(v_cache, v, cache_lengths, tables)
        attn = attention(q, k_cache, v_cache, cache_lengths, k, v, mask, impl=impl,
                         tables=tables, staged=staged, cache_mask=cache_mask)
        return attn, k_cache, v_cache, k, v

    def paged_step(qkv, cos, sin, k_pool, v_pool, cache_lengths, tables, mask):
        return attention_step(qkv, cos, sin, k_pool, v_pool, cache_lengths, mask, tables)

    args = (qkv, rope[0][:, :, 0], rope[1][:, :, 0], k_cache, v_cache, cache_lengths)
    if not (stage and not config.qk_norm and resolve_impl(impl) != "pallas"
            and cache_mask is None and cache_attention.rope_applies(qkv, k_cache)):
        attn, k_cache, v_cache, k, v = attention_step(*args, mask, tables)
    elif tables is None:
        attn, k_cache, v_cache, k, v = cache_attention.rope_attention(
            *args, mask, reference=attention_step)
    else:
        attn, k_cache, v_cache, k, v = cache_attention.paged_rope_attention(
            *args, tables, mask, reference=paged_step)
    return attention_output_and_mlp(config, h, layer, attn), k, v, k_cache, v_cache


@functools.partial(jax.jit, static_argnames=("config", "impl", "kernels", "stage"))
def decoder_layer_call(config: ModelConfig, rope: tuple[jax.Array, jax.Array], h: jax.Array,
                       layer: Params, k_cache: jax.Array, v_cache: jax.Array,
                       cache_lengths: jax.Array, mask: jax.Array, impl: AttentionImpl,
                       kernels: bool, stage: bool = True, tables: jax.Array | None = None,
                       cache_mask: jax.Array | None = None):
    """`decoder_layer` as a nested program: a model's layers share one shape, so a forward
    traces one layer and calls it per layer (30x less tracing for SmolLM2; XLA inlines the
    calls, so the program runs as the unrolled one). `kernels` (`native.kernels_allowed()`)
    keys the trace, so a trace with the native kernels never serves one without; code that
    swaps a function or constant the layer reads calls `decoder_layer_call.clear_cache()`."""
    del kernels
    return decoder_layer(config, rope, h, layer, k_cache, v_cache, cache_lengths, mask, impl,
                         stage=stage, tables=tables, cache_mask=cache_mask)


def rope_for(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The RoPE cos/sin tables of `config` at positions [B,T]."""
    return rope_tables(positions, inverse_frequencies(config.head_dim, config.rope_theta,
                                                      config.rope_scaling))


def empty_cache(config: ModelConfig, batch: int, dtype: jnp.dtype) -> KVCache:
    """A zero-capacity cache: attention over the new tokens only (prefill)."""
    empty = jnp.zeros((batch, config.num_kv_heads, 0, config.head_dim), dtype)
    return KVCache((empty,) * config.num_layers, (empty,) * config.num_layers,
                   jnp.zeros((batch,), jnp.int32))


def forward(params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array,
            cache: KVCache | None = None, *, mask: jax.Array | None = None,
            tap_layers: tuple[int, ...] = (), attn_impl: AttentionImpl = "auto",
            stage: bool = True) -> ForwardOutput:
    """Run new tokens [B,T] at positions [B,T] over the cache's valid prefix.

    mask [B,T,T] says which new tokens each new token sees (default causal). With
    `tap_layers`, also returns the residual streams entering those layers, concatenated
    in the given order ([B,T,len*H]); layer id L means the final un-normed output.
    With none asked, no tap is computed. Layers are unrolled (not scanned) so that no
    weight is ever copied out of a stacked array. The new K/V rows are staged in the cache
    after each row's valid prefix; `stage=False` only reads it (`decoder_layer`).
    """
    batch, t_new = tokens.shape
    if mask is None:
        mask = causal_mask(batch, t_new)
    given = cache
    if cache is None:
        cache = empty_cache(config, batch, compute_dtype(params))
    rope = rope_for(config, positions)
    h = embedding_rows(params["embed"], tokens, compute_dtype(params))
    streams, k_new, v_new, k_bufs, v_bufs = [], [], [], [], []
    for layer, k_cache, v_cache in zip(params["layers"], cache.k, cache.v):
        streams.append(h)
        h, k, v, k_buf, v_buf = decoder_layer_call(config, rope, h, layer, k_cache, v_cache,
                                                  cache.lengths, mask, attn_impl,
                                                  native.kernels_allowed(), stage, cache.tables)
        for out, x in ((k_new, k), (v_new, v), (k_bufs, k_buf), (v_bufs, v_buf)):
            out.append(x)
    streams.append(h)
    taps = jnp.concatenate([streams[i] for i in tap_layers], axis=-1) if tap_layers else None
    staged = None if given is None else KVCache(tuple(k_bufs), tuple(v_bufs), cache.lengths,
                                                cache.tables)
    return ForwardOutput(rms_norm(h, params["final_norm"], config.rms_norm_eps),
                         tuple(k_new), tuple(v_new), taps, staged)


def scan_chunks(run: Callable[[KVCache, tuple[jax.Array, ...], jax.Array], tuple[KVCache, Any]],
                cache: KVCache, inputs: tuple[jax.Array, ...], chunk: int) -> tuple[KVCache, Any]:
    """Feed inputs [B,P,...] to `run(cache, block, positions)` `chunk` positions at a time
    under `lax.scan` (static block count; the last block zero-padded).

    Block i sits at positions cache.lengths + i * chunk + [0, chunk); `run` returns the cache
    with the block's rows staged after the valid prefix, and per-position outputs
    [B,chunk,...]. Each block thus attends to the rows of the blocks before it plus itself.
    Returns the cache with every row staged (lengths unchanged; rows past the capacity are
    dropped) and the outputs [B,P,...].
    """
    batch, total = inputs[0].shape[:2]
    n_blocks = -(-total // chunk)
    pad = n_blocks * chunk - total

    def blocks(x: jax.Array) -> jax.Array:
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.swapaxes(x.reshape(batch, n_blocks, chunk, *x.shape[2:]), 0, 1)

    def unblock(y: jax.Array) -> jax.Array:
        y = jnp.swapaxes(y, 0, 1).reshape(batch, n_blocks * chunk, *y.shape[3:])
        return y[:, :total]

    def body(carry: KVCache, block: tuple[jax.Array, ...]):
        positions = carry.lengths[:, None] + jnp.arange(chunk)[None, :]
        staged, outputs = run(carry, block, positions)
        return staged._replace(lengths=carry.lengths + chunk), outputs

    staged, outputs = jax.lax.scan(body, cache, tuple(blocks(x) for x in inputs))
    return staged._replace(lengths=cache.lengths), jax.tree.map(unblock, outputs)


def forward_chunked(params: Params, config: ModelConfig, tokens: jax.Array, cache: KVCache, *,
                    chunk: int, tap_layers: tuple[int, ...] = (),
                    attn_impl: AttentionImpl = "auto"
                    ) -> tuple[jax.Array, jax.Array | None, KVCache]:
    """`forward` of tokens [B,P] at positions cache.lengths + [0, P) (causal), `chunk`
    tokens at a time (see `scan_chunks`): the same hidden states and taps to float
    tolerance, with attention scores no larger than chunk x key block.

    Returns (hidden [B,P,H], taps or None, the cache with all P rows staged, lengths
    unchanged)."""
    def run(carry: KVCache, block: tuple[jax.Array, ...], positions: jax.Array):
        out = forward(params, config, block[0], positions, carry, tap_layers=tap_layers,
                      attn_impl=attn_impl)
        return out.cache, (out.hidden, out.taps)

    staged, (hidden, taps) = scan_chunks(run, cache, (tokens,), chunk)
    return hidden, taps, staged


def lm_head(params: Params, hidden: jax.Array) -> jax.Array:
    """Float32 logits over the vocabulary for final-normed hidden states [..., H]."""
    return linear(hidden, params.get("lm_head", params["embed"])).astype(jnp.float32)
