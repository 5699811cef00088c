"""P-EAGLE heads: read from the speculators layout (and the reference layout vLLM reads),
their K draft distributions of one forward equal those of the `speculators` package's own
P-EAGLE torch model (the oracle), and exported heads reload in speculators identically.

The oracle is speculators' training forward (`PEagleDraftModel.forward`) driven in the
inference layout: the package has no drafting entry point, so its sampler of (anchor,
depth) pairs is replaced by the one rollout inference makes: every context position at
depth 0, then K-1 mask slots at depths 1..K-1 after the last one.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.losses import resolve_loss_config
from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig
from transformers import LlamaConfig

import eaglejax
from eaglejax.draft import export_reference, export_speculators, load_draft
from eaglejax.errors import ConfigError, InputError
from tolerances import HEAD_UNITS, assert_close_scaled, frequency_bound, scaled_error

V, H, DRAFT_V, MASK = 97, 64, 60, 96
TAPS = [1, 2, 3]
K = 5


def assert_head_close(got, want, draft, what: str = "draft logits") -> float:
    """P-EAGLE logits within float32 noise of a draft-head forward as deep as the head's
    layers (tolerances.HEAD_UNITS): the same mask slots computed by speculators in
    PyTorch, by another eaglejax path, or by a reloaded export."""
    return assert_close_scaled(got, want, units=HEAD_UNITS, depth=draft.config.decoder.num_layers,
                               what=what)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from conftest import make_hf_model

    directory = tmp_path_factory.mktemp("peagle-target")
    make_hf_model("llama", directory, seed=2, num_hidden_layers=4, vocab_size=V)
    return eaglejax.load_target(directory)


def speculators_head(seed: int, norm_before_residual: bool, layers: int = 2
                     ) -> PEagleDraftModel:
    """A random P-EAGLE model of the speculators package: `layers` layers, random norms, a
    draft vocabulary of DRAFT_V random target ids."""
    torch.manual_seed(seed)
    draft_vocab = DRAFT_V
    layer = LlamaConfig(hidden_size=H, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                        max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0)
    config = PEagleSpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=draft_vocab,
        norm_before_residual=norm_before_residual, eagle_aux_hidden_state_layer_ids=TAPS,
        mask_token_id=MASK,
        speculators_config=SpeculatorsConfig(
            algorithm="peagle", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=K)],
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    model = PEagleDraftModel(config)
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 0.2)
        model.mask_hidden.normal_(0, 1.0)
        for name, p in model.named_parameters():
            if "norm" in name and "verifier" not in name:
                p.add_(0.1 * torch.randn_like(p))
    keep = torch.sort(torch.randperm(V)[:draft_vocab])[0]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[keep] = True
    model.load_vocab_mappings(t2d, keep - torch.arange(draft_vocab))
    return model.eval()


def reload_speculators(directory) -> PEagleDraftModel:
    """A saved P-EAGLE head in speculators' own classes (its `from_pretrained` needs a
    verifier path, so config and tensors are read separately)."""
    model = PEagleDraftModel(PEagleSpeculatorConfig.from_pretrained(directory))
    missing, unexpected = model.load_state_dict(load_file(directory / "model.safetensors"),
                                                strict=False)
    assert not unexpected and all(name.startswith("verifier_") for name in missing), missing
    return model.eval()


def oracle_logits(model: PEagleDraftModel, features: np.ndarray, tokens: np.ndarray
                  ) -> np.ndarray:
    """speculators' K draft-vocabulary logits [K,DV] after the context (row i: the token at
    position i+1 and the taps of position i)."""
    import speculators.models.peagle.core as core

    n = tokens.shape[1]
    anchor = torch.cat([torch.arange(n), torch.full((K - 1,), n - 1)])
    depth = torch.cat([torch.zeros(n, dtype=torch.long), torch.arange(1, K)])
    captured = {}
    hook = model.lm_head.register_forward_hook(lambda m, i, o: captured.update(logits=o))
    sampler, core.generate_cod_sample_indices = (core.generate_cod_sample_indices,
                                                 lambda **kw: (anchor, depth))
    hidden = torch.as_tensor(features)
    pad = K - 1  # the forward reads rows anchor + depth before replacing them with masks
    try:
        with torch.no_grad():
            model.forward(
                hidden_states=torch.cat([hidden, hidden.new_zeros(1, pad, hidden.shape[-1])], 1),
                input_ids=torch.cat([torch.as_tensor(tokens),
                                     torch.zeros(1, pad, dtype=torch.long)], 1),
                document_ids=torch.zeros(1, n + pad, dtype=torch.long),
                loss_mask=torch.ones(1, n + pad),
                verifier_last_hidden_states=hidden.new_zeros(1, n + pad, H), num_depths=K,
                loss_config=resolve_loss_config("kl_div", "eager"))
    finally:
        core.generate_cod_sample_indices = sampler
        hook.remove()
    return captured["logits"][0, n - 1:].numpy()


def _inputs(seed: int, n: int = 9) -> tuple[np.ndarray, np.ndarray]:
    rs = np.random.RandomState(seed)
    return (rs.randn(1, n, len(TAPS) * H).astype(np.float32),
            rs.randint(0, V - 1, (1, n)).astype(np.int64))


def _draft_columns(draft, logits: np.ndarray) -> np.ndarray:
    """eaglejax's target-vocabulary logits [..., V] at the draft vocabulary's ids."""
    ids = np.arange(draft.config.draft_vocab_size) + np.asarray(draft.d2t)
    return np.asarray(logits)[..., ids]


@pytest.mark.parametrize("norm_before_residual", [True, False])
def test_k_draft_logits_match_speculators(target, tmp_path, norm_before_residual):
    model = speculators_head(3, norm_before_residual)
    model.save_pretrained(tmp_path / "head")
    draft = load_draft(tmp_path / "head", target=target)
    assert draft.config.parallel and draft.config.mask_token_id == MASK
    assert draft.config.norm_before_residual == norm_before_residual
    features, tokens = _inputs(1)
    want = oracle_logits(model, features, tokens)
    got = _draft_columns(draft, draft.parallel_logits(tokens, features, K)[0])
    assert got.shape == want.shape == (K, DRAFT_V)
    assert_head_close(got, want, draft)
    # slot 1 is the next-token proposal an EAGLE-3 forward of the context alone gives
    assert_head_close(got[0], _draft_columns(draft, draft.logits(tokens, features)[0, -1]),
                      draft)
    # Negative control: the head read with the other norm placement fails the same check.
    flipped = dataclasses.replace(draft, config=dataclasses.replace(
        draft.config, norm_before_residual=not norm_before_residual))
    wrong = _draft_columns(flipped, flipped.parallel_logits(tokens, features, K)[0])
    assert scaled_error(wrong, want, depth=draft.config.decoder.num_layers) > 10 * HEAD_UNITS


def test_exported_heads_reload_identically(target, tmp_path):
    model = speculators_head(4, True)
    model.save_pretrained(tmp_path / "head")
    draft = load_draft(tmp_path / "head", target=target)
    features, tokens = _inputs(2)
    want = draft.parallel_logits(tokens, features, K)
    export_speculators(draft, tmp_path / "speculators")
    saved = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert saved["speculators_model_type"] == "peagle" and saved["mask_token_id"] == MASK
    reloaded = reload_speculators(tmp_path / "speculators")
    assert_head_close(oracle_logits(reloaded, features, tokens), _draft_columns(draft, want[0]),
                      draft)
    export_reference(draft_with_one_layer(target, tmp_path), tmp_path / "reference")
    for layout in ("speculators", "reference"):
        again = load_draft(tmp_path / layout, target=target)
        assert again.config.mask_token_id == MASK, layout
    again = load_draft(tmp_path / "speculators", target=target)
    np.testing.assert_array_equal(again.parallel_logits(tokens, features, K), want)


def draft_with_one_layer(target, tmp_path):
    """A one-layer P-EAGLE head (the reference layout holds one layer) saved by speculators
    and read back."""
    speculators_head(5, False, layers=1).save_pretrained(tmp_path / "one-layer")
    return load_draft(tmp_path / "one-layer", target=target)


def test_reference_layout_round_trip_keeps_the_k_logits(target, tmp_path):
    draft = draft_with_one_layer(target, tmp_path)
    export_reference(draft, tmp_path / "reference")
    again = load_draft(tmp_path / "reference", target=target)
    features, tokens = _inputs(3)
    np.testing.assert_array_equal(again.parallel_logits(tokens, features, K),
                                  draft.parallel_logits(tokens, features, K))


@pytest.mark.parametrize("key", ["ptd_token_id", "pard_token", "dspark_noise_token_id"])
def test_mask_token_under_other_keys(target, tmp_path, key):
    draft = draft_with_one_layer(target, tmp_path)
    export_reference(draft, tmp_path / "reference")
    path = tmp_path / "reference" / "config.json"
    cfg = json.loads(path.read_text())
    cfg[key] = cfg.pop("mask_token_id")
    path.write_text(json.dumps(cfg))
    assert load_draft(tmp_path / "reference", target=target).config.mask_token_id == MASK
    cfg.pop(key)
    cfg["dflash_config"] = {"mask_token_id": 7}
    path.write_text(json.dumps(cfg))
    assert load_draft(tmp_path / "reference", target=target).config.mask_token_id == 7


def test_unusable_heads_are_refused(target, tmp_path):
    draft = draft_with_one_layer(target, tmp_path)
    export_reference(draft, tmp_path / "reference")
    path = tmp_path / "reference" / "config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in cfg.items() if k != "mask_token_id"}))
    with pytest.raises(ConfigError, match="'mask_hidden' tensor .* no mask token id"):
        load_draft(tmp_path / "reference", target=target)
    path.write_text(json.dumps({**cfg, "mask_token_id": V}))
    with pytest.raises(ConfigError, match="mask token id 97 is outside"):
        load_draft(tmp_path / "reference", target=target)
    path.write_text(json.dumps({**cfg, "mask_token_id": "x"}))
    with pytest.raises(ConfigError, match="'mask_token_id' must be a non-negative token id"):
        load_draft(tmp_path / "reference", target=target)
    model = speculators_head(6, True)
    model.save_pretrained(tmp_path / "no-mask")
    spec_cfg = tmp_path / "no-mask" / "config.json"
    spec = json.loads(spec_cfg.read_text())
    spec.pop("mask_token_id")
    spec_cfg.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match="a 'peagle' head needs its mask token id"):
        load_draft(tmp_path / "no-mask", target=target)
    # mask_hidden of the wrong width: named, with both shapes
    from safetensors.numpy import load_file as load_np, save_file

    tensors = load_np(str(tmp_path / "one-layer" / "model.safetensors"))
    tensors["mask_hidden"] = tensors["mask_hidden"][..., :-1]
    save_file(tensors, str(tmp_path / "one-layer" / "model.safetensors"))
    with pytest.raises(Exception, match="mask_hidden"):
        load_draft(tmp_path / "one-layer", target=target)
    eagle3 = eaglejax.draft.draft.new_eagle3_draft(target)
    with pytest.raises(InputError, match="not a P-EAGLE head"):
        eagle3.parallel_logits(*_inputs(4)[::-1], K)


@pytest.mark.parametrize("attn_impl", ["xla", "pallas"])
def test_the_loop_drafts_what_parallel_logits_proposes(target, tmp_path, attn_impl):
    """Inside the compiled loop, the prefill and the catch-up (its mask slots in the same
    forward as the accepted block, hidden from the block's unaccepted rows) propose exactly
    the K distributions `Draft.parallel_logits` gives for the committed sequence, through
    the XLA attention and through the Pallas tree-attention kernel (interpret mode here)."""
    import jax.numpy as jnp

    from eaglejax import SpecConfig
    from eaglejax.decoding.sampling import SamplingParams
    from eaglejax.decoding import loops
    from eaglejax.decoding.loops import SpecLoop, Weights
    from eaglejax.decoding.drafters.head_state import catch_up
    from eaglejax.decoding.stopping import StopCriteria
    from eaglejax.draft.head import to_target_logits

    speculators_head(7, True).save_pretrained(tmp_path / "head")
    draft = load_draft(tmp_path / "head", target=target)
    rs = np.random.RandomState(5)
    prompt = rs.randint(0, V, (1, 11))
    loop = SpecLoop(target.config, draft.config, SpecConfig.parallel(K), attn_impl)
    state = loops.prefill(loop, Weights(target.params, draft.params, draft.d2t),
                          jnp.asarray(prompt, jnp.int32), jnp.asarray([11], jnp.int32),
                          jnp.zeros((1, 2), jnp.uint32), SamplingParams.make(), jnp.int32(8),
                          capacity=128, max_tokens=16, greedy=True, stop=StopCriteria())
    # s: the prompt, the first token, then 6 more; draft row p consumes s[p+1] and the
    # target's taps at p
    s = np.concatenate([prompt, [[int(state.last_token[0])]], rs.randint(0, V, (1, 6))], 1)
    taps = np.asarray(target.features(s, draft.config.tap_layers))
    want = draft.parallel_logits(s[:, 1:12], taps[:, :11], K)
    got = to_target_logits(state.drafter.logits, draft.d2t, V)
    assert_head_close(_draft_columns(draft, got), _draft_columns(draft, want), draft)
    # a round whose 5-row block (positions 11..15) kept 3 rows: the other 2 are garbage
    kept = 3
    garbage = np.r_[1, 1, 1, 9, 9][None, :, None]
    cache, logits, _ = catch_up(draft.params, draft.config, target.params, state.drafter.cache,
                                 jnp.asarray(s[:, 12:17], jnp.int32),
                                 jnp.asarray(taps[:, 11:16] * garbage), jnp.asarray([kept]),
                                 attn_impl, slots=K - 1)
    assert int(cache.lengths[0]) == 11 + kept
    want = draft.parallel_logits(s[:, 1:12 + kept], taps[:, :11 + kept], K)
    assert_head_close(_draft_columns(draft, to_target_logits(logits, draft.d2t, V)),
                      _draft_columns(draft, want), draft)


def test_parallel_greedy_decoding_equals_plain(target):
    """Greedy P-EAGLE decoding (chains of K=1 and 5 from one forward, lattice trees; batch
    3) is plain greedy decoding token for token."""
    from eaglejax import SpecConfig
    from eaglejax.draft.draft import new_eagle3_draft

    draft = new_eagle3_draft(target, mask_token_id=MASK, seed=1, scale=0.05)
    rs = np.random.RandomState(0)
    prompts = [rs.randint(0, V, size=rs.randint(2, 30)).tolist() for _ in range(3)]
    kwargs = dict(target=target, max_new_tokens=20, ignore_eos=True)
    plain = [g.token_ids for g in eaglejax.generate(prompts, **kwargs)]
    for k in (1, 5):
        out = eaglejax.generate(prompts, draft=draft, speculative=SpecConfig.parallel(k),
                                **kwargs)
        assert [g.token_ids for g in out] == plain, k
        assert out[0].metrics.speculative == f"parallel K={k}"
    for shape in [(3, 4, 10), (2, 5, 19)]:
        spec = SpecConfig.parallel_tree(*shape)
        out = eaglejax.generate(prompts, draft=draft, speculative=spec, **kwargs)
        assert [g.token_ids for g in out] == plain, shape
        assert out[0].metrics.speculative == "parallel tree top_k={} depth={} total={}".format(
            *shape)


def test_parallel_needs_a_parallel_head_and_is_its_default(target, capsys):
    from eaglejax import SpecConfig
    from eaglejax.draft.draft import new_eagle3_draft

    eagle3 = new_eagle3_draft(target)
    with pytest.raises(ConfigError, match="parallel K=4 needs a P-EAGLE head"):
        eaglejax.generate([[1, 2, 3]], target=target, draft=eagle3,
                          speculative=SpecConfig.parallel(4), max_new_tokens=4)
    peagle = new_eagle3_draft(target, mask_token_id=MASK)
    out = eaglejax.generate([[1, 2, 3]], target=target, draft=peagle, max_new_tokens=4)
    assert out[0].metrics.speculative == "parallel K=5"  # the CPU default for such heads
    with pytest.raises(InputError, match="mask_token_id must be an integer in"):
        new_eagle3_draft(target, mask_token_id=V)


def test_training_unroll_equals_the_k_draft_logits(target):
    """Depth d at root t of P-EAGLE's training unroll is what decoding's mask slot d
    proposes after the sequence up to t (`Draft.parallel_logits`, itself checked against
    speculators above); COD keeps a share max(0.7^d, 0.2) of the roots, nested."""
    import jax
    import jax.numpy as jnp

    from eaglejax.draft.draft import new_eagle3_draft
    from eaglejax.draft.head import head_logits
    from eaglejax.training.ttt import cod_keep, segment_mask, ttt_unroll
    from tolerances import FORWARD_UNITS

    draft = new_eagle3_draft(target, mask_token_id=MASK, seed=2, scale=0.1, num_layers=2)
    length = 10
    tokens = np.random.RandomState(1).randint(0, V, (1, length + 1))
    taps = np.asarray(target.features(tokens, draft.config.tap_layers))
    drafted, features = jnp.asarray(tokens[:, 1:], jnp.int32), jnp.asarray(taps[:, :-1])
    hiddens = jax.jit(ttt_unroll, static_argnums=(1, 7, 8))(
        draft.params, draft.config, target.params, drafted, features,
        jnp.arange(length)[None], segment_mask(jnp.ones((1, length), jnp.int32)), K, True)
    unrolled = np.stack([np.asarray(head_logits(draft.params, draft.config, target.params, h))
                         for h in hiddens])  # [K,1,T,DV]
    for root in range(length):
        want = _draft_columns(draft, draft.parallel_logits(drafted[:, :root + 1],
                                                           features[:, :root + 1], K)[0])
        # mask slots pass through 2 layers once: float32 noise of one forward
        assert_close_scaled(unrolled[:, 0, root], want, units=FORWARD_UNITS)
    kept = np.asarray(cod_keep(jax.random.PRNGKey(0), (64, 512), K))
    shares = kept.mean(axis=(1, 2))
    # each depth's share is a frequency over 64 x 512 independent draws
    bound = frequency_bound(kept[0].size)
    assert np.abs(shares - [1, 0.7, 0.49, 0.343, 0.2401]).max() <= bound
    assert abs(0.75 - 0.7) > 2 * bound  # a keep rate 0.05 off is rejected
    assert np.all(kept[1:] <= kept[:-1])  # nested


def test_parallel_tree_keeps_the_best_lattice_paths():
    """The tree holds the `total - 1` best (slot-1 token, ..., slot-d token) paths by summed
    log-probability over the lattice EAGLE-2's expansion reaches, each under its prefix."""
    import itertools

    import jax
    import jax.numpy as jnp

    from eaglejax.decoding.drafters import Root
    from eaglejax.decoding.drafters.parallel import draft_parallel_tree

    rs = np.random.RandomState(0)
    logits = jnp.asarray(rs.randn(1, 3, 12) * 2, jnp.float32)
    tree = draft_parallel_tree(Root(jnp.array([7]), logits, None, None),
                               jnp.arange(12) + 100, 12, 3, 30)
    log_probs = np.asarray(jax.nn.log_softmax(logits, axis=-1))[0]
    # with top_k = the whole draft vocabulary, the expansion keeps the best 12 frontier nodes
    # of each depth: every path of the optimal 29 extends a kept frontier node, since a
    # path's prefixes score at least as much as the path
    paths = [p for d in (1, 2, 3) for p in itertools.product(range(12), repeat=d)]
    score = {p: sum(log_probs[i, t] for i, t in enumerate(p)) for p in paths}
    best = sorted(paths, key=lambda p: -score[p])[:29]
    tokens, parents = np.asarray(tree.tokens)[0], np.asarray(tree.parents)[0]
    assert tokens[0] == 7 and parents[0] == -1

    def path_of(node):
        out = []
        while node > 0:
            out.append(int(tokens[node]) - 100)
            node = int(parents[node])
        return tuple(reversed(out))

    assert sorted(path_of(n) for n in range(1, 30)) == sorted(best)


def test_learned_mask_embedding_is_the_exported_tables_row(target, tmp_path):
    """A head trained by eaglejax learns only its mask token's embedding (`mask_embed`);
    the PyTorch layouts get it as that row of the head's own embed_tokens (the target's
    table elsewhere), which speculators and eaglejax read back to the same K logits."""
    from eaglejax.draft.draft import new_eagle3_draft

    used = np.sort(np.random.RandomState(1).choice(V, DRAFT_V, replace=False))
    draft = new_eagle3_draft(target, used_tokens=used, mask_token_id=MASK, seed=3, scale=0.05)
    table = np.asarray(target.params["embed"])
    np.testing.assert_array_equal(draft.params["mask_embed"], table[MASK])
    learned = np.random.RandomState(0).normal(0, 0.5, table.shape[1]).astype(np.float32)
    draft = dataclasses.replace(draft, params={**draft.params, "mask_embed": jnp.asarray(learned)})
    features, tokens = _inputs(4)
    want = draft.parallel_logits(tokens, features, K)
    untrained = new_eagle3_draft(target, used_tokens=used, mask_token_id=MASK, seed=3,
                                 scale=0.05)
    assert scaled_error(untrained.parallel_logits(tokens, features, K), want,
                        depth=draft.config.decoder.num_layers) > 10 * HEAD_UNITS
    export_speculators(draft, tmp_path / "speculators")
    again = load_draft(tmp_path / "speculators", target=target)
    assert again.config.own_embedding and "mask_embed" not in again.params
    exported = np.asarray(again.params["embed"])
    np.testing.assert_array_equal(exported[MASK], learned)
    np.testing.assert_array_equal(np.delete(exported, MASK, 0), np.delete(table, MASK, 0))
    assert_head_close(again.parallel_logits(tokens, features, K), want, draft)
    assert_head_close(oracle_logits(reload_speculators(tmp_path / "speculators"), features,
                                    tokens), _draft_columns(draft, want[0]), draft)
    draft.save(str(tmp_path / "native"))
    native = load_draft(tmp_path / "native", target=target)
    np.testing.assert_array_equal(native.params["mask_embed"], learned)
    np.testing.assert_array_equal(native.parallel_logits(tokens, features, K), want)


def test_eaglejax_format_keeps_the_mask_slot(target, tmp_path):
    speculators_head(8, True).save_pretrained(tmp_path / "head")
    draft = load_draft(tmp_path / "head", target=target)
    draft.save(str(tmp_path / "native"))
    again = load_draft(tmp_path / "native", target=target)
    assert again.config == draft.config
    features, tokens = _inputs(6)
    np.testing.assert_array_equal(again.parallel_logits(tokens, features, K),
                                  draft.parallel_logits(tokens, features, K))
