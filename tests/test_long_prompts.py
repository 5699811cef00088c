"""Long prompts: chunked prefill (target and draft head) and blocked (online-softmax) attention
give the unchunked results, for ragged batches and block sizes that do not divide the prompt."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eaglejax
from eaglejax.decoding import loops
from eaglejax.decoding.loops import PlainLoop, SpecLoop, Weights
from eaglejax.decoding.prefill import PREFILL_CHUNK, prefill_target
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.draft.head import draft_forward, draft_forward_chunked
from eaglejax.models import attention as attention_module
from eaglejax.models import kv_cache
from eaglejax.models.attention import attention, blocked_attention
from eaglejax.models.llama import lm_head
from hf_oracle import hf_greedy, hf_logits, make_hf_model
from pallas_kernels import tree_attention_reference
from spec_helpers import random_eagle3
from tolerances import FORWARD_UNITS, assert_close_scaled, scaled_error

LENGTHS = (48, 30, 7, 17)  # right-padded to 48


def _ragged_prompt(lengths=LENGTHS, seed=0, vocab=97):
    rs = np.random.RandomState(seed)
    prompt = np.zeros((len(lengths), max(lengths)), np.int32)
    for i, n in enumerate(lengths):
        prompt[i, :n] = rs.randint(0, vocab, n)
    return jnp.asarray(prompt), jnp.asarray(lengths, jnp.int32)


def _attention_inputs(seed, batch, t_new, s_cache, n_q=4, n_kv=2, head_dim=16):
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(keys[0], (batch, t_new, n_q, head_dim))
    k_cache, v_cache = (jax.random.normal(k, (batch, n_kv, s_cache, head_dim)) for k in keys[1:3])
    k_new, v_new = (jax.random.normal(k, (batch, t_new, n_kv, head_dim)) for k in keys[3:5])
    mask = jax.random.bernoulli(keys[5], 0.6, (batch, t_new, t_new)) | jnp.eye(t_new, dtype=bool)
    return q, k_cache, v_cache, k_new, v_new, mask


@pytest.mark.parametrize("t_new,s_cache,block", [(1, 100, 16), (7, 100, 32), (24, 64, 64),
                                                 (5, 130, 128)])
def test_blocked_attention_matches_reference(t_new, s_cache, block):
    q, k_cache, v_cache, k_new, v_new, mask = _attention_inputs(t_new + s_cache, 4, t_new, s_cache)
    lengths = jnp.asarray([0, s_cache, s_cache // 3, 1], jnp.int32)  # empty, full, ragged
    args = (q, k_cache, v_cache, lengths, k_new, v_new, mask)
    want = tree_attention_reference(*args, kv_layout="bhsd")
    got = jax.jit(functools.partial(blocked_attention, block=block))(*args)
    assert_close_scaled(got, want, units=FORWARD_UNITS, what="blocked attention")
    # Negative control: the same check rejects a cache that lost its last valid key.
    fewer = (q, k_cache, v_cache, jnp.maximum(lengths - 1, 0), k_new, v_new, mask)
    wrong = jax.jit(functools.partial(blocked_attention, block=block))(*fewer)
    assert scaled_error(wrong, want) > 10 * FORWARD_UNITS


def test_blocked_attention_reads_only_valid_blocks():
    """NaN in every slot past the longest valid length must not reach the output."""
    q, k_cache, v_cache, k_new, v_new, mask = _attention_inputs(3, 2, 4, 256)
    lengths = jnp.asarray([40, 70], jnp.int32)
    poison = jnp.arange(256)[None, None, :, None] >= 96
    poisoned = [jnp.where(poison, jnp.nan, x) for x in (k_cache, v_cache)]
    got = blocked_attention(q, *poisoned, lengths, k_new, v_new, mask, block=32)
    want = tree_attention_reference(q, k_cache, v_cache, lengths, k_new, v_new, mask,
                                    kv_layout="bhsd")
    assert_close_scaled(got, want, units=FORWARD_UNITS, what="blocked attention")


def test_long_queries_over_a_long_cache_use_blocked_attention(monkeypatch):
    q, k_cache, v_cache, k_new, v_new, mask = _attention_inputs(5, 1, 64, 1024, n_q=8, n_kv=2)
    lengths = jnp.asarray([700], jnp.int32)
    args = (q, k_cache, v_cache, lengths, k_new, v_new, mask)
    calls = []
    monkeypatch.setattr(attention_module, "blocked_attention",
                        lambda *a, **k: calls.append(k) or blocked_attention(*a, **k))
    monkeypatch.setattr(attention_module, "BLOCKED_MIN_SCORES", 8 * 64 * 1024)
    got = attention(*args, impl="xla")
    assert calls == [{"block": attention_module.KEY_BLOCK}]
    attention(q[:, :1], k_cache, v_cache, lengths, k_new[:, :1], v_new[:, :1], mask[:, :1, :1],
              impl="xla")  # one decode query: the plain reference
    assert len(calls) == 1
    want = tree_attention_reference(*args, kv_layout="bhsd")
    assert_close_scaled(got, want, units=FORWARD_UNITS, what="blocked attention")


def _prefill(target, prompt, lengths, capacity, chunk, tap_layers=(1, 3)):
    fn = jax.jit(functools.partial(prefill_target, config=target.config, capacity=capacity,
                                   tap_layers=tap_layers, attn_impl=target.attn_impl,
                                   chunk=chunk))
    return fn(target.params, prompt=prompt, prompt_lengths=lengths)


def _valid_close(got, want, lengths, depth: int, what: str = "values"):
    """[B,P,...] arrays equal at each row's valid positions, within float32 noise of a
    forward `depth` layers deep (tolerances.FORWARD_UNITS)."""
    for row, n in enumerate(np.asarray(lengths)):
        assert_close_scaled(got[row, :n], want[row, :n], units=FORWARD_UNITS, depth=depth,
                            what=f"{what}, row {row}")


def _cache_close(got, want, lengths):
    """Equal lengths; each layer's keys and values within the noise of that layer's depth."""
    np.testing.assert_array_equal(np.asarray(got.lengths), np.asarray(want.lengths))
    for layer, (g, w) in enumerate(zip(got.k + got.v, want.k + want.v)):  # [B,kv,S,D]
        _valid_close(jnp.swapaxes(g, 1, 2), jnp.swapaxes(w, 1, 2), lengths,
                     depth=layer % len(got.k) + 1, what=f"cache entry {layer}")


def _assert_prefill_matches(target, prompt, lengths, capacity, got, want):
    """Chunked prefill `got` gives the unchunked `want`'s last logits and cache. Negative
    control: the same check rejects the unchunked prefill of the prompt with its first token
    changed, i.e. a chunked prefill that lost one key of its first chunk would fail it."""
    depth = target.config.num_layers
    assert_close_scaled(got.logits, want.logits, units=FORWARD_UNITS, depth=depth, what="logits")
    _cache_close(got.cache, want.cache, lengths)
    other = prompt.at[:, 0].set((prompt[:, 0] + 1) % target.config.vocab_size)
    wrong = _prefill(target, other, lengths, capacity, chunk=prompt.shape[1])
    assert scaled_error(got.logits[0], wrong.logits[0], depth=depth) > 10 * FORWARD_UNITS


@pytest.mark.parametrize("chunk", [5, 16, 20])
def test_chunked_prefill_equals_unchunked(chunk, target_of):
    target = target_of("qwen2")  # attention biases, GQA
    prompt, lengths = _ragged_prompt()
    want = _prefill(target, prompt, lengths, 128, chunk=48)
    got = _prefill(target, prompt, lengths, 128, chunk=chunk)
    _assert_prefill_matches(target, prompt, lengths, 128, got, want)
    _valid_close(got.hidden, want.hidden, lengths, target.config.num_layers, "hidden")
    _valid_close(got.taps, want.taps, lengths, target.config.num_layers, "taps")


def test_chunked_prefill_with_blocked_attention(target_of, monkeypatch, fresh_layer_traces):
    """Tiny key blocks and no size floor: every chunk after the first reads the cache
    through the online softmax, several blocks deep."""
    monkeypatch.setattr(attention_module, "KEY_BLOCK", 8)
    monkeypatch.setattr(attention_module, "BLOCKED_MIN_SCORES", 0)
    target = target_of("llama")
    prompt, lengths = _ragged_prompt(seed=1)
    want = _prefill(target, prompt, lengths, 64, chunk=48)
    got = _prefill(target, prompt, lengths, 64, chunk=12)
    _assert_prefill_matches(target, prompt, lengths, 64, got, want)


def test_chunked_prefill_with_the_pallas_kernel(target_of):
    target = target_of("qwen3")
    prompt, lengths = _ragged_prompt((20, 9), seed=2)
    want = _prefill(target, prompt, lengths, 32, chunk=20)
    pallas = jax.jit(functools.partial(prefill_target, config=target.config, capacity=32,
                                       attn_impl="pallas", chunk=8))
    got = pallas(target.params, prompt=prompt, prompt_lengths=lengths)
    _assert_prefill_matches(target, prompt, lengths, 32, got, want)


def test_chunked_prefill_logits_match_transformers(hf_family, target_of):
    _, hf = hf_family("llama")
    target = target_of("llama")
    prompt, lengths = _ragged_prompt((300, 123), seed=3)
    got = _prefill(target, prompt, lengths, 384, chunk=64, tap_layers=())
    for row, n in enumerate(np.asarray(lengths)):
        want = hf_logits(hf, np.asarray(prompt[row:row + 1, :n]))[0]
        assert_close_scaled(lm_head(target.params, got.hidden[row, :n]), want,
                            units=FORWARD_UNITS, depth=target.config.num_layers,
                            what=f"logits of row {row}")


def test_chunked_draft_prefill_equals_unchunked(target_of):
    target = target_of("llama")
    draft = random_eagle3(target, seed=3, draft_vocab=60)
    prompt, lengths = _ragged_prompt(seed=4)
    batch, length = prompt.shape
    features = jax.random.normal(jax.random.PRNGKey(0), (batch, length, draft.config.feature_size))
    positions = jnp.broadcast_to(jnp.arange(length)[None], (batch, length))
    d = draft.config.decoder
    cache = kv_cache.init_cache(d.num_layers, batch, 64, d.num_kv_heads, d.head_dim, jnp.float32)
    want = draft_forward(draft.params, draft.config, target.params, prompt, features, positions)
    want_cache = kv_cache.append(cache, want.k_new, want.v_new, lengths)
    run = jax.jit(functools.partial(draft_forward_chunked, config=draft.config, chunk=20))
    hidden, got_cache = run(draft.params, target_params=target.params, tokens=prompt,
                            features=features, cache=cache)
    _valid_close(hidden, want.hidden, lengths, d.num_layers, "draft hidden")
    _cache_close(got_cache._replace(lengths=lengths), want_cache, lengths)


@pytest.fixture(scope="module")
def long_context_target(tmp_path_factory):
    """A tiny random Llama with a 2K context (room for prompts over the default chunk)."""
    directory = tmp_path_factory.mktemp("long_llama")
    hf = make_hf_model("llama", directory, seed=5, num_hidden_layers=2,
                       max_position_embeddings=2048)
    return eaglejax.load_target(directory), hf


def test_default_chunking_generates_like_transformers(long_context_target):
    """A 600-token prompt is prefilled in blocks of the default size (bucket 1024)."""
    target, hf = long_context_target
    assert 600 > PREFILL_CHUNK
    prompt = np.random.RandomState(6).randint(0, 97, 600).tolist()
    (result,) = eaglejax.generate([prompt], target=target, max_new_tokens=8, ignore_eos=True)
    assert result.token_ids == hf_greedy(hf, prompt, 8)


def _decode_chunked(target, draft, prompts, max_new, chunk, spec=None):
    """Greedy token ids from the compiled prefill and decode loops, prefilled in blocks of
    `chunk` (the pieces `generate` runs, called directly to set the block size)."""
    batch, n_prompt = len(prompts), 1 << (max(map(len, prompts)) - 1).bit_length()
    prompt = np.zeros((batch, n_prompt), np.int32)
    for i, ids in enumerate(prompts):
        prompt[i, :len(ids)] = ids
    capacity = n_prompt + 16 + (spec.num_nodes if spec else 0)
    keys = jax.vmap(jax.random.PRNGKey)(jnp.zeros((batch,), jnp.uint32))
    run = (jnp.asarray(prompt), jnp.asarray([len(p) for p in prompts], jnp.int32), keys,
           SamplingParams.make(), jnp.int32(max_new))
    common = dict(greedy=True, stop=StopCriteria())
    if spec is None:
        loop, weights = PlainLoop(target.config, target.attn_impl), Weights(target.params)
    else:
        loop = SpecLoop(target.config, draft.config, spec, target.attn_impl)
        weights = Weights(target.params, draft.params, draft.d2t)
    state = loops.prefill(loop, weights, *run, capacity=capacity, max_tokens=16,
                          prefill_chunk=chunk, **common)
    state = loops.decode_loop(loop, weights, state, run[3], run[4], **common)
    return [row[:n].tolist() for row, n in zip(np.asarray(state.out.tokens),
                                                np.asarray(state.out.counts))]


def test_chunked_generation_equals_unchunked(long_context_target):
    """Greedy plain and speculative decoding of a ragged batch (bucket 256), prefilled in
    blocks of 48, give the tokens of `generate` (one-block prefill)."""
    target, _ = long_context_target
    draft = random_eagle3(target, seed=7, draft_vocab=60)
    rs = np.random.RandomState(7)
    prompts = [rs.randint(0, 97, n).tolist() for n in (230, 77, 150)]
    want = [r.token_ids for r in eaglejax.generate(prompts, target=target, max_new_tokens=12,
                                                   ignore_eos=True)]
    assert _decode_chunked(target, None, prompts, 12, chunk=48) == want
    spec = SpecConfig.tree(top_k=2, depth=3, total_tokens=5)
    assert _decode_chunked(target, draft, prompts, 12, chunk=48, spec=spec) == want
