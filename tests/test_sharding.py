"""Decoding over device meshes (tensor x data parallel): weights land in their shardings,
and greedy and sampled output on every mesh equal one device's, token for token.

The mesh checks run in a subprocess with 8 host CPU devices (the suite's own process has
one); the rule-table and argument checks run here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from eaglejax.errors import InputError
from eaglejax.models.placement import widen_kv_heads
from eaglejax.sharding.rules import logical_spec

HERE = Path(__file__).resolve().parent
VOCAB = 96  # divisible by every tp tried, so the embedding and output head split


def test_rules_split_what_the_mesh_axis_divides():
    mesh = AbstractMesh((2, 4), ("dp", "tp"))
    cache = ("batch", "kv_heads", "cache_seq", "head_dim")
    assert logical_spec(cache, (6, 8, 128, 64), mesh) == PartitionSpec("dp", "tp", None, None)
    # 3 rows on dp=2 and 2 KV heads on tp=4: replicated along those axes, not an error
    assert logical_spec(cache, (3, 2, 128, 64), mesh) == PartitionSpec(None, None, None, None)
    assert logical_spec(("vocab", "embed"), (96, 64), mesh) == PartitionSpec("tp", None)
    assert logical_spec(("embed", "mlp"), (64, 128), mesh) == PartitionSpec(None, "tp")
    with pytest.raises(ValueError, match="do not match shape"):
        logical_spec(("vocab", "embed"), (96,), mesh)


def test_widened_kv_heads_keep_each_query_head_with_its_kv_head():
    kv, group, dim, width = 2, 4, 3, 5
    grouped = np.random.RandomState(0).randn(kv, group + 2, dim, width)
    wide = widen_kv_heads(grouped, 2)  # tp=4 over 2 KV heads: each KV head twice
    assert wide.shape == (4, group // 2 + 2, dim, width)
    for copy in range(4):
        source = copy // 2
        share = slice((copy % 2) * 2, (copy % 2) * 2 + 2)
        np.testing.assert_array_equal(wide[copy, :2], grouped[source, share])  # its queries
        np.testing.assert_array_equal(wide[copy, 2:], grouped[source, -2:])  # key, value
    # query heads keep their global order: concatenating the copies' queries restores them
    queries = wide[:, :2].reshape(kv, group, dim, width)
    np.testing.assert_array_equal(queries, grouped[:, :group])


def test_bad_mesh_arguments_are_refused():
    import eaglejax

    with pytest.raises(InputError, match="needs 6 devices"):
        eaglejax.make_mesh(tp=3, dp=2)
    with pytest.raises(InputError, match="tp"):
        eaglejax.make_mesh(tp=0)
    with pytest.raises(InputError, match="mesh must be a jax.sharding.Mesh"):
        eaglejax.load_target("smollm2-135m-instruct", mesh="tp=2")


@pytest.mark.parametrize("flags,match", [
    (["--tp", "2"], "needs 2 devices"),
    (["--dp", "0"], "--dp"),
    (["--coordinator", "127.0.0.1:1"], "missing num_processes, process_id"),
])
def test_cli_refuses_bad_mesh_flags(flags, match, capsys, monkeypatch):
    from eaglejax.cli import main

    for variable in ("EAGLEJAX_COORDINATOR", "EAGLEJAX_NUM_PROCESSES", "EAGLEJAX_PROCESS_ID"):
        monkeypatch.delenv(variable, raising=False)
    assert main(["generate", "hi", "--no-draft", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eaglejax: error:") and match in err, err


@pytest.mark.slow
def test_meshes_decode_like_one_device(tmp_path):
    """tp=2 x dp=2 and tp=4 over 2 KV heads (widened), plus 3 KV heads on tp=2
    (attention replicated): plain, chain, dynamic and static trees, greedy and sampled; the
    serving engine's prefix cache on a mesh, and a paged engine (preemption, a prefix hit)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
    env = dict(os.environ, XLA_FLAGS=flags,
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, str(HERE / "test_sharding.py"), str(tmp_path)],
                          cwd=HERE, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # 4 shapes on tp=2 x dp=2 and 2 on tp=4, the engine's prefix cache, a paged
    # engine and log-probabilities, sampled, the checkpoint and Target.on_mesh, replicated
    # attention, a draft model, DFlash, the Pallas kernel
    assert proc.stdout.count("identical") == 6 + 3 + 1 + 2 + 1 + 1 + 1 + 1, proc.stdout


# ------------------------------------------------------------ the 8-device subprocess


def _prompts(seed: int, n: int) -> list[list[int]]:
    rs = np.random.RandomState(seed)
    return [rs.randint(0, VOCAB, size=rs.randint(2, 30)).tolist() for _ in range(n)]


def _check_shards(target, tp: int) -> None:
    """Each device holds 1/tp of every tp-split weight, and the split weights are the ones
    the rule table names."""
    import jax

    split = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(target.params)[0]:
        spec = tuple(leaf.sharding.spec) + (None,) * leaf.ndim
        for dim, axis in enumerate(spec[:leaf.ndim]):
            if axis == "tp":
                split += 1
                for shard in leaf.addressable_shards:
                    assert shard.data.shape[dim] * tp == leaf.shape[dim], (path, shard)
    # per layer wqkv, wo, w_gate_up, w_down, plus the embedding and the output head
    assert split == 4 * target.config.num_layers + 2, split


def _run_meshes(directory: Path) -> None:
    import dataclasses

    import jax

    import eaglejax
    from conftest import make_hf_model
    from eaglejax import SpecConfig
    from spec_helpers import make_selfdraftable, random_eagle3, self_draft

    assert len(jax.devices()) == 8
    model = make_hf_model("llama", directory / "kv2", seed=11, num_hidden_layers=3,
                          num_attention_heads=8, num_key_value_heads=2, vocab_size=VOCAB)
    make_selfdraftable(model)
    model.save_pretrained(directory / "kv2")
    one = eaglejax.load_target(directory / "kv2")
    prompts = _prompts(3, 4)
    kwargs = dict(max_new_tokens=12, ignore_eos=True)
    static = SpecConfig.static_tree([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    shapes = [None, SpecConfig.chain(3), SpecConfig.tree(3, 3, 8), static]

    def run(target, spec, **more):
        draft = None if spec is None else self_draft(target)
        out = eaglejax.generate(prompts, target=target, draft=draft, speculative=spec,
                                **kwargs, **more)
        return [o.token_ids for o in out]

    expected = [run(one, spec) for spec in shapes]
    for tp, dp in [(2, 2), (4, 1)]:  # both axes split; KV heads widened (tp=4)
        mesh = eaglejax.make_mesh(tp=tp, dp=dp, devices=jax.devices()[:tp * dp])
        target = eaglejax.load_target(directory / "kv2", mesh=mesh)
        assert target.config.num_kv_heads == max(2, tp)  # tp=4: each KV head twice
        _check_shards(target, tp)
        # every shape on the 2-D mesh; plain and the dynamic tree on tp=4 (CI time)
        for spec, want in zip(shapes, expected):
            if (tp, dp) == (2, 2) or spec in (None, shapes[2]):
                assert run(target, spec) == want, (tp, dp, spec)
                print("identical", tp, dp, spec and spec.describe())

    # the serving engine on tp=2 x dp=2 keeps its prefix cache there (KV heads split as the
    # slots'): a chat's next turn copies the blocks of the first, with the tokens it gets alone
    from eaglejax.serving.engine import Engine, Request

    mesh = eaglejax.make_mesh(tp=2, dp=2, devices=jax.devices()[:4])
    engine = Engine(eaglejax.load_target(directory / "kv2", mesh=mesh), num_slots=2,
                    capacity=128, prefix_cache_tokens=256)
    first = [(5 * i + 3) % VOCAB for i in range(40)]
    turn = engine.run([Request("first", first, 12, ignore_eos=True)])["first"]
    again = first + turn.token_ids + _prompts(6, 1)[0]
    got = engine.run([Request("again", again, 12, ignore_eos=True)])["again"]
    assert got.cached_tokens >= 31 and engine.prefix.pool.k[0].sharding.spec[1] == "tp"
    want = eaglejax.generate([again], target=one, max_new_tokens=12, ignore_eos=True)
    assert got.token_ids == want[0].token_ids
    print("identical prefix-cache hit on tp=2 dp=2", got.cached_tokens)
    _paged_engine(engine.target, one, first, turn.token_ids, again, want[0].token_ids)
    # log-probabilities over the vocabulary split on tp: those of one device
    from tolerances import FORWARD_UNITS, assert_close_scaled

    kept = [eaglejax.generate(prompts, target=t, max_new_tokens=6, ignore_eos=True,
                              logprobs=3) for t in (engine.target, one)]
    alternatives = [[[t for t, _ in e.top] for g in out for e in g.logprobs] for out in kept]
    assert alternatives[0] == alternatives[1]
    assert_close_scaled(*[[e.logprob for g in out for e in g.logprobs] for out in kept],
                        units=FORWARD_UNITS, depth=3, what="log-probabilities on tp=2 dp=2")
    print("identical logprobs on tp=2 dp=2")

    # sampled: the same seeds give the same tokens (plain, chain, tree)
    mesh = eaglejax.make_mesh(tp=2, dp=2, devices=jax.devices()[:4])
    target = eaglejax.load_target(directory / "kv2", mesh=mesh)
    sampled = dict(temperature=0.8, top_k=20, seed=[1, 2, 3, 4])
    spec = shapes[2]  # (plain sampling over processes: tests/test_multihost.py)
    assert run(target, spec, **sampled) == run(one, spec, **sampled)
    print("identical sampled", spec.describe())

    # an eaglejax checkpoint is read straight into its shardings (orbax), a head replicated
    one.save(str(directory / "checkpoint"))
    head = random_eagle3(one, seed=5)
    head.save(str(directory / "head"))
    target = eaglejax.load_target(directory / "checkpoint", mesh=mesh)
    _check_shards(target, 2)
    draft = eaglejax.load_draft(directory / "head", target=target)
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(draft.params))
    chain = SpecConfig.chain(4)
    want = eaglejax.generate(prompts, target=one, draft=head, speculative=chain, **kwargs)
    got = eaglejax.generate(prompts, target=target, draft=draft, speculative=chain, **kwargs)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    print("identical checkpoint and loaded head")
    on_mesh = one.on_mesh(eaglejax.make_mesh(tp=2, devices=jax.devices()[:2]))
    got = eaglejax.generate(prompts, target=on_mesh, draft=head.for_target(on_mesh),
                            speculative=chain, **kwargs)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    print("identical Target.on_mesh")

    # 3 KV heads on tp=2: attention replicated, the MLP and vocabulary split (a bias too)
    make_hf_model("qwen2", directory / "kv3", seed=4, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=3, vocab_size=VOCAB)
    one = eaglejax.load_target(directory / "kv3")
    target = eaglejax.load_target(directory / "kv3",
                                  mesh=eaglejax.make_mesh(tp=2, devices=jax.devices()[:2]))
    assert target.params["layers"][0]["wqkv"].sharding.is_fully_replicated
    assert target.params["layers"][0]["w_down"].sharding.spec[1] == "tp"
    assert run(target, shapes[2]) == run(one, shapes[2])
    print("identical kv3", shapes[2].describe())
    # a draft model (3 KV heads, replicated) drafting for the target split over tp=2 x dp=2
    target = eaglejax.load_target(directory / "kv2", mesh=mesh)
    drafter = eaglejax.DraftModel.of(one, target)
    assert all(leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(drafter.params))
    got = eaglejax.generate(prompts, target=target, draft=drafter,
                            speculative=SpecConfig.draft_model_tree(3, 3, 8), **kwargs)
    assert [o.token_ids for o in got] == expected[0]
    print("identical draft model on tp=2 dp=2")
    # a DFlash head (replicated, its context cache whole on every device) on the same mesh
    from eaglejax.draft.draft import new_dflash_draft

    dflash = new_dflash_draft(eaglejax.load_target(directory / "kv2"), block_size=6,
                              mask_token_id=VOCAB - 1, seed=3, scale=0.05).for_target(target)
    got = eaglejax.generate(prompts, target=target, draft=dflash,
                            speculative=SpecConfig.dflash_tree(3, 3, 8), **kwargs)
    assert [o.token_ids for o in got] == expected[0]
    print("identical DFlash on tp=2 dp=2")
    # the Pallas kernel inside shard_map (interpret mode here) on tp=4 x dp=2
    mesh = eaglejax.make_mesh(tp=4, dp=2)
    target = dataclasses.replace(eaglejax.load_target(directory / "kv2", mesh=mesh),
                                 attn_impl="pallas")
    assert run(target, shapes[2]) == expected[2]
    print("identical pallas tp=4 dp=2")


def _paged_engine(target, one, first, reply, again, again_reply) -> None:
    """A paged engine on tp=2 x dp=2: pools whose KV heads split on tp (every block on every
    device), ragged requests that outgrow the pool (the newest preempted, then resumed) and
    a chat's next turn hitting the prefix cache's blocks of the pool decode as one device."""
    import eaglejax
    from eaglejax.serving.engine import Engine, Request

    engine = Engine(target, num_slots=3, capacity=128, kv_tokens=4 * 32, rounds_per_call=2)
    pools = engine.state.target_cache
    assert tuple(pools.k[0].sharding.spec)[:2] == (None, "tp"), pools.k[0].sharding
    assert pools.tables.sharding.is_fully_replicated and pools.lengths.sharding.is_fully_replicated
    engine.run([Request(("short", i), [1, 2, 3], 1) for i in range(2)])  # replies expected
    prompts = [[(11 * i + 5 * j) % VOCAB for j in range(n)] for i, n in enumerate((20, 26, 14))]
    got = engine.run([Request(i, p, 16, ignore_eos=True) for i, p in enumerate(prompts)])
    want = eaglejax.generate(prompts, target=one, max_new_tokens=16, ignore_eos=True)
    assert [got[i].token_ids for i in range(3)] == [w.token_ids for w in want]
    assert engine.preemptions > 0
    chat = engine.run([Request("first", first, 12, ignore_eos=True)])["first"]
    assert chat.token_ids == reply
    chat = engine.run([Request("again", again, 12, ignore_eos=True)])["again"]
    assert chat.cached_tokens >= 31 and chat.token_ids == again_reply
    assert tuple(engine.state.target_cache.k[0].sharding.spec)[:2] == (None, "tp")
    print("identical paged engine on tp=2 dp=2", engine.preemptions, chat.cached_tokens)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    _run_meshes(Path(sys.argv[1]))
