"""EAGLE-3 head training: data and loss mask, draft vocabulary, training-time test, the
trainer end to end (acceptance length rises), crash-and-resume, bad input."""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eaglejax
from eaglejax import EaglejaxError, InputError
from eaglejax.cli import main
from eaglejax.config import ModelConfig
from eaglejax.draft.draft import new_eagle3_draft
from eaglejax.draft.head import draft_forward, head_logits
from eaglejax.draft.head import init_params as head_init_params
from eaglejax.loading.gguf_file import read_gguf_metadata
from eaglejax.models import kv_cache
from eaglejax.models.llama import init_params
from eaglejax.target import Target
from eaglejax.tokenizer import Tokenizer
from eaglejax.training import trainer
from eaglejax.training.data import (
    Conversation,
    Example,
    first_repeat,
    pack,
    read_conversations,
    tokenize_all,
    tokenize_conversation,
)
from eaglejax.training.regenerate import RegenConfig, regenerate
from eaglejax.training.run import open_run
from eaglejax.training.trainer import TrainConfig, acceptance_length, train
from eaglejax.training.ttt import (
    Batch,
    segment_mask,
    target_signal,
    ttt_loss,
    ttt_unroll,
)
from eaglejax.training.vocab import select_draft_vocab, vocab_from_counts
from tolerances import FORWARD_UNITS, ONE_ROUNDING_UNITS, assert_close_scaled, scaled_error

V = 64  # the tiny target's vocabulary: small, so every step is fast
PERM = np.random.RandomState(5).permutation(V)


def make_tiny_target() -> Target:
    """A random 4-layer Llama (init_params, scale 0.1) with 3x larger embeddings and an
    output matrix made of its embedding rows permuted by PERM: its next token is often
    PERM^-1 of the current token and otherwise depends on the context. Its greedy text is
    varied (no short cycles)."""
    config = ModelConfig("llama", V, 64, 128, 4, 4, 2, 16, max_position_embeddings=256)
    params = init_params(config, jax.random.PRNGKey(0), scale=0.1)
    params["embed"] = params["embed"] * 3.0
    params["lm_head"] = params["embed"][PERM] * (5.0 / 3.0)
    return Target(config, params, None, "tiny-random-target")


def sample_rows(target: Target, count: int = 256):
    """`count` sequences sampled from the tiny target (temperature 1): 4 random prompt
    tokens (no loss) and 60 sampled tokens (loss), one per 64-token row."""
    rs = np.random.RandomState(0)
    prompts = [rs.randint(0, V, 4).tolist() for _ in range(count)]
    outs = eaglejax.generate(prompts, target=target, max_new_tokens=60, temperature=1.0,
                             seed=list(range(count)))
    examples = [Example(np.array(p + o.token_ids, np.int32),
                        np.array([False] * len(p) + [True] * len(o.token_ids)))
                for p, o in zip(prompts, outs)]
    return pack(examples, 64)


@pytest.fixture(scope="module")
def tiny_target() -> Target:
    return make_tiny_target()


@pytest.fixture(scope="module")
def sampled_rows(tiny_target):
    return sample_rows(tiny_target)


@pytest.fixture(scope="module")
def chatml(smollm_path) -> Tokenizer:
    """SmolLM2's tokenizer and ChatML template (from the GGUF metadata only)."""
    return Tokenizer.from_gguf_metadata(read_gguf_metadata(smollm_path), source=str(smollm_path))


_unroll = jax.jit(ttt_unroll, static_argnums=(1, 7))


def _chain_al(sequences, draft_next, k: int = 5) -> float:
    """Greedy acceptance length a context-free chain drafter (next = draft_next(token))
    would reach on these greedy outputs, rounds counted as eaglejax counts them."""
    values = []
    for seq in sequences:
        i, rounds = 0, 0
        while i < len(seq) - 1:
            accepted, token = 0, seq[i]
            while accepted < k and i + 1 + accepted < len(seq):
                token = draft_next(token)
                if token != seq[i + 1 + accepted]:
                    break
                accepted += 1
            i += accepted + 1
            rounds += 1
        values.append((len(seq) - 1) / rounds)
    return float(np.mean(values))


# ------------------------------------------------------------------------- (a) end to end


def test_training_raises_acceptance_length(tiny_target, sampled_rows, tmp_path):
    prompts = [p.tolist() for p in np.random.RandomState(1).randint(0, V, (16, 4))]
    config = TrainConfig(seq_len=64, batch_size=8, steps=300, lr=1e-2, draft_vocab_size=V,
                         eval_every=0, eval_max_new_tokens=32, checkpoint_every=300,
                         log_every=50)
    result = train(tiny_target, sampled_rows, tmp_path / "run", config, eval_prompts=prompts,
                   progress=False)
    evals = [e["acceptance_length"] for e in result.log if "acceptance_length" in e]
    untrained, trained = evals[0], evals[-1]
    greedy = eaglejax.generate(prompts, target=tiny_target, max_new_tokens=32)
    inverse = np.argsort(PERM)
    copy_al = _chain_al([g.token_ids for g in greedy], lambda t: t)
    permutation_al = _chain_al([g.token_ids for g in greedy], lambda t: int(inverse[t]))
    # Measured: untrained 1.00, trained 2.81; drafting by copying the last token 1.36, by
    # the context-free permutation 2.20. Untrained, each draft token matches the target's
    # greedy choice with probability about 1/64 (AL about 1.02). Trained AL > 2.3 needs 1.3
    # accepted draft tokens per round over ~16 x 25 rounds: impossible by chance at 1/64 a
    # token, and beating both context-free drafters by 0.3 shows the head learned the
    # target's dependence on the context.
    assert untrained < 1.1
    assert trained > 2.3, (untrained, trained)
    assert trained > max(copy_al, permutation_al) + 0.3, (trained, copy_al, permutation_al)
    steps = [e for e in result.log if "step_acc" in e]
    assert steps[-1]["step_acc"][0] > steps[0]["step_acc"][0] + 0.2
    assert steps[-1]["loss"] < steps[0]["loss"]
    # The written head is the trained one.
    loaded = eaglejax.load_draft(result.out / "head", target=tiny_target)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(result.draft.params)):
        np.testing.assert_array_equal(a, b)
    # bit-identical parameters in the same compiled loop: exactly the AL the log holds (which
    # rounds it to 4 decimals)
    assert round(acceptance_length(loaded, prompts, max_new_tokens=32), 4) == trained


# ------------------------------------------------------------------------------ (b) resume


def test_crash_then_resume_gives_identical_parameters(tiny_target, sampled_rows, tmp_path,
                                                      monkeypatch, capsys):
    config = TrainConfig(seq_len=64, batch_size=4, steps=10, lr=1e-3, draft_vocab_size=48,
                         checkpoint_every=3, log_every=1, eval_every=0)
    straight = train(tiny_target, sampled_rows, tmp_path / "a", config, progress=False)

    real_step = trainer._train_step

    def crashing_step(*args):
        step, calls = real_step(*args), []

        def run(*inputs):
            calls.append(1)
            if len(calls) == 8:
                raise RuntimeError("simulated crash")
            return step(*inputs)
        return run

    monkeypatch.setattr(trainer, "_train_step", crashing_step)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_target, sampled_rows, tmp_path / "b", config, progress=False)
    monkeypatch.undo()
    assert not (tmp_path / "b" / "head").exists()
    capsys.readouterr()
    resumed = train(tiny_target, sampled_rows, tmp_path / "b", config, progress=False)
    assert "resuming at step 6" in capsys.readouterr().err  # steps 7 and 8 were lost
    for a, b in zip(jax.tree.leaves(straight.draft.params), jax.tree.leaves(resumed.draft.params)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(straight.draft.d2t, resumed.draft.d2t)

    def curve(log):
        return [(e["step"], e["loss"], e["step_acc"], e["tokens_seen"]) for e in log]
    assert curve(resumed.log) == curve(straight.log)
    assert [e["step"] for e in resumed.log] == list(range(1, 11))
    # A finished run returns its head without training again.
    again = train(tiny_target, sampled_rows, tmp_path / "b", config, progress=False)
    for a, b in zip(jax.tree.leaves(again.draft.params), jax.tree.leaves(resumed.draft.params)):
        np.testing.assert_array_equal(a, b)


def test_constant_schedule_run_can_be_extended(tiny_target, sampled_rows, tmp_path, capsys):
    """A constant-lr run trained 6 steps, then extended to 10, equals a straight 10-step run;
    the 6-step head is kept beside the new one."""
    config = TrainConfig(seq_len=64, batch_size=4, steps=10, lr=1e-3, draft_vocab_size=48,
                         schedule="constant", warmup_steps=2, checkpoint_every=3,
                         log_every=1, eval_every=0)
    straight = train(tiny_target, sampled_rows, tmp_path / "a", config, progress=False)
    short = train(tiny_target, sampled_rows, tmp_path / "b", dataclasses.replace(config, steps=6),
                  progress=False)
    capsys.readouterr()
    extended = train(tiny_target, sampled_rows, tmp_path / "b", config, progress=False)
    assert "resuming at step 6" in capsys.readouterr().err
    for a, b in zip(jax.tree.leaves(straight.draft.params), jax.tree.leaves(extended.draft.params)):
        np.testing.assert_array_equal(a, b)
    kept = eaglejax.load_draft(tmp_path / "b" / "head-step6", target=tiny_target)
    for a, b in zip(jax.tree.leaves(kept.params), jax.tree.leaves(short.draft.params)):
        np.testing.assert_array_equal(a, b)
    assert [e["step"] for e in extended.log] == list(range(1, 11))
    for run in ("b", "a/head"):  # with its head, or killed before writing it
        if run == "a/head":
            shutil.rmtree(tmp_path / run)
        with pytest.raises(InputError, match="already trained 10 steps"):
            train(tiny_target, sampled_rows, tmp_path / run.split("/")[0],
                  dataclasses.replace(config, steps=8), progress=False)
    # A cosine run's schedule depends on its length: changing steps is refused.
    cosine = dataclasses.replace(config, schedule="cosine")
    train(tiny_target, sampled_rows, tmp_path / "c", dataclasses.replace(cosine, steps=6),
          progress=False)
    with pytest.raises(EaglejaxError, match=r"settings\.steps \(6 then, 10 now\)"):
        train(tiny_target, sampled_rows, tmp_path / "c", cosine, progress=False)


def test_fine_tuning_starts_from_the_given_head_and_keeps_its_vocabulary(
        tiny_target, sampled_rows, tmp_path):
    config = TrainConfig(seq_len=64, batch_size=4, steps=6, lr=1e-2, draft_vocab_size=48,
                         checkpoint_every=3, log_every=1, eval_every=0)
    first = train(tiny_target, sampled_rows, tmp_path / "first", config, progress=False)
    # The same parameters over target ids 16..63: not the data's 48 most frequent tokens.
    shifted = dataclasses.replace(first.draft, d2t=jnp.full(48, 16, jnp.int32))
    still = dataclasses.replace(config, steps=2, lr=1e-12, warmup_steps=0)
    tuned = train(tiny_target, sampled_rows, tmp_path / "tuned", still, init_head=shifted,
                  progress=False)
    fresh = train(tiny_target, sampled_rows, tmp_path / "fresh", still, progress=False)
    np.testing.assert_array_equal(tuned.draft.d2t, shifted.d2t)
    assert not np.array_equal(fresh.draft.d2t, shifted.d2t)
    # two updates of lr 1e-12 move a parameter by at most its last rounding
    for a, b, c in zip(*(jax.tree.leaves(r.draft.params) for r in (tuned, first, fresh))):
        assert_close_scaled(a, b, units=ONE_ROUNDING_UNITS)
        assert a.shape != c.shape or scaled_error(c, b) > 1000 * ONE_ROUNDING_UNITS
    with pytest.raises(EaglejaxError, match=r"init_head"):  # the run records its start
        train(tiny_target, sampled_rows, tmp_path / "tuned", still, init_head=first.draft,
              progress=False)
    with pytest.raises(InputError, match=r"draft_vocab_size 48 \(settings: 40\)"):
        train(tiny_target, sampled_rows, tmp_path / "other",
              dataclasses.replace(still, draft_vocab_size=40), init_head=first.draft,
              progress=False)


def test_run_directory_is_never_hijacked(tmp_path):
    identity = {"settings": {"lr": 1e-4, "steps": 10}, "data": "abc"}
    run = open_run(tmp_path / "run", identity)
    assert open_run(run, identity) == run
    with pytest.raises(EaglejaxError, match=r"settings\.lr \(0\.0001 then, 0\.001 now\)"):
        open_run(run, {**identity, "settings": {"lr": 1e-3, "steps": 10}})
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(EaglejaxError, match="not an eaglejax training run"):
        open_run(foreign, identity)
    assert (foreign / "notes.txt").read_text() == "keep me"


# ------------------------------------------------------------- (c) training-time test


def _head_variants(target: Target):
    """A 2-layer head as `new_eagle3_draft` makes it, and one with q/k/v biases, q/k norms
    and random norm weights (every branch of the unrolled layer)."""
    plain = new_eagle3_draft(target, num_layers=2, scale=0.1)
    decoder = dataclasses.replace(plain.config.decoder, attention_bias=True, qk_norm=True)
    config = dataclasses.replace(plain.config, decoder=decoder, norm_before_residual=True)
    params = head_init_params(config, jax.random.PRNGKey(3), scale=0.1)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.2 * jax.random.normal(jax.random.PRNGKey(len(str(path))), x.shape)
        if "norm" in jax.tree_util.keystr(path) else x, params)
    return [(plain.config, plain.params), (config, params)]


@functools.partial(jax.jit, static_argnums=(1,))
def _chain_step(params, config, target_params, cache, token, hidden):
    """One decoding chain step: the head on its own previous hidden state, with its cache."""
    out = draft_forward(params, config, target_params, token[:, None], hidden[:, None],
                        cache.lengths[:, None], cache, from_features=False, attn_impl="xla")
    return out.cache._replace(lengths=cache.lengths + 1), out.hidden[:, 0]


def test_unrolled_steps_equal_the_decoding_chain(tiny_target):
    """Step k at root t of the TTT unroll is exactly what decoding computes for the k-th
    chain step after catching up to t (draft cache of positions 0..t, then k single-token
    steps feeding back the head's own hidden state), given the same tokens."""
    length, steps = 12, 5
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, V, (1, length)), jnp.int32)
    drafted = jnp.concatenate([tokens[:, 1:], jnp.zeros((1, 1), jnp.int32)], axis=1)
    positions = jnp.arange(length)[None]
    for config, params in _head_variants(tiny_target):
        features = tiny_target.features(tokens, config.tap_layers)
        hiddens = _unroll(params, config, tiny_target.params, drafted, features, positions,
                          segment_mask(jnp.ones((1, length), jnp.int32)), steps)
        # Catch-up as decoding does it: one causal pass, keep the first root + 1 rows.
        caught_up = draft_forward(params, config, tiny_target.params, drafted, features,
                                  positions, attn_impl="xla")
        d = config.decoder
        empty = kv_cache.init_cache(d.num_layers, 1, 32, d.num_kv_heads, d.head_dim, jnp.float32)
        for root in range(length - steps):
            cache = kv_cache.append(empty, caught_up.k_new, caught_up.v_new,
                                    jnp.array([root + 1]))
            hidden = caught_up.hidden[:, root]
            # Step k has been through k + 1 head steps: noise at most 2.5 units.
            assert_close_scaled(hiddens[0][:, root], hidden, units=FORWARD_UNITS)
            for k in range(1, steps):
                cache, hidden = _chain_step(params, config, tiny_target.params, cache,
                                            drafted[:, root + k], hidden)
                assert_close_scaled(hiddens[k][:, root], hidden, units=FORWARD_UNITS,
                                    depth=k + 1)


def test_packed_segments_do_not_see_each_other(tiny_target):
    config, params = _head_variants(tiny_target)[1]
    rs = np.random.RandomState(2)
    first, second = rs.randint(0, V, 7), rs.randint(0, V, 9)
    rows = pack([Example(first.astype(np.int32), np.ones(7, bool)),
                 Example(second.astype(np.int32), np.ones(9, bool))], 20)
    assert rows.segments.tolist() == [[1] * 7 + [2] * 9 + [0] * 4]
    assert rows.positions[0, 7:16].tolist() == list(range(9))

    def unrolled(tokens, segments, positions):
        tokens, segments, positions = (jnp.asarray(a)[None] for a in (tokens, segments, positions))
        batch = Batch(tokens, segments, positions, segments > 0)
        features = eaglejax.models.llama.forward(
            tiny_target.params, tiny_target.config, tokens, positions,
            mask=segment_mask(segments), tap_layers=config.tap_layers).taps
        drafted = jnp.concatenate([batch.tokens[:, 1:], jnp.zeros((1, 1), jnp.int32)], axis=1)
        return _unroll(params, config, tiny_target.params, drafted, features, positions,
                       segment_mask(segments), 3)

    packed = unrolled(rows.tokens[0], rows.segments[0], rows.positions[0])
    alone = unrolled(second.astype(np.int32), np.ones(9, np.int32), np.arange(9))
    # Noise at most 2.3 units. Negative control: the same row with one segment id for both
    # sequences (the second sees the first) fails the check, by 3.8 million units or more.
    leaky = unrolled(rows.tokens[0], (rows.segments[0] > 0).astype(np.int32), rows.positions[0])
    depth = tiny_target.config.num_layers + 1  # the target's layers, then k + 1 head steps
    for k in range(3):  # roots whose step-k token lies inside the second sequence
        assert_close_scaled(packed[k][0, 7:16 - 1 - k], alone[k][0, :9 - 1 - k],
                            units=FORWARD_UNITS, depth=depth + k)
        with pytest.raises(AssertionError, match="noise units"):
            assert_close_scaled(leaky[k][0, 7:16 - 1 - k], alone[k][0, :9 - 1 - k],
                                units=FORWARD_UNITS, depth=depth + k)


def test_ttt_loss_matches_a_direct_computation(tiny_target):
    """The target signal against each packed sequence scored alone, and the per-step soft
    cross entropy and accuracy against an explicit loop over roots: step k at root t counts
    iff token t+2+k exists, is supervised and lies in t's segment, and the target's argmax
    at t+1+k is in the draft vocabulary."""
    draft_vocab = np.sort(np.random.RandomState(4).choice(V, 40, replace=False))
    draft = new_eagle3_draft(tiny_target, used_tokens=draft_vocab, scale=0.3)
    t2d = np.full(V, -1, np.int32)
    t2d[draft_vocab] = np.arange(40)
    rs = np.random.RandomState(3)
    rows = pack([Example(rs.randint(0, V, n).astype(np.int32), rs.rand(n) < 0.7)
                 for n in (9, 6, 12, 10)], 16)
    batch = Batch(*(jnp.asarray(a) for a in dataclasses.astuple(rows)))
    signal = jax.jit(target_signal, static_argnums=(1, 3))(
        tiny_target.params, tiny_target.config, batch, draft.config.tap_layers,
        jnp.asarray(draft_vocab), jnp.asarray(t2d))
    probs, draft_argmax = np.asarray(signal.probs), np.asarray(signal.draft_argmax)
    for r in range(len(rows)):
        for segment in range(1, rows.segments[r].max() + 1):
            where = np.flatnonzero(rows.segments[r] == segment)
            logits = np.asarray(tiny_target.logits(rows.tokens[r, where][None]))[0]
            # A softmax moves by at most the noise of its logits (4 layers deep): the scale
            # is the logits' magnitude, not the probabilities'. Noise at most 0.7 units.
            assert_close_scaled(probs[r, where], jax.nn.softmax(logits[:, draft_vocab], axis=-1),
                                units=FORWARD_UNITS, depth=tiny_target.config.num_layers,
                                scale=np.abs(logits[:, draft_vocab]).max())
            np.testing.assert_array_equal(draft_argmax[r, where], t2d[logits.argmax(-1)])
    assert (draft_argmax == -1).any() and (draft_argmax >= 0).any()

    steps = 3
    total, (losses, accuracies) = jax.jit(ttt_loss, static_argnums=(1, 5))(
        draft.params, draft.config, tiny_target.params, batch, signal, steps)
    drafted = jnp.concatenate([batch.tokens[:, 1:], jnp.zeros((len(rows), 1), jnp.int32)], 1)
    hiddens = _unroll(draft.params, draft.config, tiny_target.params, drafted,
                      signal.features, batch.positions, segment_mask(batch.segments), steps)
    for k in range(steps):
        log_q = np.asarray(jax.nn.log_softmax(
            head_logits(draft.params, draft.config, {}, hiddens[k]), axis=-1))
        cross_entropy, hits, count = 0.0, 0, 0
        for r in range(len(rows)):
            segments = rows.segments[r]
            for t in range(rows.seq_len - 2 - k):
                label = draft_argmax[r, t + 1 + k]
                if (segments[t] and segments[t + 2 + k] == segments[t]
                        and rows.loss_mask[r, t + 2 + k] and label >= 0):
                    cross_entropy -= np.sum(probs[r, t + 1 + k] * log_q[r, t])
                    hits += int(log_q[r, t].argmax() == label)
                    count += 1
        assert count > 5
        assert_close_scaled(losses[k], cross_entropy / count, units=FORWARD_UNITS)  # 0.65 units
        # a float32 mean of 0/1 hits: the count is exact, the division rounds once
        assert_close_scaled(accuracies[k], hits / count, units=ONE_ROUNDING_UNITS, scale=1.0)
        assert abs(float(accuracies[k]) - (hits + 1) / count) > 1 / (2 * count)  # one hit more
    assert_close_scaled(total, sum(0.8**k * losses[k] for k in range(steps)),
                        units=FORWARD_UNITS)


# ------------------------------------------------------------- (c) vocabulary and loss mask


def test_draft_vocab_picks_the_most_frequent_supervised_tokens():
    counts = np.array([5, 0, 9, 9, 1, 0, 7, 2])
    vocab = vocab_from_counts(counts, 4)
    assert vocab.used.tolist() == [0, 2, 3, 6]  # 9, 9, 7, 5; the tie 2/3 by id
    assert (vocab.used == np.arange(4) + vocab.d2t).all()  # i + d2t[i] is the target id
    assert vocab.t2d.tolist() == [0, -1, 1, 2, -1, -1, 3, -1]
    assert vocab.coverage == pytest.approx(30 / 33)
    # Never-seen ids fill a vocabulary larger than the ids seen, lowest id first.
    assert vocab_from_counts(counts, 7).used.tolist() == [0, 1, 2, 3, 4, 6, 7]
    with pytest.raises(InputError, match="draft vocabulary size"):
        vocab_from_counts(counts, 9)
    # Only supervised tokens count: token 3 is frequent but never in the loss mask.
    rows = pack([Example(np.array([3, 3, 3, 3, 1, 2, 2], np.int32),
                         np.array([0, 0, 0, 0, 1, 1, 1], bool))], 8)
    vocab = select_draft_vocab(rows, 6, 2)
    assert vocab.used.tolist() == [1, 2] and vocab.coverage == 1.0
    assert select_draft_vocab(rows, 6, 1).coverage == pytest.approx(2 / 3)


def test_loss_mask_covers_exactly_the_assistant_turns(chatml):
    conv = Conversation("c1", (("system", "Be brief."), ("user", "Name a colour."),
                               ("assistant", "Blue, like the sky."), ("user", "Another?"),
                               ("assistant", "Green 🌿."), ("user", "unanswered")), "test:1")
    ex = tokenize_conversation(conv, chatml)

    def decode(ids):
        return chatml.decode(ids.tolist(), skip_special_tokens=False)
    full = chatml.apply_chat_template([{"role": r, "content": c} for r, c in conv.messages[:5]],
                                      add_generation_prompt=False)
    assert decode(ex.tokens) == full  # the trailing user turn is dropped
    assert ex.tokens.tolist() == chatml.encode(full)  # piecewise = whole here (ChatML)
    starts = np.flatnonzero(np.diff(ex.loss_mask.astype(int)) == 1) + 1
    ends = np.flatnonzero(np.diff(np.append(ex.loss_mask, False).astype(int)) == -1) + 1
    spans = [decode(ex.tokens[a:b]) for a, b in zip(starts, ends)]
    assert spans == ["Blue, like the sky.<|im_end|>\n", "Green 🌿.<|im_end|>\n"]
    assert decode(ex.tokens[:starts[0]]).endswith("<|im_start|>assistant\n")
    # Without a system turn the template adds its default one, unsupervised.
    ex = tokenize_conversation(Conversation("c2", (("user", "Hi"), ("assistant", "Hello!")),
                                            "test:2"), chatml)
    assert decode(ex.tokens[ex.loss_mask]) == "Hello!<|im_end|>\n"
    assert "SmolLM" in decode(ex.tokens[~ex.loss_mask])


def test_truncation_and_packing(chatml):
    long = Conversation("a", (("user", "Hi"), ("assistant", "word " * 300)), "t:1")
    short = Conversation("b", (("user", "Hi"), ("assistant", "Yes.")), "t:2")
    no_answer = Conversation("c", (("user", "Hi"),), "t:3")
    examples = tokenize_all([long, short, no_answer, short], chatml, 64)
    assert [len(e.tokens) for e in examples] == [64, 35, 35]  # "c" has nothing to learn
    rows = pack(examples, 80)
    assert len(rows) == 2 and rows.seq_len == 80
    assert rows.segments[1].tolist() == [1] * 35 + [2] * 35 + [0] * 10
    assert rows.positions[1, 35:70].tolist() == list(range(35))
    assert not rows.loss_mask[0, 64:].any() and not rows.loss_mask[1, 70:].any()
    with pytest.raises(InputError, match="more than seq_len"):
        pack(examples, 40)


def test_looping_replies_are_cut_where_they_start_repeating(chatml):
    """A reply that falls into a loop ends just before its first repeated 8-gram; the
    prompt may repeat itself freely (it is not supervised), and a reply without repeats
    is kept whole."""
    loop = Conversation("l", (("user", "go on go on go on go on go on"),
                              ("assistant", "The answer is that the sea is blue. " * 6)), "t:1")
    plain = Conversation("p", (("user", "go on go on go on go on go on"),
                               ("assistant", "One two three four five six seven eight.")), "t:2")
    [whole_loop, whole_plain] = tokenize_all([loop, plain], chatml, 512)
    [cut_loop, cut_plain] = tokenize_all([loop, plain], chatml, 512, cut_repeats=8)
    np.testing.assert_array_equal(cut_plain.tokens, whole_plain.tokens)
    end = len(cut_loop.tokens)
    np.testing.assert_array_equal(cut_loop.tokens, whole_loop.tokens[:end])
    # Cut inside the second cycle, just where the next 8 tokens would repeat earlier ones.
    cycle = len(chatml.encode("The answer is that the sea is blue. "))
    reply_start = int(np.argmax(whole_loop.loss_mask))
    assert reply_start + cycle <= end < reply_start + 2 * cycle + 2
    grams = {tuple(cut_loop.tokens[i:i + 8]) for i in range(end - 7)}
    assert tuple(whole_loop.tokens[end:end + 8]) in grams
    assert not any(tuple(cut_loop.tokens[i:i + 8]) in {tuple(cut_loop.tokens[j:j + 8])
                                                       for j in range(i)}
                   for i in range(reply_start, end - 7))
    # The rule on ids: [1 2 3 4] recurs at index 6, so the example ends there.
    tokens = np.array([5, 6, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2])
    assert first_repeat(tokens, np.ones(12, bool), 4) == 6
    assert first_repeat(tokens, np.zeros(12, bool), 4) == 12  # nothing supervised, nothing cut


def test_template_that_rewrites_history_is_refused():
    from tokenizers import Tokenizer as Backend
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    backend = Backend(WordLevel({"[unk]": 0, "u": 1, "a": 2, "x": 3}, unk_token="[unk]"))
    backend.pre_tokenizer = Whitespace()
    # Earlier assistant turns are rendered differently from the last one.
    template = ("{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}x "
                "{% else %}{{ m.role[0] }} {{ m.content }} {% endif %}{% endfor %}"
                "{% if add_generation_prompt %}a {% endif %}")
    tokenizer = Tokenizer(backend, chat_template=template)
    conv = Conversation("c", (("user", "u"), ("assistant", "a"), ("user", "u"),
                              ("assistant", "a")), "data.jsonl:7")
    with pytest.raises(InputError, match=r"data\.jsonl:7: .*renders a conversation prefix"):
        tokenize_conversation(conv, tokenizer)


# ------------------------------------------------------------------------- (d) bad input


def _record(*turns):
    return json.dumps({"id": "x", "conversations": [{"from": f, "value": v} for f, v in turns]})


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "expected an object with a 'conversations' list"),
    (json.dumps({"id": "x", "conversations": [{"from": "human"}]}),
     r"conversations\[0\] must be an object with a string 'value'"),
    (_record(("human", "hi"), ("bard", "hello")), r"conversations\[1\] has 'from' 'bard'"),
])
def test_malformed_record_names_file_and_line(tmp_path, bad, message):
    path = tmp_path / "data.jsonl"
    path.write_text(_record(("human", "hi"), ("gpt", "hello")) + "\n\n" + bad + "\n")
    with pytest.raises(InputError, match=rf"{path}:3: {message}"):
        read_conversations(path)
    gz = tmp_path / "data.jsonl.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    with pytest.raises(InputError, match=rf"{gz}:3: "):
        read_conversations(gz)
    assert len(read_conversations(gz, limit=1)) == 1  # reading stops before the bad line


def test_unreadable_data_files(tmp_path):
    with pytest.raises(InputError, match="not found"):
        read_conversations(tmp_path / "missing.jsonl")
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(gzip.compress(b'{"conversations": []}\n' * 50)[:-20])
    with pytest.raises(InputError, match=rf"{broken}: cannot read"):
        read_conversations(broken)


def test_cli_reports_the_bad_line(tmp_path, capsys):
    path = tmp_path / "chats.jsonl"
    path.write_text(_record(("human", "hi"), ("gpt", "hello")) + "\n" + "{oops\n")
    code = main(["train-draft", "--data", str(path), "--out", str(tmp_path / "run"),
                 "--steps", "1", "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"eaglejax: error: {path}:2: not valid JSON")
    assert not (tmp_path / "run").exists()


def test_bad_training_settings():
    with pytest.raises(InputError, match="batch_size must be an integer >= 1"):
        TrainConfig(batch_size=0)
    with pytest.raises(InputError, match="seq_len .* at least ttt_length"):
        TrainConfig(seq_len=8, ttt_length=7)
    with pytest.raises(InputError, match="schedule must be one of"):
        TrainConfig(schedule="linear")
    with pytest.raises(InputError, match="constant schedule needs explicit warmup_steps"):
        TrainConfig(schedule="constant")


# -------------------------------------------------------------------------- regeneration


def test_regeneration_is_cached_and_resumes(chatml, tmp_path, monkeypatch):
    """Assistant turns come from the target (here a random one with SmolLM2's tokenizer);
    the cache is reused, a torn write is repaired and resumed, foreign files are kept."""
    config = ModelConfig("llama", chatml.vocab_size, 32, 64, 1, 2, 1, 16)
    # A third of the ids stop a reply, so replies end on their own or at max_new_tokens.
    target = Target(config, init_params(config, jax.random.PRNGKey(0), scale=0.5), chatml,
                    "random-with-chatml", tuple(range(2, chatml.vocab_size, 3)))
    conversations = [
        Conversation(str(i), (("system", "Be brief."), ("user", f"Question {i}?"),
                              ("assistant", "original"), ("user", "And then?"),
                              ("assistant", "original")), f"d:{i}")
        for i in range(5)]
    regen = RegenConfig(temperature=1.0, max_new_tokens=6, max_context=256, num_slots=2)
    fresh = regenerate(conversations, target, "data-digest", regen, tmp_path, progress=False)
    for before, after in zip(conversations, fresh):
        # The system and user turns are kept; each user turn is followed by a new reply; a
        # reply cut by max_new_tokens ends the conversation.
        roles = [r for r, _ in after.messages]
        assert roles in (["system", "user", "assistant"],
                         ["system", "user", "assistant", "user", "assistant"])
        assert [m for m in after.messages if m[0] != "assistant"] == [
            m for m in before.messages if m[0] != "assistant"][:len(roles) // 2 + 1]
        assert "original" not in [c for r, c in after.messages if r == "assistant"]
    assert {len(c.messages) for c in fresh} == {3, 5}
    one_slot = dataclasses.replace(regen, num_slots=1)  # continuous batching changes nothing
    assert [c.messages for c in regenerate(conversations, target, "data-digest", one_slot,
                                           tmp_path / "one-slot", progress=False)] == [
        c.messages for c in fresh]
    cache = next(tmp_path.glob("regenerated-*.jsonl"))
    assert len(cache.read_text().splitlines()) == 1 + 5

    def no_generation(*args, **kwargs):
        raise AssertionError("the cache should have been used")
    monkeypatch.setattr("eaglejax.training.regenerate.Engine", no_generation)
    assert [c.messages for c in regenerate(conversations, target, "data-digest", regen,
                                           tmp_path, progress=False)] == [
        c.messages for c in fresh]
    monkeypatch.undo()
    # Killed while writing the third batch: the torn line is cut, the rest regenerated.
    lines = cache.read_text().splitlines(keepends=True)
    cache.write_text("".join(lines[:5]) + lines[5][:10])
    resumed = regenerate(conversations, target, "data-digest", regen, tmp_path, progress=False)
    assert [c.messages for c in resumed] == [c.messages for c in fresh]
    # Other settings use another file; a foreign file at the cache's name is refused.
    other = dataclasses.replace(regen, temperature=0.5)
    regenerate(conversations[:1], target, "data-digest", other, tmp_path, progress=False)
    assert len(list(tmp_path.glob("regenerated-*.jsonl"))) == 2
    cache.write_text("my notes\n")
    with pytest.raises(InputError, match="refusing to overwrite"):
        regenerate(conversations, target, "data-digest", regen, tmp_path, progress=False)
    assert cache.read_text() == "my notes\n"


def test_regeneration_blocks_mix_greedy_and_sampled_replies(chatml, tmp_path):
    """prepare_rows with blocks: the first conversations regenerated greedily, the rest
    sampled, each block in its own cache (so either can grow without touching the other)."""
    from eaglejax.training.pipeline import prepare_rows

    config = ModelConfig("llama", chatml.vocab_size, 32, 64, 1, 2, 1, 16)
    target = Target(config, init_params(config, jax.random.PRNGKey(0), scale=0.5), chatml,
                    "random-with-chatml", tuple(range(2, chatml.vocab_size, 3)))
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"id": str(i), "conversations": [
        {"from": "human", "value": f"Question {i}?"}, {"from": "gpt", "value": "original"}]})
        + "\n" for i in range(5)))
    greedy = RegenConfig(temperature=0.0, max_new_tokens=6, max_context=256, num_slots=2)
    sampled = dataclasses.replace(greedy, temperature=1.0)
    cache = tmp_path / "cache"
    mixed = prepare_rows(target, data, seq_len=64, regen=[(0, greedy), (3, sampled)],
                         regen_cache=cache, progress=False)
    assert len(list(cache.glob("regenerated-*.jsonl"))) == 2
    all_greedy = prepare_rows(target, data, seq_len=64, regen=greedy, regen_cache=cache,
                              progress=False)
    # Rows pack one short conversation each here: the first three are the greedy ones.
    np.testing.assert_array_equal(mixed.tokens[:3], all_greedy.tokens[:3])
    assert (mixed.tokens[3:] != all_greedy.tokens[3:]).any()
    # Another model regenerates (regen_target): its replies, as if it were the target.
    other = dataclasses.replace(target, params=init_params(config, jax.random.PRNGKey(1),
                                                           scale=0.5))
    by_other = prepare_rows(target, data, seq_len=64, regen=greedy, regen_cache=cache,
                            regen_target=other, progress=False)
    np.testing.assert_array_equal(by_other.tokens, prepare_rows(
        other, data, seq_len=64, regen=greedy, regen_cache=cache, progress=False).tokens)
    assert (by_other.tokens != all_greedy.tokens).any()
    with pytest.raises(InputError, match=r"regen blocks must start at conversation 0"):
        prepare_rows(target, data, seq_len=64, regen=[(1, greedy)], regen_cache=cache)


def test_data_order_is_a_function_of_the_step():
    epoch = np.concatenate([trainer.batch_rows(s, 4, 10, seed=3) for s in range(5)])
    assert sorted(epoch[:10]) == list(range(10)) and sorted(epoch[10:]) == list(range(10))
    assert (epoch[:10] != epoch[10:]).any()  # each epoch is a new permutation
    np.testing.assert_array_equal(trainer.batch_rows(2, 4, 10, seed=3), epoch[8:12])
    assert (trainer.batch_rows(0, 10, 10, seed=4) != epoch[:10]).any()


def test_warm_start_reads_the_deepest_tap_through_the_target_output_layer(tiny_target):
    """`from_target`: with the head's decoder layer silenced, its logits are the target's
    own output layer applied to the deepest tapped residual stream (the "logit lens")."""
    from eaglejax.models.llama import forward, lm_head, rms_norm

    used = np.arange(0, tiny_target.config.vocab_size, 2)
    draft = new_eagle3_draft(tiny_target, used_tokens=used, from_target=True)
    layer = draft.params["layers"][0]
    silent = dict(layer, wo=jnp.zeros_like(layer["wo"]), w_down=jnp.zeros_like(layer["w_down"]))
    draft = dataclasses.replace(draft, params=dict(draft.params, layers=[silent]))
    tokens = jnp.asarray([[3, 9, 27, 5, 11, 40]])
    taps = draft.target_features(tokens)
    got = np.asarray(draft.logits(tokens, taps))[..., used]
    deepest = max(draft.config.tap_layers)
    out = forward(tiny_target.params, tiny_target.config, tokens, jnp.arange(6)[None],
                  tap_layers=(deepest,))
    lens = lm_head(tiny_target.params, rms_norm(out.taps, tiny_target.params["final_norm"],
                                                tiny_target.config.rms_norm_eps))
    assert_close_scaled(got, np.asarray(lens)[..., used], units=FORWARD_UNITS)  # 2.5 units
    assert not np.shares_memory(np.asarray(draft.params["final_norm"]),
                                np.asarray(tiny_target.params["final_norm"]))


def test_peagle_training_raises_parallel_acceptance_length(tiny_target, sampled_rows,
                                                           tmp_path):
    """P-EAGLE (`mask_token_id`): K=4 draft tokens per forward learned from mask slots; the
    parallel chain's AL rises far above chance, each depth's accuracy rises, and the head
    reloads with its mask slot."""
    prompts = [p.tolist() for p in np.random.RandomState(1).randint(0, V, (16, 4))]
    config = TrainConfig(seq_len=64, batch_size=8, steps=300, lr=1e-2, draft_vocab_size=V,
                         ttt_length=4, eval_every=0, eval_max_new_tokens=32,
                         eval_num_draft_tokens=4, checkpoint_every=300, log_every=50,
                         mask_token_id=V - 1)
    result = train(tiny_target, sampled_rows, tmp_path / "run", config, eval_prompts=prompts,
                   progress=False)
    evals = [e["acceptance_length"] for e in result.log if "acceptance_length" in e]
    untrained, trained = evals[0], evals[-1]
    # Measured: untrained 1.02, trained 2.36. Untrained, each draft token matches the
    # greedy target with probability ~1/64. The next-token slot alone accepts at most one
    # draft token a round (AL <= 2): above 2.1 the mask slots, which read no token of
    # their own, predict the tokens after it.
    assert untrained < 1.1
    assert trained > 2.1, (untrained, trained)
    steps = [e for e in result.log if "step_acc" in e]
    for depth in range(4):
        assert steps[-1]["step_acc"][depth] > steps[0]["step_acc"][depth] + 0.1, depth
    loaded = eaglejax.load_draft(result.out / "head", target=tiny_target)
    assert loaded.config.mask_token_id == V - 1 and not loaded.config.own_embedding
    assert "mask_embed" in loaded.params  # the mask token's learned embedding alone
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(result.draft.params)):
        np.testing.assert_array_equal(a, b)
