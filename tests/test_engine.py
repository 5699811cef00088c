"""Continuous batching (`serving.engine`): refilled slots give every request the tokens
`generate()` gives it alone, plain or speculative, whatever its neighbours' settings, the
slot count or the rounds per call; per-request stops, cancellation and bad requests."""

import jax
import numpy as np
import pytest

import eaglejax
from eaglejax import SpecConfig
from eaglejax.draft.draft import new_eagle3_draft
from eaglejax.errors import InputError
from eaglejax.serving.engine import Engine, QueueFull, Request, SamplingOptions

CAPACITY = 96


@pytest.fixture(scope="module")
def target(target_of):
    return target_of("llama")


@pytest.fixture(scope="module")
def draft(target):
    return new_eagle3_draft(target, seed=1, scale=0.05)


def _requests(target, seed: int = 0, sampled: bool = True) -> list[Request]:
    """Prompts of 3..21 tokens (two prefill buckets), different reply limits, greedy and
    sampled rows mixed (sampled: temperature, top-k and top-p vary)."""
    rng = np.random.default_rng(seed)
    lengths, limits = [3, 17, 12, 9, 21, 5, 14], [14, 7, 16, 1, 12, 15, 10]
    settings = [SamplingOptions(), SamplingOptions(1.0, seed=7), SamplingOptions(0.7, 5, 0.9, 3),
                SamplingOptions(), SamplingOptions(1.3, 0, 0.8, 11)]
    return [Request(i, rng.integers(0, target.config.vocab_size, n).tolist(), limit,
                    settings[i % len(settings)] if sampled else SamplingOptions())
            for i, (n, limit) in enumerate(zip(lengths, limits))]


def _alone(target, request: Request, draft=None, spec=None) -> tuple[list[int], str]:
    s = request.sampling
    [g] = eaglejax.generate([request.prompt], target=target, draft=draft, speculative=spec,
                            max_new_tokens=request.max_new_tokens, temperature=s.temperature,
                            top_k=s.top_k, top_p=s.top_p, seed=s.seed)
    return g.token_ids, g.finish_reason


@pytest.mark.parametrize("spec", [None, SpecConfig.chain(3), SpecConfig.tree(3, 3, 6)],
                         ids=["plain", "chain", "tree"])
def test_every_request_gets_the_tokens_it_gets_alone(target, draft, spec):
    requests = _requests(target)
    engine = Engine(target, draft if spec else None, speculative=spec, num_slots=3,
                    capacity=CAPACITY)
    order = []
    streamed: dict[int, list[int]] = {}
    for r in requests:
        engine.submit(r)
    while not engine.idle:
        for update in engine.step():
            streamed.setdefault(update.key, []).extend(update.token_ids)
            if update.finish_reason is not None:
                order.append(update.key)
                assert update.generated == len(streamed[update.key])
                if spec is not None and update.generated > 1:
                    assert update.rounds >= 1 and update.acceptance_length >= 1
                got = (streamed[update.key], update.finish_reason)
                assert got == _alone(target, requests[update.key], draft if spec else None,
                                     spec), update.key
    assert sorted(order) == list(range(len(requests)))
    # Requests finish out of submission order: slots really were refilled mid-run.
    assert order != sorted(order)


def test_slot_count_and_call_length_change_nothing(target, draft):
    spec = SpecConfig.chain(2)
    requests = _requests(target, seed=1)[:5]
    alone = Engine(target, draft, speculative=spec, num_slots=1, capacity=CAPACITY)
    want = {k: (u.token_ids, u.finish_reason) for k, u in alone.run(requests).items()}
    many = Engine(target, draft, speculative=spec, num_slots=5, capacity=CAPACITY,
                  rounds_per_call=2)
    for r in requests[:2]:
        many.submit(r)
    tokens: dict[int, list[int]] = {}
    got = {}
    while not many.idle:
        if len(tokens) == 2:  # submitted while others run: the queue is read at every step
            for r in requests[2:]:
                many.submit(r)
        for u in many.step():
            tokens.setdefault(u.key, []).extend(u.token_ids)
            if u.finish_reason is not None:
                got[u.key] = (tokens[u.key], u.finish_reason)
    assert got == want


def test_stop_sequences_are_per_request(target):
    engine = Engine(target, num_slots=2, capacity=CAPACITY)
    prompt = [5, 6, 7, 8]
    free = engine.run([Request("free", prompt, 12, ignore_eos=True)])["free"].token_ids
    stop = tuple(free[3:5])
    got = engine.run([Request("stopped", prompt, 12, stop_sequences=(stop,), ignore_eos=True),
                      Request("other", prompt, 12, ignore_eos=True)])
    assert got["stopped"].token_ids == free[:5] and got["stopped"].finish_reason == "stop"
    assert got["other"].token_ids == free and got["other"].finish_reason == "length"
    first = next(i for i, t in enumerate(free) if i >= 2 and t not in free[:i])
    ids = engine.run([Request("ids", prompt, 12, ignore_eos=True,
                              stop_token_ids=(free[first], target.config.vocab_size - 1))])
    assert ids["ids"].token_ids == free[:first + 1] and ids["ids"].finish_reason == "eos"
    with pytest.raises(InputError, match="at most 8 stop token ids"):
        engine.submit(Request("many", prompt, 4, stop_token_ids=tuple(range(9))))


def test_cancel_frees_the_slot(target):
    engine = Engine(target, num_slots=1, capacity=CAPACITY, rounds_per_call=2)
    engine.submit(Request("long", [1, 2, 3], 60, ignore_eos=True))
    engine.submit(Request("queued", [4, 5], 3, ignore_eos=True))
    engine.submit(Request("dropped", [4, 5], 3))
    engine.cancel("dropped")  # while queued
    first = engine.step()  # the prefill's token at once
    assert [(u.key, len(u.token_ids)) for u in first] == [("long", 1)]
    second = engine.step()
    assert [(u.key, len(u.token_ids)) for u in second] == [("long", 2)]
    engine.cancel("long")  # while running: its slot goes to the queued request
    got = engine.run()
    assert list(got) == ["queued"] and len(got["queued"].token_ids) == 3
    assert engine.idle


def test_a_burst_gets_its_first_tokens_as_its_prefills_finish(target, monkeypatch):
    # a step prefills until FILL_TOKENS_PER_STEP prompt tokens, reports, and fills more
    # at the next step before any decoding; each request still gets its tokens alone
    from eaglejax.serving import engine as engine_module

    monkeypatch.setattr(engine_module, "FILL_TOKENS_PER_STEP", 30)
    rng = np.random.default_rng(4)
    requests = [Request(i, rng.integers(0, target.config.vocab_size, 20).tolist(), 6,
                        ignore_eos=True) for i in range(3)]
    engine = Engine(target, num_slots=3, capacity=CAPACITY)
    for r in requests:
        engine.submit(r)
    tokens: dict[int, list[int]] = {r.key: [] for r in requests}
    steps = []
    while not engine.idle:
        updates = engine.step()
        steps.append(sorted((u.key, len(u.token_ids)) for u in updates))
        for u in updates:
            tokens[u.key].extend(u.token_ids)
    assert steps[:2] == [[(0, 1), (1, 1)], [(2, 1)]]  # 20 + 20 >= 30 tokens, then the third
    assert [key for key, _ in steps[2]] == [0, 1, 2]  # then all three decode
    for r in requests:
        assert tokens[r.key] == _alone(target, r)[0]


def test_fills_are_padded_to_powers_of_two_and_one_and_a_half_times_them():
    from eaglejax.decoding.buckets import fine_bucket, fine_buckets

    assert fine_buckets(1024) == [16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768]
    sizes = [fine_bucket(n) for n in range(1, 1025)]
    assert sorted(set(sizes)) == fine_buckets(1024) + [1024]  # the warm-up's sizes, no other
    assert all(n <= b and (n <= 32 or (b - n) * 3 <= b) for n, b in enumerate(sizes, 1))


def test_bad_requests_name_themselves(target, draft):
    engine = Engine(target, num_slots=2, capacity=CAPACITY)
    with pytest.raises(InputError, match=r"request 'big': prompt of 96 tokens; a slot holds "
                                         r"prompts of 1 to 95"):
        engine.submit(Request("big", [1] * CAPACITY, 4))
    with pytest.raises(InputError, match="request 'empty': prompt of 0 tokens"):
        engine.submit(Request("empty", [], 4))
    with pytest.raises(InputError, match=r"request 'none': max_new_tokens must be an integer "
                                         r"in \[1,"):
        engine.submit(Request("none", [1, 2], 0))
    with pytest.raises(InputError, match="request 'long': 90 prompt tokens \\+ max_new_tokens "
                                         "10 exceed the slot capacity of 96"):
        engine.submit(Request("long", [1] * 90, 10))
    with pytest.raises(InputError, match="request 'hot': temperature"):
        engine.submit(Request("hot", [1], 4, SamplingOptions(-1.0)))
    with pytest.raises(InputError, match="request 'oov'"):
        engine.submit(Request("oov", [1, target.config.vocab_size], 4))
    with pytest.raises(InputError, match="request 'text': 'h' is not a token id"):
        engine.submit(Request("text", "hello", 4))  # a chat template's text, not encoded
    engine.submit(Request("twin", [1], 4))
    with pytest.raises(InputError, match="request 'twin': a live request already has this key"):
        engine.submit(Request("twin", [2], 4))
    with pytest.raises(InputError, match="capacity 100000 exceeds the model's context"):
        Engine(target, num_slots=1, capacity=100_000)
    lookup_chain = SpecConfig.chain(2).with_lookup(2)
    spec_engine = Engine(target, draft, speculative=lookup_chain, num_slots=1, capacity=CAPACITY)
    with pytest.raises(InputError, match="request 's': .*a lookup branch with sampling"):
        spec_engine.submit(Request("s", [1], 4, SamplingOptions(1.0)))


def test_at_most_max_waiting_requests_wait_for_a_slot(target):
    engine = Engine(target, num_slots=2, capacity=CAPACITY, max_waiting=1)
    for key in "abc":  # two will take the free slots, one waits
        engine.submit(Request(key, [1, 2], 30))
    assert engine.num_waiting == 1
    with pytest.raises(QueueFull, match="request 'd': 1 requests already wait for one of 2"):
        engine.submit(Request("d", [1, 2], 30))
    engine.step()  # a and b fill the slots; c still waits
    assert (engine.num_running, engine.num_waiting) == (2, 1)
    assert engine.kv_tokens() == 2 * (2 + 1)  # each prompt and its first token
    with pytest.raises(QueueFull):
        engine.submit(Request("d", [1, 2], 30))
    engine.cancel("c")
    engine.submit(Request("d", [1, 2], 30))
    with pytest.raises(InputError, match="max_waiting must be an integer"):
        Engine(target, num_slots=1, capacity=CAPACITY, max_waiting=-1)


def test_warmup_returns_with_nothing_left_running(target):
    """`warmup` waits for the programs it ran (they run asynchronously): what the first
    request waits for is its own work."""
    engine = Engine(target, None, num_slots=2, capacity=64)
    engine.warmup(progress=False)
    assert all(leaf.is_ready() for leaf in jax.tree.leaves(engine.state))


def test_requests_past_their_deadline_end_queued_or_running(target):
    """On the clock `step` is given: a waiting request past its deadline ends with no token,
    a running one with the tokens it had (what it gets alone, cut), and its slot goes to
    the next request."""
    prompt = [5, 9, 31, 60, 7]
    want, _ = _alone(target, Request("w", prompt, 40))
    engine = Engine(target, num_slots=1, capacity=CAPACITY, rounds_per_call=2)
    with pytest.raises(InputError, match="'never': deadline must be a finite number"):
        engine.submit(Request("never", prompt, 40, deadline=float("nan")))
    engine.submit(Request("running", prompt, 40, deadline=10.0))
    engine.submit(Request("waiting", prompt, 40, deadline=5.0))
    engine.submit(Request("after", prompt, 3))
    got: dict[str, list[int]] = {}
    ended = {}
    for now in (0.0, 1.0, 2.0, 6.0, 7.0, 11.0):
        for update in engine.step(now):
            got.setdefault(update.key, []).extend(update.token_ids)
            if update.finish_reason is not None:
                ended[update.key] = (now, update.finish_reason, update.generated)
    assert ended["waiting"] == (6.0, "timeout", 0) and got["waiting"] == []
    now, reason, generated = ended["running"]
    assert (now, reason) == (11.0, "timeout") and 1 < generated < 40
    assert got["running"] == want[:generated]
    while not engine.idle:
        for update in engine.step(12.0):
            got.setdefault(update.key, []).extend(update.token_ids)
            ended[update.key] = update.finish_reason
    assert ended["after"] == "length" and got["after"] == want[:3]
