"""DFlash training (`eaglejax.training.block_objective`, the trainer's DFlash runs).

Oracle: the `speculators` package's own DFlash training forward and loss
(`DFlashDraftModel._backbone_forward`: its anchors, its attention mask as its eager path
builds it, its layers and readout; `compute_metrics` with its KL loss and slot decay), on a
drafter it saved itself (`save_pretrained`) and eaglejax loaded: with the full vocabulary,
and with a reduced one (its own lm_head, targets restricted to the draft vocabulary). The
training forward proposes, for every anchor, what decoding's block forward proposes after
that context, with typed layers (sliding windows, causal or not, that hide context and
block keys); a short run on the tiny target raises the acceptance length of DFlash
decoding.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eaglejax
from eaglejax import InputError
from eaglejax.cli import main
from eaglejax.draft.config import LayerAttention
from eaglejax.draft.dflash import block_logits, context_kv
from eaglejax.draft.draft import new_dflash_draft
from eaglejax.draft.head import head_logits
from eaglejax.models import kv_cache
from eaglejax.models.llama import lm_head, rms_norm
from eaglejax.training.block_objective import anchored_blocks, dflash_loss, sample_anchors
from eaglejax.training.trainer import TrainConfig, acceptance_length, train
from eaglejax.training.ttt import Batch, TargetSignal
from hf_oracle import make_hf_model
from test_training import V as TINY_V
from test_training import make_tiny_target, sample_rows
from tolerances import FORWARD_UNITS, ONE_ROUNDING_UNITS, assert_close_scaled

V, MASK, BLOCK, GAMMA = 97, 96, 4, 3.0
# One packed row: (segment, prompt tokens, reply tokens) per conversation, then padding.
ROW = [(1, 6, 14), (2, 10, 12)]
PADDING = 6


def _row(seed: int) -> Batch:
    """A packed row of ROW's conversations: prompts unsupervised, replies supervised."""
    rs = np.random.RandomState(seed)
    segments, positions, loss_mask = [], [], []
    for segment, prompt, reply in ROW:
        segments += [segment] * (prompt + reply)
        positions += list(range(prompt + reply))
        loss_mask += [False] * prompt + [True] * reply
    segments += [0] * PADDING
    positions += [0] * PADDING
    loss_mask += [False] * PADDING
    tokens = rs.randint(0, V - 1, len(segments))
    return Batch(*(jnp.asarray(np.array(x)[None]) for x in
                   (tokens.astype(np.int32), np.int32(segments), np.int32(positions),
                    np.array(loss_mask))))


def _speculators_drafter(directory, hf_target, used=None):
    """A random 2-layer DFlash drafter built and saved by speculators, reading out through
    `hf_target`'s embedding, final norm and head, or, with `used` (sorted target ids), a
    random lm_head of its own over those tokens (its t2d/d2t from `load_vocab_mappings`,
    its targets the verifier's logits of those tokens)."""
    import torch
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash.config import DFlashSpeculatorConfig
    from speculators.models.dflash.core import DFlashDraftModel
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    layer = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                        vocab_size=V, max_position_embeddings=512, rms_norm_eps=1e-6)
    layer._attn_implementation = "eager"
    proposal = GreedyTokenProposalConfig(speculative_tokens=BLOCK - 1)
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=V if used is None else len(used),
        block_size=BLOCK, aux_hidden_state_layer_ids=[1, 2], mask_token_id=MASK,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[proposal], default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(directory),
                                    architectures=["Qwen3ForCausalLM"])))
    torch.manual_seed(4)
    model = DFlashDraftModel(config).float().eval()
    rows = hf_target.lm_head.weight
    if used is not None:
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[torch.tensor(used)] = True
        model.load_vocab_mappings(t2d, torch.tensor(used - np.arange(len(used))))
        rows = rows[t2d]
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight")
                    else 0.1 * torch.randn_like(p))
        model.embed_tokens.weight.copy_(hf_target.model.embed_tokens.weight)
        if used is None:
            model.lm_head.weight.copy_(rows)
        model.verifier_lm_head.weight.copy_(rows)
        model.verifier_norm.weight.copy_(hf_target.model.norm.weight)
    model.save_pretrained(directory / "drafter")
    return model


def _assert_loss_and_slot_accuracies_equal_speculators(tmp_path, used=None):
    """eaglejax's `dflash_loss` on the drafter speculators saved (`_speculators_drafter`)
    equals speculators' `_backbone_forward` and `compute_metrics` on one packed row; the
    target's distributions restricted to `used` and renormalised, as `target_signal` gives
    them."""
    import torch
    from speculators.losses import resolve_loss_config
    from speculators.models.dflash.metrics import compute_metrics

    hf_target = make_hf_model("qwen3", tmp_path / "target", seed=3, vocab_size=V)
    oracle = _speculators_drafter(tmp_path, hf_target, used)
    target = eaglejax.load_target(tmp_path / "target")
    draft = eaglejax.load_draft(tmp_path / "drafter", target=target)
    assert (draft.config.block_size, draft.config.mask_token_id) == (BLOCK, MASK)
    used = np.arange(V) if used is None else used
    assert np.array_equal(np.arange(len(used)) + np.asarray(draft.d2t), used)

    batch = _row(seed=0)
    rs = np.random.RandomState(1)
    length = batch.tokens.shape[1]
    features = rs.randn(1, length, draft.config.feature_size).astype(np.float32)
    last_hidden = rs.randn(1, length, 64).astype(np.float32)  # the target's, before its norm
    logits = lm_head(target.params, rms_norm(jnp.asarray(last_hidden),
                                             target.params["final_norm"], 1e-6))
    signal = TargetSignal(jnp.asarray(features), jax.nn.softmax(logits[..., used], axis=-1),
                          jnp.argmax(logits, axis=-1))
    anchors = int(np.sum(np.array(batch.loss_mask)))  # more than the valid ones: all are taken
    loss, (_, accuracies) = jax.jit(dflash_loss, static_argnums=(1, 6))(
        draft.params, draft.config, target.params, batch, signal, jax.random.PRNGKey(0),
        anchors, GAMMA)

    with torch.no_grad():
        document_ids = torch.tensor(np.where(batch.segments > 0, batch.segments, -1))
        out_logits, targets, mask, _ = oracle._backbone_forward(
            torch.tensor(features), torch.tensor(np.array(batch.tokens), dtype=torch.long),
            torch.tensor(np.array(batch.loss_mask), dtype=torch.long),
            torch.tensor(last_hidden), document_ids,
            torch.tensor(np.array(batch.positions), dtype=torch.long), max_anchors=anchors)[1:]
        want, metrics = compute_metrics(out_logits, targets, mask, BLOCK, gamma=GAMMA,
                                        loss_config=resolve_loss_config("kl_div", "eager"))
    assert out_logits.shape[-1] == targets.shape[-1] == len(used)
    assert_close_scaled(float(loss), float(want), units=FORWARD_UNITS, depth=len(used))
    want_accuracy = [float(metrics[f"position_{k}_acc_sum"] / metrics[f"position_{k}_acc_total"])
                     for k in range(1, BLOCK)]
    assert_close_scaled(np.asarray(accuracies), want_accuracy, units=ONE_ROUNDING_UNITS,
                        scale=1.0, what="slot accuracies")  # means of counts


def test_loss_and_slot_accuracies_equal_speculators(tmp_path):
    _assert_loss_and_slot_accuracies_equal_speculators(tmp_path)


def test_reduced_vocabulary_loss_and_slot_accuracies_equal_speculators(tmp_path):
    """The twin with a draft vocabulary of 40 tokens: the drafter's own lm_head, and
    targets from the verifier's logits of those tokens only."""
    used = np.sort(np.random.RandomState(6).choice(V, 40, replace=False))
    _assert_loss_and_slot_accuracies_equal_speculators(tmp_path, used)


def test_anchors_are_distinct_valid_positions():
    batch = _row(seed=0)
    valid_positions = {a for a in range(batch.tokens.shape[1] - 1)
                       if batch.loss_mask[0, a] and batch.loss_mask[0, a + 1]
                       and batch.segments[0, a] == batch.segments[0, a + 1]}
    for count in (5, len(valid_positions), len(valid_positions) + 7):
        anchors, valid = sample_anchors(jax.random.PRNGKey(count), batch, count)
        taken = np.asarray(anchors)[0][np.asarray(valid)[0]]
        assert len(set(taken.tolist())) == len(taken) == min(count, len(valid_positions))
        assert set(taken.tolist()) <= valid_positions


def test_training_forward_proposes_what_decoding_proposes():
    """Every anchor's block in the training forward gives the logits decoding's block
    forward gives over a cache holding the context before the anchor; its layers typed (a
    non-causal window of 3 < BLOCK, then a causal one of 5), so that the windows hide keys
    of the context and of the block."""
    target = make_tiny_target()
    draft = new_dflash_draft(target, num_layers=2, block_size=BLOCK, mask_token_id=TINY_V - 1,
                             seed=1, scale=0.1)
    c = dataclasses.replace(draft.config, layer_attention=(LayerAttention(3),
                                                           LayerAttention(5, True)))
    rs = np.random.RandomState(2)
    length = 24
    tokens = rs.randint(0, TINY_V, (1, length)).astype(np.int32)
    features = target.features(tokens, c.tap_layers)
    positions = jnp.arange(length)[None]
    batch = Batch(jnp.asarray(tokens), jnp.ones((1, length), jnp.int32), positions,
                  jnp.ones((1, length), bool))
    anchors = jnp.array([[3, 11, 17]])
    hidden = jax.jit(anchored_blocks, static_argnums=1)(draft.params, c, target.params, batch,
                                                        features, anchors)
    got = head_logits(draft.params, c, target.params, hidden[:, :, 1:])
    d = c.decoder
    keys, values = context_kv(draft.params, c, features, positions)

    @jax.jit
    def decoding_block(anchor):  # the cache holds every row, valid up to the anchor
        cache = kv_cache.init_cache(d.num_layers, 1, 32, d.num_kv_heads, d.head_dim,
                                    jnp.float32, heads_axis=None)
        cache = kv_cache.append(cache, keys, values, anchor[None])
        block = jnp.where(jnp.arange(BLOCK) == 0, batch.tokens[0, anchor], c.mask_token_id)
        logits, _ = block_logits(draft.params, c, target.params, block[None],
                                 anchor + jnp.arange(BLOCK)[None], cache)
        return logits[0]

    for i, anchor in enumerate(anchors[0]):
        assert_close_scaled(got[0, i], decoding_block(anchor), units=FORWARD_UNITS,
                            depth=d.num_layers)


def test_dflash_training_raises_acceptance_length(tmp_path):
    target = make_tiny_target()
    rows = sample_rows(target, 128)
    prompts = [p.tolist() for p in np.random.RandomState(1).randint(0, TINY_V, (16, 4))]
    config = TrainConfig(seq_len=64, batch_size=8, steps=200, lr=1e-2, block_size=BLOCK,
                         mask_token_id=TINY_V - 1, num_layers=2, num_anchors=16,
                         eval_every=0, eval_max_new_tokens=32, checkpoint_every=200,
                         log_every=50)
    result = train(target, rows, tmp_path / "run", config, eval_prompts=prompts,
                   progress=False)
    evals = [e["acceptance_length"] for e in result.log if "acceptance_length" in e]
    # Measured: 1.02 untrained, 2.0 after 200-300 steps (K = 3). Untrained, a draft matches
    # the target's greedy token with probability about 1/64.
    assert evals[0] < 1.1 and evals[-1] > 1.6, evals
    steps = [e for e in result.log if "step_acc" in e]
    assert len(steps[-1]["step_acc"]) == BLOCK - 1
    assert steps[-1]["loss"] < steps[0]["loss"]
    loaded = eaglejax.load_draft(result.out / "head", target=target)
    assert loaded.dflash and loaded.config.block_size == BLOCK
    assert round(acceptance_length(loaded, prompts, max_new_tokens=32), 4) == evals[-1]


@pytest.mark.parametrize("fields, match", [
    (dict(block_size=8), "needs block_size >= 2 and a mask_token_id"),
    (dict(block_size=1, mask_token_id=3), "needs block_size >= 2"),
    (dict(block_size=64, mask_token_id=3), "block_size < seq_len"),
    (dict(block_size=8, mask_token_id=3, num_anchors=65), "num_anchors <= seq_len"),
])
def test_bad_dflash_settings_are_refused(fields, match):
    with pytest.raises(InputError, match=match):
        TrainConfig(seq_len=64, **fields)


def test_dflash_settings_keep_other_runs_identities():
    """Runs started before DFlash existed resume: their identities do not gain its fields."""
    eagle, peagle = TrainConfig(), TrainConfig(mask_token_id=3)
    for config in (eagle, peagle):
        assert not {"block_size", "num_anchors", "loss_decay_gamma"} & set(config.identity())
    dflash = dataclasses.replace(peagle, block_size=8)
    assert {"block_size", "num_anchors", "loss_decay_gamma"} <= set(dflash.identity())
    assert "draft_vocab_size" not in dflash.identity()


@pytest.mark.parametrize("argv, message", [
    (["--block-size", "8"], "--block-size needs --method dflash"),
    (["--method", "dflash", "--block-size", "1"], "--block-size"),
    (["--mask-token-id", "3"], "--mask-token-id needs --method peagle or dflash"),
])
def test_cli_refuses_misplaced_dflash_flags(tmp_path, capsys, argv, message):
    data = tmp_path / "data.jsonl"
    data.write_text("")
    assert main(["train-draft", "--data", str(data), "--out", str(tmp_path / "run"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
