"""The sharded decoding loops export for accelerators from this CPU host (`jax.export`,
Pallas kernels inside), and their tp=8 partitioning runs exactly the collectives counted
below (`eaglejax.programs.export`).

The checks run in a subprocess with 8 host CPU devices (the suite's own process has one).
Llama-3.1-8B's widths, at 2 layers (exports) and 1 and 2 layers (compiled collective
counts): tracing and compiling all 32 layers would take minutes per program on CI's two
cores; benchmarks/export_sharded.py exports the full 32-layer model."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eaglejax.programs.export import count_collectives
from eaglejax.programs.hlo import split_entry

HERE = Path(__file__).resolve().parent

# Per decoder layer, tp=8 (Megatron layout: wqkv/w_gate_up split by output, wo/w_down by
# input), inside a decode step / speculation round ("step") or once per call ("call"):
#   all-reduce 2: after `wo` and after `w_down` (partial sums of the residual stream), and
#   nothing else. Two things once added more, now guarded here: the KV cache write as a
#   scatter with the heads as an index array (4 all-gathers per layer, 8 in the tree loop:
#   every head's new rows onto every device), and `w_gate_up` [2, I, H] merged to [2I, H]
#   (the split I resharded: an all-to-all of the weight per call, 4 collective-permutes per
#   step); `kv_cache.write_block` and `llama.attention_output_and_mlp` avoid both.
PER_LAYER = {
    "decode": {"step": {"all-reduce": 2}, "call": {}},
    "spec_loop[chain5]": {"step": {"all-reduce": 2}, "call": {}},
    "spec_loop[tree]": {"step": {"all-reduce": 2}, "call": {}},
}
# Per step / round, whatever the depth:
#   decode: 1 all-reduce (the token's embedding row from the vocab-split table) and 2
#     all-gathers (argmax over vocab-split logits: each device's best value and index).
#   chain K=5: embeddings of the verified block, of the head's catch-up block and of its
#     4 later draft steps (the EAGLE-3 head reads the target's vocab-split table): 6
#     all-reduces; the greedy acceptance's argmax: 4 all-gathers.
#   tree 4/3/12: embeddings of the verified tree, the catch-up and 2 expansion steps: 4.
FIXED = {
    "decode": {"all-reduce": 1, "all-gather": 2},
    "spec_loop[chain5]": {"all-reduce": 6, "all-gather": 4},
    "spec_loop[tree]": {"all-reduce": 4, "all-gather": 4},
}


@pytest.mark.slow
def test_loops_export_and_collectives_in_8_device_process():
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags,
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(HERE / "test_sharding_export.py")], cwd=HERE,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("exported ok") == 2 and "collectives ok" in proc.stdout


def test_count_collectives_reads_sync_and_async_ops():
    hlo = """HloModule m

%body (p: f32[8]) -> f32[8] {
  %a = f32[8]{0} all-reduce(f32[8]{0} %p), channel_id=1, to_apply=%add
  %s = (f32[8]{0}, f32[8]{0}) all-reduce-start(f32[8]{0} %a), channel_id=2
  %d = f32[8]{0} all-reduce-done((f32[8]{0}, f32[8]{0}) %s)
  ROOT %t = (f32[1,8]{1,0}, f32[1,8]{1,0}) all-to-all(f32[1,8]{1,0} %d, f32[1,8]{1,0} %d)
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %g = f32[64]{0} all-gather(f32[8]{0} %x), dimensions={0}, metadata={op_name="all-gather(x)"}
  ROOT %c = f32[8]{0} collective-permute(f32[8]{0} %g), source_target_pairs={{0,1}}
}
"""
    entry, rest = split_entry(hlo)
    assert count_collectives(rest) == {"all-reduce": 2, "all-gather": 0, "reduce-scatter": 0,
                                       "all-to-all": 1, "collective-permute": 0}
    assert count_collectives(entry) == {"all-reduce": 0, "all-gather": 1, "reduce-scatter": 0,
                                        "all-to-all": 0, "collective-permute": 1}


def tpu_kernel_lowers(s_cache: int, t_new: int = 8, heads: tuple[int, int] = (4, 1),
                      head_dim: int = 128) -> bool:
    """Whether the bare Mosaic tree-attention kernel lowers for a [1, Hkv, s_cache, D]
    head-major bf16 cache (False where Mosaic refuses it, e.g. s_cache=1 in jax 0.10.2)."""
    import jax
    import jax.numpy as jnp

    import pallas_kernels

    sds, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    n_q, n_kv = heads
    cache = sds((1, n_kv, s_cache, head_dim), bf16)
    new = sds((1, t_new, n_kv, head_dim), bf16)
    args = (sds((1, t_new, n_q, head_dim), bf16), cache, cache, sds((1,), jnp.int32), new,
            new, sds((1, t_new, t_new), jnp.bool_))
    fn = functools.partial(pallas_kernels.tree_attention, backend="tpu", kv_layout="bhsd")
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",))
    except Exception as err:
        if "verif" in type(err).__name__.lower() or "verif" in str(err).lower():
            return False
        raise
    return True


@pytest.mark.xfail(strict=True, reason="Mosaic (jax 0.10.2) fails to verify the TPU kernel "
                   "for a 1-slot cache, the masked slot attention.py gives the prefill: "
                   "'vector.broadcast' op failed to verify ... same element type")
def test_tpu_kernel_lowers_with_the_prefills_one_slot_cache():
    assert tpu_kernel_lowers(s_cache=1)


def test_tpu_kernel_lowers_with_two_or_more_slots():
    assert tpu_kernel_lowers(s_cache=2) and tpu_kernel_lowers(s_cache=16)


# ------------------------------------------------------------ the 8-device subprocess


def check_exports(mesh, config) -> None:
    from eaglejax.decoding.spec_config import SpecConfig
    from eaglejax.programs import export

    specs = {"chain5": SpecConfig.chain(5), "tree60": SpecConfig.tree(8, 6, 60)}
    programs = export.loop_programs(config, mesh, export.LoopShapes(2, 128, 64), specs=specs)
    assert [p.name for p in programs] == [
        "prefill", "decode", "spec_prefill[chain5]", "spec_loop[chain5]",
        "spec_prefill[tree60]", "spec_loop[tree60]"]
    # the weights stay abstract and sharded: the vocabulary split over tp
    embed = programs[0].args[1].target["embed"]  # (loop, weights, ...)
    assert embed.shape == (128256, 4096) and embed.dtype == "bfloat16"
    assert embed.sharding.shard_shape(embed.shape) == (128256 // mesh.size, 4096)
    exported = export.export_programs(programs, ("cuda", "tpu"))
    for (name, platform), ex in exported.items():
        text = ex.mlir_module()
        assert ex.nr_devices == mesh.size and ex.platforms == (platform,), (name, platform)
        assert ("__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call") in text
        # the kernels are the compiled ones, not the interpreter's loops around them
        assert ("tpu_custom_call" if platform == "cuda" else "xla.gpu.triton") not in text
        if mesh.size > 1:
            assert "sdy.manual_computation" in text or "shard_map" in text or (
                "mhlo.sharding" in text), (name, platform)
    print(f"{mesh.size} devices: exported ok")


def check_collectives(mesh_tp, mesh_dp, config) -> None:
    from eaglejax.decoding.spec_config import SpecConfig
    from eaglejax.programs import export

    specs = {"chain5": SpecConfig.chain(5), "tree": SpecConfig.tree(4, 3, 12)}
    counts = export.layer_collectives(config, mesh_tp, export.LoopShapes(1, 128, 64),
                                      specs=specs, names=tuple(PER_LAYER))
    zero = dict.fromkeys(export.COLLECTIVES, 0)
    for name, want in PER_LAYER.items():
        for where in ("step", "call"):
            assert counts[name]["per_layer"][where] == {**zero, **want[where]}, (name, where)
        assert counts[name]["fixed"]["step"] == {**zero, **FIXED[name]}, name
    # dp=8, 8 rows: each device runs its own row with whole weights: no layer communicates
    rows = export.layer_collectives(config, mesh_dp, export.LoopShapes(8, 128, 64), specs={},
                                    names=("decode",))
    assert rows["decode"]["per_layer"] == {"step": zero, "call": zero}, rows
    print("collectives ok")


def main() -> None:
    import jax

    from eaglejax.programs.reference import llama31_8b
    from eaglejax.sharding import make_mesh

    assert len(jax.devices()) == 8, jax.devices()
    config = llama31_8b(2)
    check_exports(make_mesh(tp=1, devices=jax.devices()[:1]), config)
    check_exports(make_mesh(tp=8), config)
    check_collectives(make_mesh(tp=8), make_mesh(dp=8), config)


if __name__ == "__main__":
    main()
