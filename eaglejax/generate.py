"""`eaglejax.generate()`: prompts in, `Generation` objects out."""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Sequence

import numpy as np

from eaglejax import validation
from eaglejax.decoding.adaptive import adaptive_decode, describe_mix
from eaglejax.decoding.batch import decode
from eaglejax.decoding.sampling import SamplingParams
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.decoding.speculation import AUTO, check_speculation, resolve_speculation
from eaglejax.decoding.suffix_history import remember_replies
from eaglejax.decoding.token_logprobs import TokenLogprob, check_count, row_logprobs
from eaglejax.decoding.stopping import FINISH_REASONS, FINISH_STOP
from eaglejax.draft.draft import Draft
from eaglejax.errors import InputError
from eaglejax.loading.target_loader import load_target
from eaglejax.prompting import cut_at_stop, encode_prompts, stop_criteria
from eaglejax.sharding.distributed import fetch, prompts_from_first
from eaglejax.target import Target

DEFAULT_TARGET = "smollm2-135m-instruct"


@dataclasses.dataclass
class GenerationMetrics:
    """Timings are shared by the rows of one call; tokens/s counts this row's tokens.

    `decode_tokens_per_s` excludes the first new token (it comes from the prefill).
    `compile_s` is the time this call spent compiling the prefill and decode programs (or
    loading them from the persistent compilation cache, see `eaglejax.compilation_cache`;
    about 0 when this process already compiled the same shapes); `prefill_s`, `decode_s`
    and tokens/s exclude it. On a CPU the first run of a new program still builds its
    XNNPACK (YNN) kernel pipelines (about 0.5 s for SmolLM2's prefill on 2 cores), inside
    `prefill_s`; with `speculative="auto"`, each mode's first runs in the process (a round,
    then segments of none that time its overhead, on a copy of the state) are in
    `compile_s`.
    Speculative runs add this row's verification rounds (`target_forwards` counts the
    batch's, which a row that finished early does not take part in all of) and the
    acceptance length (AL): mean tokens per verification round INCLUDING the target's bonus
    token (plain decoding would be 1.0; AL - 1 is the mean of accepted draft tokens),
    per-position acceptance (share of rounds whose accepted path
    reached draft depth d = 1..K) and the conditional rate at each depth. `speculative`
    names the shape that ran when a draft head was given; with `speculative="auto"` the
    modes and their shares of the target forwards (`auto: plain 80%, tree ... 20%`), the
    acceptance counts its speculative rounds only, and `plain_step_s` is a plain decoding
    step's time as `auto` timed it apart in this process (`decoding.adaptive`), so
    `speedup_over_plain` (decode tokens/s x that step time) is the measured speed over
    plain decoding.
    """

    prompt_tokens: int
    new_tokens: int
    compile_s: float
    prefill_s: float
    decode_s: float
    decode_tokens_per_s: float
    target_forwards: int
    batch_size: int
    verify_rounds: int | None = None
    acceptance_length: float | None = None
    acceptance_by_position: list[float] | None = None
    conditional_acceptance: list[float] | None = None
    speculative: str | None = None
    plain_step_s: float | None = None

    @property
    def speedup_over_plain(self) -> float | None:
        """With `auto`: this row's decode speed over plain decoding's (None: not known)."""
        if not self.plain_step_s or not self.decode_tokens_per_s:
            return None
        return self.decode_tokens_per_s * self.plain_step_s


def acceptance_metrics(hist: np.ndarray) -> dict[str, object]:
    """From a row's histogram of accepted draft tokens per round: its rounds, AL (tokens per
    verify round, bonus included), the share of rounds reaching each draft depth, and the
    rate of reaching depth d given d-1 was reached."""
    rounds = int(hist.sum())
    if rounds == 0:
        return {}
    reached = [float(hist[d:].sum()) for d in range(len(hist))]  # rounds accepting >= d
    return {
        "verify_rounds": rounds,
        "acceptance_length": float((hist * np.arange(1, len(hist) + 1)).sum() / rounds),
        "acceptance_by_position": [r / rounds for r in reached[1:]],
        "conditional_acceptance": [reached[d] / reached[d - 1] if reached[d - 1] else 0.0
                                   for d in range(1, len(hist))],
    }


@dataclasses.dataclass
class Generation:
    """One prompt's result. `finish_reason` is "eos", "stop" (a stop string) or "length";
    `logprobs` (when asked for) one entry per token of `token_ids`."""

    text: str | None
    token_ids: list[int]
    finish_reason: str
    metrics: GenerationMetrics
    logprobs: list[TokenLogprob] | None = None


@functools.lru_cache(maxsize=2)
def _cached_target(name: str) -> Target:
    return load_target(name, weight_dtype="auto")


def _target_source(target: object, draft: object) -> Target | str:
    """The Target to use, or the name or path to load it from (checked, not loaded)."""
    if isinstance(target, Target):
        return target
    if target is None:
        return draft.target if draft is not None else DEFAULT_TARGET
    if isinstance(target, (str, os.PathLike)):
        return os.fspath(target)
    raise InputError(f"target must be a Target, a model name or path, or None, got "
                     f"{type(target).__name__}")


def generate(prompts: str | Sequence[str] | Sequence[Sequence[int]], *,
             target: Target | str | None = None, draft: "Draft | None" = None,
             max_new_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
             top_k: int = 0, seed: int | Sequence[int] = 0, chat: bool = True,
             stop: str | Sequence[str] | None = None, ignore_eos: bool = False,
             speculative: SpecConfig | str | None = None,
             logprobs: int | None = None) -> list[Generation]:
    """Generate continuations of `prompts` (strings, rendered with the chat template when
    `chat`, or token-id lists or integer arrays used as given) in one compiled batch.

    `target`: a Target, a model name or path (loaded once and cached), or None: the
    draft's target, else the default model. Every argument is checked before a model is
    loaded (InputError naming it). temperature 0 is greedy; otherwise temperature, top_k
    (0 = off) and top_p shape the distribution that is sampled. `seed` (in [0, 2**32)) may
    be one int for every row or one per row: a row's tokens depend only on its prompt and
    its seed, never on its neighbours (sampled with "auto" or a shape that searches the
    replies decoded before, `SpecConfig.uses_history`, they depend on those too; their
    distribution never does).
    Generation stops at an EOS id (unless `ignore_eos`), a stop string (excluded from
    `.text`), or `max_new_tokens`. With a `draft` head (see `eaglejax.load_draft`) decoding
    is speculative, configured by `speculative`: a `SpecConfig` (chain, dynamic tree or
    static tree), "auto" (switch between plain decoding and a few trees while decoding,
    from the acceptance counted and the round times measured as it goes, see
    `eaglejax.decoding.autotune`) or None (the preset for this device and batch size,
    `SpecConfig.preset`). A `SpecConfig` whose method drafts without a head (suffix
    drafting, a registered plug-in: `eaglejax.decoding.drafters`) needs no `draft`; "auto"
    with no draft is `SpecConfig.suffix()` for one prompt, suffix trees against plain
    decoding for several. Greedy output is identical to
    plain decoding. With `logprobs` (0 to 20), each `Generation.logprobs` holds every
    token's log-probability under the target model and that many most likely tokens'
    (`TokenLogprob`; the same with and without speculation).
    """
    check_speculation(draft, speculative)
    logprobs = check_count("logprobs", logprobs)
    source = _target_source(target, draft)
    max_new_tokens = validation.integer("max_new_tokens", max_new_tokens, 1)
    sampling = SamplingParams.make(temperature, top_k, top_p)
    chat = validation.flag("chat", chat)
    ignore_eos = validation.flag("ignore_eos", ignore_eos)
    stop = validation.stop_strings(stop)
    prompts = validation.prompt_list(prompts)
    seeds = validation.row_seeds(seed, len(prompts))

    target = source if isinstance(source, Target) else _cached_target(source)
    criteria = stop_criteria(target, stop, ignore_eos)
    encoded, seeds = prompts_from_first(encode_prompts(prompts, target, chat), seeds)
    batch = len(encoded)

    lengths = [len(ids) for ids in encoded]
    limit = target.config.max_position_embeddings
    if target.config.sliding_window:
        limit = min(limit, target.config.sliding_window)
    for i, n in enumerate(lengths):
        if n + max_new_tokens > limit:
            raise InputError(f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens} "
                             f"that exceeds the model's context of {limit} tokens")
    speculative = resolve_speculation(target, draft, speculative, batch, auto_by_default=False)
    shape, plain_step_s = None, None
    if speculative == AUTO:
        adaptive = adaptive_decode(target, draft, encoded, seeds, sampling, max_new_tokens,
                                   criteria, logprobs=logprobs)
        run, shape = adaptive.run, describe_mix(adaptive.forwards_by_mode)
        plain_step_s = adaptive.plain_step_s
    else:
        shape = None if speculative is None else speculative.describe()
        run = decode(target, draft, encoded, seeds, sampling, max_new_tokens, criteria,
                     speculative, logprobs=logprobs)
    tokens, counts, finish, forwards, kept = fetch(
        (run.state.out.tokens, run.state.out.counts, run.state.out.finish, run.state.forwards,
         run.state.out.logprobs))
    hist = None if speculative is None else fetch(run.state.accept_hist)

    results = []
    for i in range(batch):
        ids = tokens[i, :counts[i]].tolist()
        reason = FINISH_REASONS[int(finish[i])]
        text = None
        if target.tokenizer is not None:
            ids, stop_text = cut_at_stop(target, ids, stop) if stop else (ids, None)
            if stop_text is not None:
                reason, text = FINISH_REASONS[FINISH_STOP], stop_text
            else:
                text = target.tokenizer.decode(ids)
        metrics = GenerationMetrics(
            prompt_tokens=lengths[i], new_tokens=len(ids), compile_s=run.compile_s,
            prefill_s=run.prefill_s, decode_s=run.decode_s,
            decode_tokens_per_s=(int(counts[i]) - 1) / run.decode_s if run.decode_s > 0 else 0.0,
            target_forwards=int(forwards) + 1, batch_size=batch,
            speculative=shape, plain_step_s=plain_step_s,
            **(acceptance_metrics(hist[i]) if hist is not None else {}))
        entries = None if kept is None else row_logprobs(
            tokens[i], kept.chosen[i], kept.top_ids[i], kept.top[i], 0, len(ids), logprobs)
        results.append(Generation(text, ids, reason, metrics, entries))
    if speculative == AUTO or getattr(speculative, "uses_history", False):
        remember_replies(r.token_ids for r in results)  # later drafts search them
    return results
