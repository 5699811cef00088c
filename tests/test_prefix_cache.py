"""Prefix caching in the serving engine (`serving.prefix_cache`): a request whose prompt starts
with an earlier prompt or conversation prefills only the rest and gets the tokens it gets
without the cache; the index keeps whole blocks, matches only exact prefixes and evicts the
least recently used."""

import numpy as np
import pytest

from eaglejax import SpecConfig
from eaglejax.decoding.prefix_pool import BLOCK
from eaglejax.draft.draft import new_eagle3_draft
from eaglejax.draft.formats.native import save_draft
from eaglejax.draft.loading import load_draft
from eaglejax.serving import engine as engine_module
from eaglejax.serving.engine import Engine, Request, SamplingOptions
from eaglejax.serving.prefix_cache import PrefixCache
from tolerances import FORWARD_UNITS, assert_close_scaled

CAPACITY = 192


@pytest.fixture(scope="module")
def target(target_of):
    return target_of("llama")


def _conversation(target, seed: int) -> tuple[list[int], list[int]]:
    """A first turn's prompt (70 tokens: two full blocks) and a second turn's new tokens."""
    rng = np.random.default_rng(seed)
    vocab = target.config.vocab_size
    return rng.integers(0, vocab, 70).tolist(), rng.integers(0, vocab, 9).tolist()


def _turns(engine: Engine, target, seeds, sampling=SamplingOptions()) -> dict:
    """Each conversation's first turn, then its second turn (first prompt + reply + new
    tokens): every final update by key."""
    firsts = {s: _conversation(target, s) for s in seeds}
    out = engine.run([Request(("first", s), firsts[s][0], 30, sampling, ignore_eos=True)
                      for s in seeds])
    seconds = [Request(("second", s), firsts[s][0] + out[("first", s)].token_ids + firsts[s][1],
                       12, sampling, ignore_eos=True) for s in seeds]
    out.update(engine.run(seconds))
    return out


@pytest.mark.parametrize("sampling", [SamplingOptions(), SamplingOptions(0.8, 20, 0.9, 5)],
                         ids=["greedy", "sampled"])
def test_a_later_turn_prefills_only_what_is_new_and_decodes_the_same(target, sampling):
    cached = Engine(target, num_slots=2, capacity=CAPACITY)
    uncached = Engine(target, num_slots=2, capacity=CAPACITY, prefix_cache_tokens=0)
    got, want = _turns(cached, target, [0, 1], sampling), _turns(uncached, target, [0, 1],
                                                                  sampling)
    assert {k: u.token_ids for k, u in got.items()} == {k: u.token_ids for k, u in want.items()}
    # Second turns: 70 + 30 + 9 = 109 tokens, of which blocks 0-1 (the first prompt's) and
    # block 2 (the first reply's, saved when the first turn finished) were cached.
    assert cached.prefix.hit_tokens == 2 * (3 * BLOCK - 1)  # each hit's last one prefilled
    assert uncached.prefix is None


def test_a_hit_restores_the_heads_rows_too(target):
    """Under `auto` a row that may speculate gets the head's rows of the hit with the
    target's: after the fill both caches and the head's proposal equal a full prefill's
    (float noise: the rest ran after copied rows), and the replies equal plain decoding's."""
    draft = new_eagle3_draft(target, seed=1, scale=0.05)
    cached = Engine(target, draft, speculative="auto", num_slots=2, capacity=CAPACITY)
    fresh = Engine(target, draft, speculative="auto", num_slots=2, capacity=CAPACITY,
                   prefix_cache_tokens=0)
    first, more = _conversation(target, 3)
    reply = cached.run([Request("a", first, 30, ignore_eos=True)])["a"].token_ids
    prompt = first + reply + more  # 109 tokens; blocks 0-2 kept with the head's rows
    for engine in (cached, fresh):
        engine.submit(Request("b", prompt, 8, ignore_eos=True))
        engine.step()  # the fill, into slot 0
    assert cached.prefix.hit_tokens == 3 * BLOCK - 1
    n = len(prompt)
    for got, want, what in ((cached.state.target_cache, fresh.state.target_cache, "target"),
                            (cached.state.drafter.cache, fresh.state.drafter.cache, "head")):
        assert int(got.lengths[0]) == int(want.lengths[0]) == n, what
        for k_got, k_want in zip(got.k + got.v, want.k + want.v):
            assert_close_scaled(k_got[0, :, :n], k_want[0, :, :n], units=FORWARD_UNITS,
                                depth=target.config.num_layers, what=f"{what} rows")
    assert_close_scaled(cached.state.drafter.logits[0], fresh.state.drafter.logits[0],
                        units=FORWARD_UNITS, depth=target.config.num_layers + 1,
                        what="the head's proposal")
    plain = Engine(target, num_slots=2, capacity=CAPACITY, prefix_cache_tokens=0)
    want = plain.run([Request("b", prompt, 8, ignore_eos=True)])["b"].token_ids
    got = _drained(cached, fresh)
    assert got[cached] == got[fresh] == want[1:]  # the fill step reported the first token


def test_without_the_heads_rows_a_row_that_may_speculate_takes_only_long_hits(
        target, monkeypatch):
    """A drafter whose rows are not kept (suffix drafting): a hit means decoding plainly,
    taken only from `HIT_PER_REPLY_TOKEN` cached tokens per token to generate."""
    for ratio, hits in ((0.5, 3 * BLOCK - 1), (10.0, 0)):  # 96 cached, 12 new tokens
        monkeypatch.setattr(engine_module, "HIT_PER_REPLY_TOKEN", ratio)
        engine = Engine(target, speculative="auto",  # suffix drafting
                        num_slots=2, capacity=CAPACITY)
        _turns(engine, target, [4])
        assert engine.prefix.head_pool is None and engine.prefix.hit_tokens == hits
    fixed = Engine(target, new_eagle3_draft(target, seed=1, scale=0.05),
                   speculative=SpecConfig.chain(2), num_slots=2, capacity=CAPACITY)
    assert fixed.prefix is None  # a fixed shape cannot fill a row with the target alone


def test_the_index_keeps_exact_prefixes_and_evicts_the_least_recently_used(target):
    engine = Engine(target, num_slots=1, capacity=CAPACITY, prefix_cache_tokens=3 * BLOCK)
    prefix = engine.prefix
    cache = engine.state.target_cache
    a, b, c = (list(range(k, k + 2 * BLOCK + 1)) for k in (0, 1000, 2000))
    prefix.save(cache, 0, a)  # 2 blocks
    assert prefix.match(a) == prefix.match(a[:2 * BLOCK + 5]) and len(prefix.match(a)) == 2
    assert prefix.match(a[:2 * BLOCK]) == prefix.match(a)[:1]  # one token must stay to prefill
    assert prefix.match([a[0] + 1] + a[1:]) == []  # the first block differs: nothing
    assert len(prefix.match(a[:BLOCK] + b[BLOCK:])) == 1  # the second differs: one block
    assert prefix.match(a, minimum=3 * BLOCK) == []
    prefix.save(cache, 0, b)  # the pool holds 3: b's second block evicts a's second block,
    assert len(prefix.match(b)) == 2 and len(prefix.match(a)) == 1  # used least recently
    prefix.match(b)
    prefix.save(cache, 0, c[:BLOCK + 1])  # evicts a's first block, now the oldest
    assert len(prefix.match(c)) == 1 and len(prefix.match(b)) == 2 and prefix.match(a) == []
    with pytest.raises(ValueError, match="at least one block"):
        PrefixCache(cache, 0)


@pytest.mark.parametrize("with_head", [False, True], ids=["plain", "auto-head"])
def test_warmup_compiles_every_hit_a_request_can_make(target, with_head, lowered_programs,
                                                      tmp_path):
    """No request waits for a compilation: after `warmup`, requests and hits of every rest
    length run only programs it compiled (the fill after copied rows, the pool's saves). With
    a head loaded from disk, whose arrays are committed to the device (and so every output
    computed from them), the pool's arrays once saved into were committed and the warmed-up
    programs, run on uncommitted ones, compiled again."""
    draft = None
    if with_head:
        save_draft(new_eagle3_draft(target, seed=1, scale=0.05), tmp_path / "head")
        draft = load_draft(tmp_path / "head", target=target)
    engine = Engine(target, draft, speculative="auto" if with_head else None, num_slots=1,
                    capacity=64)
    engine.warmup(progress=False)
    lowered_programs.clear()
    rng = np.random.default_rng(5)
    base = rng.integers(0, target.config.vocab_size, 40).tolist()
    engine.run([Request("first", base, 2)])  # keeps base's block
    for extra in (1, 20):  # rests of 10 and 29 tokens: both prompt buckets a hit can fill
        engine.run([Request(("warm", extra), base + rng.integers(0, 97, extra).tolist(), 2)])
    assert engine.prefix.hit_tokens == 2 * (BLOCK - 1)
    assert lowered_programs == []


def _drained(*engines: Engine) -> dict[Engine, list[int]]:
    """Step each engine until idle; the tokens each reported."""
    got: dict[Engine, list[int]] = {}
    for engine in engines:
        while not engine.idle:
            for update in engine.step():
                got.setdefault(engine, []).extend(update.token_ids)
    return got
