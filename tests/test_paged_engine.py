"""The serving engine over a paged KV cache (`Engine(kv_tokens=...)`): every request gets the
tokens `generate()` gives it alone, plain or speculative, greedy or sampled, also when a
pool too small for its requests preempts and resumes them; the host's block tables never
hand a block to two slots and get every block back. An EAGLE head's cache is paged too,
through the target's tables: a paged head drafts exactly as a slot engine's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import eaglejax
from eaglejax import SpecConfig, native
from eaglejax.draft.draft import new_eagle3_draft
from eaglejax.errors import InputError
from eaglejax.models import kv_cache
from eaglejax.serving.engine import Engine, Request, SamplingOptions
from eaglejax.serving.kv_blocks import BlockTables
from spec_helpers import self_draft
from test_prefix_cache import _conversation, _drained, _turns
from tolerances import FORWARD_UNITS, assert_close_scaled

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


def expect_short_replies(engine: Engine) -> None:
    """Two one-token replies: the engine then expects short ones and admits requests that
    outgrow the pool (as a workload whose replies grow does), so some are preempted."""
    engine.run([Request(("short", i), [1, 2, 3], 1) for i in range(2)])


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


@pytest.mark.parametrize("speculative", [SpecConfig.chain(3), "auto"], ids=["chain", "auto"])
def test_a_paged_engine_keeps_the_heads_rows_in_a_pool(target, draft, speculative):
    """The head's cache is one pool per head layer of as many blocks as the target's, read
    through the target's tables: no per-slot head array of `capacity` rows is left."""
    blocks = 8
    engine = Engine(target, draft, speculative=speculative, num_slots=4, capacity=CAPACITY,
                    kv_tokens=blocks * BLOCK_POSITIONS)
    head, cache = engine.state.drafter.cache, engine.state.target_cache
    d = draft.config.decoder
    assert all(pool.shape == (blocks, d.num_kv_heads, BLOCK_POSITIONS, d.head_dim)
               for pool in head.k + head.v)
    assert head.tables.shape == cache.tables.shape and head.capacity == cache.capacity
    assert all(leaf.shape[0] != 4 or leaf.ndim < 3
               for leaf in jax.tree.leaves(engine.state.drafter))
    engine.run(_requests(target, count=2, sampled=False))
    assert np.array_equal(engine.state.drafter.cache.tables, engine.state.target_cache.tables)


@pytest.fixture(scope="module")
def self_drafted(selfdraft_target):
    """A target and a head of its own layers that drafts it well (`spec_helpers`)."""
    return selfdraft_target, self_draft(selfdraft_target)


@pytest.mark.parametrize("spec", [SpecConfig.chain(6), SpecConfig.tree(3, 4, 8), "auto"],
                         ids=["chain", "tree", "auto"])  # a static tree's rows are a tree's
def test_a_paged_head_drafts_as_a_slot_engines(self_drafted, spec):
    """Greedy requests get a slot engine's tokens and rounds, and the batch the same
    acceptance counts (so the same drafts accepted): a head row staged where the host gave
    no block and read back by a later draft step (a chain's) would lower acceptance, not
    the tokens. Each request ends at a block's end (64 positions), where a chain's last
    round reads rows past the request's last. The paged engine runs XLA's attention, which
    reads a table entry without a block as the pool's last block (poisoned here; the native
    kernel stops a row's keys there instead)."""
    target, draft = self_drafted
    rng = np.random.default_rng(3)
    requests = [Request(i, rng.integers(0, target.config.vocab_size, n).tolist(), 64 - n,
                        ignore_eos=True) for i, n in enumerate((12, 20, 27, 33))]
    engines = [Engine(target, draft, speculative=spec, num_slots=4, capacity=CAPACITY,
                      kv_tokens=kv_tokens, prefix_cache_tokens=0)
               for kv_tokens in (16 * BLOCK_POSITIONS, None)]
    _poison_head_pools(engines[0])
    with native.xla_only():
        paged = _tokens_and_rounds(engines[0], requests)
    assert paged == _tokens_and_rounds(engines[1], requests)
    hists = [np.asarray(engine.state.accept_hist).sum(axis=0) for engine in engines]
    assert hists[0].tolist() == hists[1].tolist()
    if spec != "auto":  # (`auto` may find speculation too dear for so small a target)
        assert hists[0][1:].sum() > 0  # drafts were accepted


@pytest.mark.parametrize("spec", [SpecConfig.parallel(4), SpecConfig.parallel_tree(3, 4, 10)],
                         ids=["parallel", "parallel_tree"])
def test_a_paged_peagle_head_decodes_as_a_slot_engines(target, spec):
    """P-EAGLE's mask slots ride after a round's kept rows (staged, never read back): a
    paged head decodes with a slot engine's tokens, rounds and acceptance counts."""
    peagle = new_eagle3_draft(target, mask_token_id=target.config.vocab_size - 1, seed=1,
                              scale=0.05)
    requests = _requests(target, count=4, seed=5, sampled=False)
    engines = [Engine(target, peagle, speculative=spec, num_slots=4, capacity=CAPACITY,
                      kv_tokens=kv_tokens, prefix_cache_tokens=0)
               for kv_tokens in (16 * BLOCK_POSITIONS, None)]
    got, want = (_tokens_and_rounds(engine, requests) for engine in engines)
    assert got == want
    hists = [np.asarray(engine.state.accept_hist).sum(axis=0) for engine in engines]
    assert hists[0].tolist() == hists[1].tolist()


def _tokens_and_rounds(engine: Engine, requests: list[Request]) -> dict:
    return {u.key: (u.token_ids, u.rounds) for u in engine.run(requests).values()}


def _poison_head_pools(engine: Engine) -> None:
    """Fill the paged head's pools with huge keys and values: a draft step that reads a row
    the head never wrote (a write dropped for want of a block) then drafts garbage."""
    head = engine.state.drafter.cache
    poison = lambda pool: jnp.full_like(pool, 1e4)  # noqa: E731
    engine.state = engine.state._replace(drafter=engine.state.drafter._replace(
        cache=head._replace(k=tuple(map(poison, head.k)), v=tuple(map(poison, head.v)))))


def test_a_paged_hit_restores_the_heads_rows_too(target, draft):
    """Under `auto` a hit's blocks in a paged engine bring the head's rows (the head pool's
    same blocks): after the fill the row's target and head rows and the head's proposal
    equal a full prefill's, the head's row at the hit's last position too (its block copied,
    since that row reads this prompt's next token), and the reply equals plain decoding's."""
    cached = Engine(target, draft, speculative="auto", num_slots=2, capacity=192,
                    kv_tokens=16 * BLOCK_POSITIONS)
    fresh = Engine(target, draft, speculative="auto", num_slots=2, capacity=192,
                   prefix_cache_tokens=0)
    first, more = _conversation(target, 3)
    reply = cached.run([Request("a", first, 30, ignore_eos=True)])["a"].token_ids
    prompt = first + reply + more
    for engine in (cached, fresh):
        engine.submit(Request("b", prompt, 8, ignore_eos=True))
        engine.step()  # the fill, into slot 0
    assert cached.prefix.hit_tokens == 3 * BLOCK_POSITIONS - 1
    tables = cached.blocks.tables
    assert tables[0, :2].tolist() == list(cached.prefix.index.values())[:2]  # shared
    assert tables[0, 2] not in cached.prefix.index.values()  # the last hit block: copied
    n = len(prompt)
    for got, want, what in ((cached.state.target_cache, fresh.state.target_cache, "target"),
                            (cached.state.drafter.cache, fresh.state.drafter.cache, "head")):
        assert int(got.lengths[0]) == int(want.lengths[0]) == n, what
        for k_got, k_want in zip(got.k + got.v, want.k + want.v):
            rows = kv_cache.row_buffer(k_got, 0, got.tables)
            assert_close_scaled(rows[:, :n], k_want[0, :, :n], units=FORWARD_UNITS,
                                depth=target.config.num_layers, what=f"{what} rows")
    assert_close_scaled(cached.state.drafter.logits[0], fresh.state.drafter.logits[0],
                        units=FORWARD_UNITS, depth=target.config.num_layers + 1,
                        what="the head's proposal")
    want = Engine(target, num_slots=2, capacity=192, prefix_cache_tokens=0).run(
        [Request("b", prompt, 8, ignore_eos=True)])["b"].token_ids
    got = _drained(cached, fresh)
    assert got[cached] == got[fresh] == want[1:]  # the fill step reported the first token
    assert cached.blocks.used == 0


@pytest.mark.parametrize("speculative", [None, "auto", SpecConfig.chain(3)],
                         ids=["plain", "auto", "chain"])
def test_preempted_requests_resume_with_the_same_tokens(target, draft, speculative):
    """A pool of 6 blocks (4 with a head, whose rounds may add several tokens each) for 4
    slots of requests that each grow to 2-3 blocks, admitted expecting short replies: the
    newest requests are preempted and prefilled again, and still end with their own tokens
    (sampled ones too: a resumed row draws with the keys of its token counts)."""
    requests = _requests(target, seed=1, sampled=speculative is None)
    blocks = 6 if speculative is None else 4
    engine = Engine(target, draft if speculative else None, speculative=speculative,
                    num_slots=4, capacity=CAPACITY, kv_tokens=blocks * BLOCK_POSITIONS,
                    prefix_cache_tokens=0, rounds_per_call=4)
    expect_short_replies(engine)
    got = _streamed(engine, requests)
    assert engine.preemptions > 0
    for r in requests:
        assert got[r.key] == _alone(target, r), r.key
    assert engine.blocks.free == engine.blocks.blocks


@pytest.mark.parametrize("speculative", [None, "auto"], ids=["plain", "auto"])
def test_prefix_hits_in_a_paged_engine_decode_the_same(target, draft, speculative):
    """A chat's second turn hits the first's blocks (put in its own block table, with the
    head's rows under `auto` where it keeps them) as in a slot engine, and decodes the same."""
    engines = [Engine(target, draft if speculative else None, speculative=speculative,
                      num_slots=2, capacity=192, kv_tokens=kv_tokens)
               for kv_tokens in (16 * BLOCK_POSITIONS, None)]
    paged, slotted = engines
    got, want = (_turns(engine, target, [0, 1]) for engine in engines)
    assert {k: u.token_ids for k, u in got.items()} == {k: u.token_ids for k, u in want.items()}
    assert paged.prefix.hit_tokens == slotted.prefix.hit_tokens >= 2 * (2 * BLOCK_POSITIONS - 1)
    assert paged.blocks.free == paged.blocks.blocks


def test_requests_sharing_a_prompt_share_its_blocks(target):
    """Two requests whose prompts start with an earlier one's 3 full blocks hold the first
    two themselves (refcounted: the cache's and each table's) and a copy of the third (whose
    last row they prefill again), prefill only the rest into blocks of their own, and decode
    as without any cache; their ends free only their own blocks."""
    rng = np.random.default_rng(4)
    base = rng.integers(0, target.config.vocab_size, 100).tolist()
    later = [Request(k, base + rng.integers(0, target.config.vocab_size, 7).tolist(), 12,
                     ignore_eos=True) for k in ("b", "c")]
    engine = Engine(target, num_slots=2, capacity=192, kv_tokens=16 * BLOCK_POSITIONS)
    engine.run([Request("a", base, 4, ignore_eos=True)])
    kept = list(engine.prefix.index.values())[:3]
    for request in later:
        engine.submit(request)
    first = {u.key: u.token_ids for u in engine.step()}  # both fills, their first tokens
    tables = engine.blocks.tables
    assert tables[0, :2].tolist() == tables[1, :2].tolist() == kept[:2]
    own = {int(tables[0, 2]), int(tables[1, 2]), int(tables[0, 3]), int(tables[1, 3])}
    assert len(own) == 4 and not own & set(kept)  # the copy and the rest: their own blocks
    assert engine.blocks.refs[kept].tolist() == [3, 3, 1]
    got = engine.run()
    slotted = Engine(target, num_slots=2, capacity=192, prefix_cache_tokens=0)
    want = slotted.run(later)
    assert {k: first[k] + got[k].token_ids for k in "bc"} == {k: want[k].token_ids
                                                              for k in "bc"}
    assert all(got[k].cached_tokens == 3 * BLOCK_POSITIONS - 1 for k in "bc")
    assert engine.blocks.refs[kept].tolist() == [1, 1, 1]  # the cache's
    assert engine.blocks.used == 0 and engine.blocks.free == engine.blocks.blocks


def test_warmup_compiles_what_paging_runs(target):
    """After `warmup`, requests that preempt and resume compile no program of the batch."""
    from eaglejax.decoding import slots

    engine = Engine(target, num_slots=3, capacity=64, kv_tokens=4 * BLOCK_POSITIONS,
                    prefix_cache_tokens=0, rounds_per_call=4)
    engine.warmup(progress=False)
    expect_short_replies(engine)
    programs = (slots.fill, slots.advance, slots.resume_row, slots.set_tables, slots.release)
    compiled = [program._cache_size() for program in programs]
    rng = np.random.default_rng(2)
    engine.run([Request(i, rng.integers(0, target.config.vocab_size, 20).tolist(), 30,
                        ignore_eos=True) for i in range(3)])
    assert engine.preemptions > 0
    assert [program._cache_size() for program in programs] == compiled


def test_requests_expected_to_outgrow_the_pool_wait(target):
    """With no reply seen yet a request is expected to use all its `max_new_tokens`: of 4
    requests needing 2-3 blocks each, a pool of 6 runs only as many as fit whole, and none
    is preempted."""
    engine = Engine(target, num_slots=4, capacity=CAPACITY, kv_tokens=6 * BLOCK_POSITIONS,
                    prefix_cache_tokens=0)
    requests = _requests(target, count=4, seed=1, sampled=False)
    for r in requests:
        engine.submit(r)
    most = 0
    while not engine.idle:
        engine.step()
        most = max(most, engine.num_running)
    assert engine.preemptions == 0 and 2 <= most < 4


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
