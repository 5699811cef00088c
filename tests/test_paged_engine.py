"""The serving engine over a paged KV cache (`Engine(kv_tokens=...)`): every request gets the
tokens `generate()` gives it alone, plain or speculative, greedy or sampled, also when a
pool too small for its requests preempts and resumes them; the host's block tables never
hand a block to two slots and get every block back."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eaglejax
from eaglejax import SpecConfig
from eaglejax.draft.draft import new_eagle3_draft
from eaglejax.errors import InputError
from eaglejax.serving.engine import Engine, Request, SamplingOptions
from eaglejax.serving.kv_blocks import BlockTables
from test_prefix_cache import _turns

CAPACITY = 96
BLOCK_POSITIONS = 32


@pytest.fixture(scope="module")
def target(target_of):
    return target_of("llama")


@pytest.fixture(scope="module")
def draft(target):
    return new_eagle3_draft(target, seed=1, scale=0.05)


def _requests(target, count: int = 6, seed: int = 0, sampled: bool = True) -> list[Request]:
    """Prompts of 5..40 tokens with replies of up to 40: several blocks per request."""
    rng = np.random.default_rng(seed)
    settings_ = [SamplingOptions(), SamplingOptions(1.0, seed=7),
                 SamplingOptions(0.7, 5, 0.9, 3)]
    return [Request(i, rng.integers(0, target.config.vocab_size,
                                    int(rng.integers(5, 41))).tolist(),
                    int(rng.integers(20, 41)),
                    settings_[i % len(settings_)] if sampled else SamplingOptions(),
                    ignore_eos=True)
            for i in range(count)]


def _alone(target, request: Request, draft=None, spec=None) -> list[int]:
    s = request.sampling
    [g] = eaglejax.generate([request.prompt], target=target, draft=draft, speculative=spec,
                            max_new_tokens=request.max_new_tokens, temperature=s.temperature,
                            top_k=s.top_k, top_p=s.top_p, seed=s.seed, ignore_eos=True)
    return g.token_ids


def _streamed(engine: Engine, requests: list[Request]) -> dict[int, list[int]]:
    """Each request's streamed tokens (checked against its final count)."""
    for r in requests:
        engine.submit(r)
    streamed: dict[int, list[int]] = {r.key: [] for r in requests}
    while not engine.idle:
        for update in engine.step():
            streamed[update.key].extend(update.token_ids)
            if update.finish_reason is not None:
                assert update.generated == len(streamed[update.key]), update.key
    return streamed


@pytest.mark.parametrize("spec", [None, SpecConfig.chain(3), SpecConfig.tree(3, 3, 6)],
                         ids=["plain", "chain", "tree"])
def test_paged_requests_get_their_own_tokens(target, draft, spec):
    requests = _requests(target, sampled=spec is None)
    engine = Engine(target, draft if spec else None, speculative=spec, num_slots=4,
                    capacity=CAPACITY, kv_tokens=24 * BLOCK_POSITIONS)
    got = _streamed(engine, requests)
    for r in requests:
        assert got[r.key] == _alone(target, r, draft if spec else None, spec), r.key
    assert engine.preemptions == 0
    assert engine.blocks.free == engine.blocks.blocks  # every block came back


@pytest.mark.parametrize("speculative", [None, "auto"], ids=["plain", "auto"])
def test_preempted_requests_resume_with_the_same_tokens(target, draft, speculative):
    """A pool of 6 blocks (4 with a head, whose rounds may add several tokens each) for 4
    slots of requests that each grow to 2-3 blocks: the newest requests are preempted and
    prefilled again, and still end with their own tokens (sampled ones too: a resumed row
    draws with the keys of its token counts)."""
    requests = _requests(target, seed=1, sampled=speculative is None)
    blocks = 6 if speculative is None else 4
    engine = Engine(target, draft if speculative else None, speculative=speculative,
                    num_slots=4, capacity=CAPACITY, kv_tokens=blocks * BLOCK_POSITIONS,
                    prefix_cache_tokens=0, rounds_per_call=4)
    got = _streamed(engine, requests)
    assert engine.preemptions > 0
    for r in requests:
        assert got[r.key] == _alone(target, r), r.key
    assert engine.blocks.free == engine.blocks.blocks


@pytest.mark.parametrize("speculative", [None, "auto"], ids=["plain", "auto"])
def test_prefix_hits_in_a_paged_engine_decode_the_same(target, draft, speculative):
    """A chat's second turn hits the first's blocks (copied into its own blocks, with the
    head's rows under `auto` where it keeps them) as in a slot engine, and decodes the same."""
    engines = [Engine(target, draft if speculative else None, speculative=speculative,
                      num_slots=2, capacity=192, kv_tokens=kv_tokens)
               for kv_tokens in (16 * BLOCK_POSITIONS, None)]
    paged, slotted = engines
    got, want = (_turns(engine, target, [0, 1]) for engine in engines)
    assert {k: u.token_ids for k, u in got.items()} == {k: u.token_ids for k, u in want.items()}
    assert paged.prefix.hit_tokens == slotted.prefix.hit_tokens >= 2 * (2 * BLOCK_POSITIONS - 1)
    assert paged.blocks.free == paged.blocks.blocks


def test_a_cancelled_request_gives_its_blocks_back(target):
    engine = Engine(target, num_slots=2, capacity=CAPACITY, kv_tokens=8 * BLOCK_POSITIONS)
    requests = _requests(target, count=2, sampled=False)
    for r in requests:
        engine.submit(r)
    engine.step()
    assert engine.blocks.used > 0
    for r in requests:
        engine.cancel(r.key)
    assert engine.idle and engine.blocks.free == engine.blocks.blocks
    assert not engine.blocks.tables[engine.blocks.tables < engine.blocks.blocks].size


def test_a_pool_smaller_than_one_request_is_refused(target):
    with pytest.raises(InputError, match="kv_tokens 64 is less than one request's 128"):
        Engine(target, num_slots=2, capacity=CAPACITY, kv_tokens=64)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 200)), max_size=40))
def test_block_tables_never_share_or_lose_a_block(operations):
    """Random grows (positions > 0) and releases (0) of 4 slots over 12 blocks."""
    tables = BlockTables(slots=4, blocks=12, block_size=16, width=8)
    for slot, positions in operations:
        if positions == 0:
            tables.release(slot)
            continue
        free_before, lacking = tables.free, tables.shortfall(slot, positions)
        grown = tables.grow(slot, positions)
        assert grown == (lacking <= free_before)
        if grown:
            assert tables.held[slot] >= tables.needed(positions)
        held = np.concatenate([tables.tables[s, :tables.held[s]] for s in range(4)])
        assert len(set(held.tolist())) == len(held) == tables.used  # no block twice
        assert np.all(tables.tables[:, :][np.arange(8)[None, :] >= tables.held[:, None]]
                      == tables.blocks)  # entries past a slot's blocks point at none
    for slot in range(4):
        tables.release(slot)
    assert tables.free == tables.blocks
