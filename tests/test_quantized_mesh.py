"""Quantized storage on device meshes: int8, int4 and a GGUF file's blocks (K-quants too)
load split over tensor x data parallel meshes with their scales beside their values, and
greedy decoding gives one device's tokens (K-quants: its logits); the decoding loops of int8 and int4 targets (and
their speculative loops with an EAGLE-3 head stored the same way) export for cuda and tpu on
1 and 8 devices with the stored int8 values entering the products, and tp=8 runs a float
model's collectives per layer.

The checks run in one subprocess with 8 host CPU devices (the suite's own process has one).
Exports and collective counts use Llama-3.1-8B's widths at 1 and 2 layers, as
tests/test_sharding_export.py does for float weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
VOCAB = 128  # 8 tiles of 16 rows: the embedding and output head split on tp=2, 4 and 8


@pytest.mark.slow
def test_quantized_meshes_decode_export_and_communicate_like_float(tmp_path):
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(HERE / "test_quantized_mesh.py"), str(tmp_path)],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("identical") == 6, proc.stdout
    assert proc.stdout.count("exported ok") == 4 and "collectives ok" in proc.stdout, proc.stdout


def test_int8_dots_are_read_from_the_module():
    """The export check's reader: an s8 x s8 -> s32 dot counts with the rows it multiplies
    (the block sums' [K/32, M, N/16, 16]), a float dot and a widened weight (an int8 array
    of weight size converted to float) are found."""
    module = """
  %1 = stablehlo.dot_general %a, %b, batching_dims = [1] x [1], contracting_dims = [2, 3] x [2, 4] : (tensor<7x2x8x4xi8>, tensor<2x2x8x16x4xi8>) -> tensor<2x7x2x16xi32>
  %2 = stablehlo.convert %w : (tensor<32x64xui8>) -> tensor<32x64xbf16>
  %3 = stablehlo.dot_general %x, %2, contracting_dims = [1] x [1] : (tensor<1x64xbf16>, tensor<32x64xbf16>) -> tensor<1x32xf32>
  %4 = stablehlo.convert %r : (tensor<2x64xui8>) -> tensor<2x64xf32>
"""
    dots, widened = int8_products(module, weight_size=32 * 64)
    assert dots == {("i8", "i8", "i32"): 1, ("bf16", "bf16", "f32"): 1}
    assert widened == ["32x64xui8"]  # the gathered rows [2, 64] are not a weight
    assert product_rows(module) == [7]


def _dots(module: str) -> list[tuple[str, str, str]]:
    """(lhs, rhs, result) tensor types of every dot_general of a StableHLO module's text."""
    import re

    return re.findall(r"stablehlo\.dot_general .*: \(tensor<([^>]*)>, tensor<([^>]*)>\) "
                      r"-> tensor<([^>]*)>", module)


def product_rows(module: str) -> list[int]:
    """The rows of x each s8 x s8 -> s32 dot of a StableHLO module multiplies: M of its
    block sums [K/32, M, N/16, 16] (`models.quantized.block_sums`)."""
    return [int(result.split("x")[1]) for _, _, result in _dots(module)
            if result.endswith("xi32")]


def int8_products(module: str, weight_size: int) -> tuple[dict, list[str]]:
    """In a StableHLO module's text: its dot_generals counted by (lhs, rhs, result) element
    types, and the integer arrays of at least `weight_size` elements converted to floats."""
    import collections
    import math
    import re

    def element(tensor: str) -> str:
        return tensor.rsplit("x", 1)[-1]

    counts = collections.Counter(tuple(map(element, dot)) for dot in _dots(module))
    converts = re.findall(r"stablehlo\.convert .*: \(tensor<([^>]*)>\) -> tensor<([^>]*)>",
                          module)
    widened = [a for a, b in converts if re.fullmatch(r"u?i(4|8)", element(a))
               and element(b).startswith(("f", "bf"))
               and math.prod(int(d) for d in a.split("x")[:-1]) >= weight_size]
    return dict(counts), widened


# ------------------------------------------------------------ the 8-device subprocess


def _quantized(target) -> dict:
    """keystr path -> quantized matrix of the target's parameters."""
    import jax

    from eaglejax.models.quantized import is_int8

    leaves = jax.tree_util.tree_flatten_with_path(target.params, is_leaf=is_int8)[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves if is_int8(leaf)}


def _check_split(matrix, tp: int) -> bool:
    """Whether `matrix` is split over tp (each device 1/tp of the split dim of each array),
    its scales (and minimums, supers) split where its values are: the same dims of the rows' tiles
    and of K's blocks (a matrix kept in parts: each part). False where it is replicated."""
    if hasattr(matrix, "parts"):
        return all([_check_split(part, tp) for part in matrix.parts])
    packed, *per_block = [a for a in matrix.tree_flatten()[0] if a.size]
    spec = tuple(packed.sharding.spec) + (None,) * packed.ndim
    rows = packed.ndim - 3  # the row dims, then K's groups of 4 or 8, then the tile's 16 x 4
    for a in per_block:
        a_spec = tuple(a.sharding.spec) + (None,) * a.ndim
        # int8 scales [*rows] (the last in rows, not tiles); block scales [*rows, K/32, 16],
        # a K-quant's supers [*rows, K/256, c, 16]
        want = spec[:rows] if a.ndim == rows else spec[:rows + 1] + (None,) * (a.ndim - rows - 1)
        assert a_spec[:a.ndim] == want, (matrix, a.shape, a_spec, spec)
    split = [dim for dim, axis in enumerate(spec[:packed.ndim]) if axis == "tp"]
    assert len(split) <= 1 and all(axis in (None, "tp") for axis in spec), spec
    for dim in split:
        for shard in packed.addressable_shards:
            assert shard.data.shape[dim] * tp == packed.shape[dim]
    return bool(split)


def _decode_on_meshes(directory: Path) -> None:
    import jax

    import eaglejax
    from hf_oracle import make_hf_model
    from test_gguf_blocks import write_blocks_gguf

    assert len(jax.devices()) == 8
    # head_dim 16, so that the fused QKV's rows split by KV head in tiles of 16
    make_hf_model("llama", directory / "hf", seed=7, num_hidden_layers=2, hidden_size=128,
                  num_attention_heads=8, num_key_value_heads=2, intermediate_size=256,
                  vocab_size=VOCAB)
    rs = __import__("numpy").random.RandomState(5)
    prompts = [rs.randint(0, VOCAB, size=n).tolist() for n in (3, 9, 17, 6)]

    def tokens(target) -> list[list[int]]:
        out = eaglejax.generate(prompts, target=target, max_new_tokens=8, ignore_eos=True)
        return [o.token_ids for o in out]

    def all_split(target, tp: int) -> None:
        matrices = _quantized(target)
        assert len(matrices) == 4 * target.config.num_layers + 2  # and embed, lm_head
        assert all(_check_split(m, tp) for m in matrices.values()), matrices

    devices = jax.devices()
    tp2dp2 = eaglejax.make_mesh(tp=2, dp=2, devices=devices[:4])
    int8 = eaglejax.load_target(directory / "hf", weight_dtype="int8")
    want = tokens(int8)
    sharded = eaglejax.load_target(directory / "hf", weight_dtype="int8", mesh=tp2dp2)
    all_split(sharded, 2)
    assert tokens(sharded) == want
    print("identical int8 tp=2 dp=2")
    int8.save(str(directory / "int8-ck"))  # saved flat, read back onto the mesh split
    from_checkpoint = eaglejax.load_target(directory / "int8-ck", mesh=tp2dp2)
    all_split(from_checkpoint, 2)
    assert tokens(from_checkpoint) == want
    print("identical int8 checkpoint tp=2 dp=2")

    # int4 through Target.on_mesh on tp=4: the 2 KV heads widened to 4 with their scales
    int4 = eaglejax.load_target(directory / "hf", weight_dtype="int4")
    placed = int4.on_mesh(eaglejax.make_mesh(tp=4, devices=devices[:4]))
    assert placed.config.num_kv_heads == 4 and placed.storage == "Q4_1 + Q8_0 blocks"
    all_split(placed, 4)
    assert tokens(placed) == tokens(int4)
    print("identical int4 tp=4 (KV heads widened)")

    # a GGUF file's Q4_0/Q4_1/Q8_0 blocks on tp=2; w_down's K (96) is 3 blocks of 32, which
    # tp=2 does not divide: replicated
    path = write_blocks_gguf(directory / "blocks.gguf")[0]
    blocks = eaglejax.load_target(path, weight_dtype="gguf")
    sharded = eaglejax.load_target(path, weight_dtype="gguf",
                                   mesh=eaglejax.make_mesh(tp=2, devices=devices[:2]))
    assert sharded.storage == blocks.storage == "Q4_0 + Q4_1 + Q8_0 blocks"
    split = {key: _check_split(m, 2) for key, m in _quantized(sharded).items()}
    assert not split["['layers'][0]['w_down']"] and split["['layers'][0]['w_gate_up']"]
    assert split["['embed']"] and split["['layers'][0]['wqkv']"] and split["['lm_head']"]
    assert tokens(sharded) == tokens(blocks)
    print("identical GGUF blocks tp=2")
    # on tp=4 the 2 KV heads widen to 4: layer 1's wqkv, kept in parts of Q4_0 and Q4_1
    # (q, k, v), widens part by part
    widened = eaglejax.load_target(path, weight_dtype="gguf",
                                   mesh=eaglejax.make_mesh(tp=4, devices=devices[:4]))
    wqkv = widened.params["layers"][1]["wqkv"]
    assert widened.config.num_kv_heads == 4 and wqkv.kind == "Q4_0x1+Q4_1x1+Q4_0x1@1"
    assert wqkv.shape == (4, 3, 16, 64) and _check_split(wqkv, 4)
    assert tokens(widened) == tokens(blocks)
    print("identical GGUF blocks in parts tp=4 (KV heads widened)")

    # Q4_K / Q6_K super-blocks on tp=2: K splits between super-blocks of 256, so w_down
    # (K = 512) splits and wo (K = 256) is replicated
    from test_gguf_blocks import write_kquant_gguf
    from tolerances import FORWARD_UNITS, assert_close_scaled

    path = write_kquant_gguf(directory / "kquants.gguf")[0]
    blocks = eaglejax.load_target(path, weight_dtype="gguf")
    sharded = eaglejax.load_target(path, weight_dtype="gguf",
                                   mesh=eaglejax.make_mesh(tp=2, devices=devices[:2]))
    assert sharded.storage == blocks.storage == "Q4_K + Q6_K blocks"
    split = {key: _check_split(m, 2) for key, m in _quantized(sharded).items()}
    assert split["['layers'][0]['w_down']"] and not split["['layers'][0]['wo']"]
    assert split["['embed']"] and split["['layers'][0]['wqkv']"] and split["['lm_head']"]
    ids = [prompts[1]]
    assert_close_scaled(sharded.logits(ids), blocks.logits(ids), units=FORWARD_UNITS,
                        depth=blocks.config.num_layers, what="K-quants on tp=2")
    print("identical K-quant logits tp=2")


def _exports(config) -> None:
    """The plain loop (prefill, decode) and the speculative one (spec_prefill, spec_loop:
    chain K=5, an EAGLE-3 head stored as the target is) of int8 and int4 storage for cuda
    and tpu on 1 and 8 devices: every product multiplies int8 weights (s8 x s8 -> s32: per
    layer wqkv, wo, w_gate_up (gate and up apart on a mesh), w_down; the output head; the
    draft head's fc, layer and lm_head), no dot reads a float weight, no weight is widened
    (the only int8-to-float convert is the embedding's gathered rows), and no product
    multiplies more than `quantized.ROWS` rows at once (the 128-row prefill goes through the
    weights 16 rows at a time)."""
    import jax

    from eaglejax.decoding.spec_config import SpecConfig
    from eaglejax.models.quantized import ROWS
    from eaglejax.programs import export
    from eaglejax.sharding import make_mesh

    smallest = min(config.hidden_size, config.num_heads * config.head_dim) ** 2
    int8 = ("i8", "i8", "i32")
    for weight_dtype in ("int8", "int4"):
        for mesh in (make_mesh(tp=1, devices=jax.devices()[:1]), make_mesh(tp=8)):
            programs = export.loop_programs(config, mesh, export.LoopShapes(1, 128, 64),
                                            specs={"chain5": SpecConfig.chain(5)},
                                            weight_dtype=weight_dtype)
            wqkv = programs[0].args[1].target["layers"][0]["wqkv"]  # (loop, weights, ...)
            assert wqkv.packed.dtype == "uint8" and wqkv.packed.ndim == 6  # split by KV head
            assert wqkv.packed.sharding.shard_shape(wqkv.packed.shape)[0] == 8 // mesh.size
            fc = programs[2].args[1].draft["fc"]
            assert fc.packed.dtype == "uint8" and fc.packed.sharding.is_fully_replicated
            products = 4 + 1 + (mesh.size > 1)  # the layers' (traced once) and the head's
            head_products = products + 1  # fc, the layer's, lm_head
            for (name, platform), exported in export.export_programs(programs).items():
                assert exported.nr_devices == mesh.size, (name, platform)
                module = exported.mlir_module()
                dots, widened = int8_products(module, smallest)
                if name.startswith("spec"):  # the head's steps trace its products again
                    assert set(dots) == {int8} and dots[int8] >= products + head_products, (
                        name, platform, dots)
                else:
                    assert dots == {int8: products}, (name, platform, dots)
                assert not widened, (name, platform, widened)
                assert max(product_rows(module)) <= ROWS, (name, platform)
            print(f"{weight_dtype} {mesh.size} devices: exported ok")


def _collectives(config) -> None:
    """tp=8, decode: per layer the float model's 2 all-reduces (test_sharding_export's
    PER_LAYER) and nothing else; per step the float model's embedding all-reduce and argmax
    all-gathers, plus one all-reduce (the embedding's rows and their scales come from the
    vocab-split table apart)."""
    from eaglejax.programs import export
    from eaglejax.sharding import make_mesh
    from test_sharding_export import FIXED, PER_LAYER

    zero = dict.fromkeys(export.COLLECTIVES, 0)
    for weight_dtype in ("int8", "int4"):
        counts = export.layer_collectives(config, make_mesh(tp=8), export.LoopShapes(1, 128, 64),
                                          specs={}, names=("decode",),
                                          weight_dtype=weight_dtype)["decode"]
        for where in ("step", "call"):
            assert counts["per_layer"][where] == {**zero, **PER_LAYER["decode"][where]}, (
                weight_dtype, counts)
        fixed = dict(FIXED["decode"], **{"all-reduce": FIXED["decode"]["all-reduce"] + 1})
        assert counts["fixed"]["step"] == {**zero, **fixed}, (weight_dtype, counts)
    print("collectives ok")


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    from eaglejax.programs.reference import llama31_8b

    _decode_on_meshes(Path(sys.argv[1]))
    _exports(llama31_8b(2))
    _collectives(llama31_8b(2))
