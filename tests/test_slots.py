"""Continuous batching (`decoding.slots`): refilled slots give every request exactly the
tokens `generate()` gives it alone, whatever the slot count or the neighbours."""

import numpy as np
import pytest

import eaglejax
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.slots import Request, SlotEngine
from eaglejax.decoding.stopping import StopCriteria
from eaglejax.errors import InputError

CAPACITY = 128  # what generate() sizes the cache to for these prompts and lengths


@pytest.fixture(scope="module")
def target(target_of):
    return target_of("llama")


def _requests(target, seed: int = 0) -> list[Request]:
    """Prompts of 3..40 tokens (four prefill buckets) with different reply limits."""
    rng = np.random.default_rng(seed)
    lengths, limits = [3, 17, 40, 9, 33, 5, 21], [20, 7, 30, 1, 12, 25, 16]
    return [Request(i, rng.integers(0, target.config.vocab_size, n).tolist(), 100 + i, limit)
            for i, (n, limit) in enumerate(zip(lengths, limits))]


def _engine(target, temperature: float, num_slots: int, **kwargs) -> SlotEngine:
    stop = StopCriteria(tuple(sorted(set(target.eos_token_ids))))
    return SlotEngine(target, num_slots=num_slots, capacity=CAPACITY,
                      sampling=SamplingParams.make(temperature), stop=stop, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_request_gets_the_tokens_it_gets_alone(target, temperature):
    requests = _requests(target)
    completions = _engine(target, temperature, num_slots=3).run(requests)
    assert sorted(c.key for c in completions) == list(range(len(requests)))
    for c in completions:
        r = requests[c.key]
        [alone] = eaglejax.generate([r.prompt], target=target, max_new_tokens=r.max_new_tokens,
                                    temperature=temperature, seed=r.seed)
        assert (c.token_ids, c.finish_reason) == (alone.token_ids, alone.finish_reason), c.key
    # Requests finish out of submission order: slots really were refilled mid-run.
    assert [c.key for c in completions] != sorted(c.key for c in completions)


def test_slot_count_and_call_length_change_nothing(target):
    requests = _requests(target, seed=1)
    one = {c.key: c for c in _engine(target, 1.0, num_slots=1).run(requests)}
    many = _engine(target, 1.0, num_slots=5, steps_per_call=3)
    # Submitted while running: the queue is read at every step.
    completions = many.run(requests[:2])
    for r in requests[2:]:
        many.submit(r)
    while not many.idle:
        completions.extend(many.step())
    assert {c.key: c for c in completions} == one


def test_a_reply_stops_where_the_slot_is_full(target):
    prompt = list(range(1, CAPACITY - 4))
    engine = _engine(target, 0.0, num_slots=2)
    engine.stop = StopCriteria()  # no EOS, so only the context can cut the reply
    [c] = engine.run([Request("long", prompt, 0, 50)])
    # The cache holds the prompt and every new token but the last.
    assert (len(c.token_ids), c.finish_reason) == (CAPACITY - len(prompt) + 1, "length")


def test_bad_requests_name_themselves(target):
    engine = _engine(target, 0.0, num_slots=2)
    with pytest.raises(InputError, match=r"request 'big': prompt of 128 tokens; a slot holds "
                                         r"prompts of 1 to 127"):
        engine.submit(Request("big", [1] * CAPACITY, 0, 4))
    with pytest.raises(InputError, match="request 'empty': prompt of 0 tokens"):
        engine.submit(Request("empty", [], 0, 4))
    with pytest.raises(InputError, match="request 'none': max_new_tokens must be >= 1"):
        engine.submit(Request("none", [1, 2], 0, 0))
    with pytest.raises(InputError, match="capacity 100000 exceeds the model's context"):
        SlotEngine(target, num_slots=1, capacity=100_000, sampling=SamplingParams.make(),
                   stop=StopCriteria())
    assert engine.idle
