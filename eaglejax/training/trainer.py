"""The draft-head training loop (EAGLE-3, P-EAGLE, DFlash): AdamW, a jitted step, resumable
runs.

The frozen target runs inside every step (its taps and next-token distributions are
never stored). A run lives in one directory (see `run.py`); killed at any point, the
same call continues from its last checkpoint and ends with bit-identical parameters.
Each checkpoint records a CRC-32 of its state; a damaged one is set aside with a warning
and the run resumes from the one before.
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
import sys
import time
import warnings
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm

from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.draft.config import DraftConfig
from eaglejax.draft.draft import Draft, new_dflash_draft, new_eagle3_draft
from eaglejax.draft.head import to_target_ids
from eaglejax.draft.loading import load_draft
from eaglejax.errors import InputError, LoadError
from eaglejax.fingerprints import draft_fingerprint, target_fingerprint
from eaglejax.generate import generate
from eaglejax.loading.orbax_io import describe_failure, drop_failed_restore_debris
from eaglejax.models.llama import Params
from eaglejax.models.placement import replicate, split_rows
from eaglejax.sharding.mesh import mesh_context
from eaglejax.target import Target
from eaglejax.training.data import PackedRows
from eaglejax.training.block_objective import dflash_loss
from eaglejax.training.run import append_log, open_run, read_log, truncate_log
from eaglejax.training.ttt import Batch, peagle_loss, target_signal, ttt_loss
from eaglejax.training.vocab import (
    DraftVocab,
    select_draft_vocab,
    supervised_token_counts,
    vocab_from_used,
)
from eaglejax.validation import bounded, check_fields

SCHEDULES = ("cosine", "constant")
DEFAULT_DRAFT_VOCAB = 8192  # an EAGLE-3 or P-EAGLE head's (a DFlash drafter's: the whole)
# Settings that do not change the trained parameters (a resumed run may change them).
BOOKKEEPING = ("checkpoint_every", "keep_checkpoints", "eval_every", "eval_max_new_tokens",
               "eval_num_draft_tokens", "log_every")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of a run. Optimiser: AdamW (betas b1, b2; weight decay on matrices
    only) after global-norm gradient clipping; learning rate linear from 0 to `lr` over
    `warmup_steps` (None: 5% of `steps`), then (`schedule`) "cosine" down to
    `lr * final_lr_fraction` at `steps`, or "constant" at `lr`. A constant schedule does
    not depend on `steps`, so such a run can be extended: run it again with more steps.
    `init_from_target`: warm-start the head's output side from the target (see
    `new_eagle3_draft(from_target=True)`). `draft_vocab_size`: the head predicts that many
    of the most frequent supervised tokens (`draft_vocab`; None: the method's default),
    trained on the target's next-token distributions restricted to them and renormalised.
    `mask_token_id` trains a P-EAGLE head instead (`ttt.peagle_loss`): `ttt_length` mask
    depths, a share max(cod_rate^d, cod_floor) of roots at depth d, the mask token's own
    embedding learned (`mask_embed`, starting from the target's row).
    `block_size` (with `mask_token_id`) trains a DFlash drafter of `num_layers` layers
    (`block_objective.dflash_loss`): `num_anchors` blocks per row, slot k weighted
    exp(-(k-1)/loss_decay_gamma); by default it reads out through the target's head (the
    whole vocabulary), and with `draft_vocab_size` < V through its own lm_head, started
    from the target's output rows of its tokens (`new_dflash_draft(used_tokens=...)`);
    `ttt_length` and `step_weight` do not apply; `init_from_target` starts its layers from
    the target's last ones (`new_dflash_draft(from_target=True)`)."""

    seq_len: int = bounded(1024, "integer", 1, help="tokens per packed training row")
    batch_size: int = bounded(4, "integer", 1, help="rows per step")
    steps: int = bounded(10_000, "integer", 1, help="optimiser steps")
    lr: float = bounded(1e-4, "real", 0.0, low_open=True, help="peak learning rate")
    warmup_steps: int | None = bounded(
        None, "integer", 0, help="linear warm-up steps (default: 5%% of --steps; required "
                                 "with --schedule constant)")
    schedule: str = "cosine"
    final_lr_fraction: float = bounded(0.1, "real", 0.0, 1.0)
    weight_decay: float = bounded(0.01, "real", 0.0, help="AdamW weight decay (matrices)")
    grad_clip: float = bounded(0.5, "real", 0.0, low_open=True,
                               help="global gradient-norm clip")
    b1: float = 0.9
    b2: float = 0.95
    ttt_length: int = bounded(7, "integer", 1, help="training-time-test unroll steps")
    step_weight: float = 0.8
    draft_vocab_size: int | None = bounded(
        None, "integer", 1, help=f"the head's output vocabulary, the most frequent supervised "
                                 f"tokens (default: {DEFAULT_DRAFT_VOCAB} for eagle3 and "
                                 f"peagle, the whole vocabulary for dflash)")
    num_layers: int = bounded(1, "integer", 1, help="head decoder layers")
    init_from_target: bool = False
    seed: int = bounded(0, "seed", help="initialisation and data order")
    checkpoint_every: int = bounded(50, "integer", 1, help="steps between checkpoints")
    keep_checkpoints: int = bounded(2, "integer", 1)
    eval_every: int = bounded(500, "integer", 0, help="steps between acceptance-length "
                                                     "evaluations (0: start and end only)")
    eval_max_new_tokens: int = bounded(64, "integer", 1,
                                       help="new tokens per evaluated question")
    eval_num_draft_tokens: int = bounded(5, "integer", 1,
                                         help="chain length evaluated (DFlash: its block)")
    log_every: int = bounded(10, "integer", 1)
    mask_token_id: int | None = bounded(None, "integer", 0)
    cod_rate: float = bounded(0.7, "real", 0.0, 1.0, low_open=True,
                              help="peagle: depth d is trained on a share cod_rate^d of roots")
    cod_floor: float = bounded(0.2, "real", 0.0, 1.0,
                               help="peagle: the least share of roots trained at any depth")
    block_size: int = bounded(0, "integer", 0, help="dflash: the block a forward fills (the "
                                                    "last accepted token, then masks)")
    num_anchors: int = bounded(64, "integer", 1, help="dflash: blocks trained per row")
    loss_decay_gamma: float = bounded(7.0, "real", 0.0, low_open=True,
                                      help="dflash: block slot k's loss weight is "
                                           "exp(-(k-1)/gamma)")

    def __post_init__(self):
        check_fields(self)
        if self.block_size:
            if self.block_size < 2 or self.mask_token_id is None:
                raise InputError(f"a DFlash run needs block_size >= 2 and a mask_token_id, "
                                 f"got {self.block_size} and {self.mask_token_id}")
            if not self.block_size < self.seq_len or self.num_anchors > self.seq_len:
                raise InputError(f"a DFlash run needs block_size < seq_len and num_anchors <= "
                                 f"seq_len, got {self.block_size}, {self.num_anchors} and "
                                 f"seq_len {self.seq_len}")
        elif self.seq_len < self.ttt_length + 3:
            raise InputError(f"seq_len ({self.seq_len}) must be at least ttt_length + 3")
        if self.schedule not in SCHEDULES:
            raise InputError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.schedule == "constant" and self.warmup_steps is None:
            raise InputError("a constant schedule needs explicit warmup_steps (the default, "
                             "5% of steps, would change when the run is extended)")
        if self.warmup_steps is not None and not self.warmup_steps < self.steps:
            raise InputError(f"warmup_steps must be in [0, steps), got {self.warmup_steps}")

    @property
    def method(self) -> str:
        """"eagle3", "peagle" or "dflash": the drafter the run trains."""
        if self.block_size:
            return "dflash"
        return "eagle3" if self.mask_token_id is None else "peagle"

    def draft_vocab(self, vocab_size: int) -> int:
        """The draft vocabulary size of this run for a target of `vocab_size` tokens:
        `draft_vocab_size`, or the method's default (`DEFAULT_DRAFT_VOCAB`; DFlash: all)."""
        if self.draft_vocab_size is not None:
            return self.draft_vocab_size
        return vocab_size if self.method == "dflash" else DEFAULT_DRAFT_VOCAB

    @property
    def warmup(self) -> int:
        return self.steps // 20 if self.warmup_steps is None else self.warmup_steps

    @property
    def extendable(self) -> bool:
        """Whether the parameters after step n are independent of `steps`."""
        return self.schedule == "constant"

    def identity(self) -> dict[str, Any]:
        """The settings that determine the trained parameters (`steps` only bounds an
        extendable run)."""
        ignored = BOOKKEEPING + (("steps",) if self.extendable else ())
        if self.method != "peagle":
            ignored += ("cod_rate", "cod_floor")
        if self.method == "eagle3":  # as before P-EAGLE's settings existed
            ignored += ("mask_token_id",)
        if self.method == "dflash":  # a full vocabulary: as before it could be reduced
            ignored += ("ttt_length", "step_weight") + (
                ("draft_vocab_size",) if self.draft_vocab_size is None else ())
        else:  # as before DFlash's settings existed
            ignored += ("block_size", "num_anchors", "loss_decay_gamma")
        settings = {k: v for k, v in dataclasses.asdict(self).items() if k not in ignored}
        if self.method != "dflash" and self.draft_vocab_size is None:  # as before the
            settings["draft_vocab_size"] = DEFAULT_DRAFT_VOCAB  # default depended on the method
        return settings

    def core(self) -> TrainConfig:
        """This config with the bookkeeping settings at their defaults (a compile-cache key)."""
        fields = TrainConfig.__dataclass_fields__
        return dataclasses.replace(self, **{k: fields[k].default for k in BOOKKEEPING})


class TrainState(NamedTuple):
    params: Params
    opt_state: optax.OptState


@dataclasses.dataclass
class TrainResult:
    """draft: the trained head (also written to `out/head`); log: every log entry of the run."""

    draft: Draft
    log: list[dict[str, Any]]
    out: Path


def learning_rate(config: TrainConfig) -> optax.Schedule:
    """Linear warm-up, then cosine decay or constant (see `TrainConfig`)."""
    if config.schedule == "constant":
        if not config.warmup:
            return optax.constant_schedule(config.lr)
        return optax.join_schedules([optax.linear_schedule(0.0, config.lr, config.warmup),
                                     optax.constant_schedule(config.lr)], [config.warmup])
    return optax.warmup_cosine_decay_schedule(
        0.0, config.lr, config.warmup, config.steps, config.lr * config.final_lr_fraction)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """Gradient clipping, then AdamW with the run's schedule (no decay on norm vectors)."""
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(learning_rate(config), b1=config.b1, b2=config.b2,
                    weight_decay=config.weight_decay,
                    mask=lambda params: jax.tree.map(lambda p: p.ndim > 1, params)))


@functools.lru_cache(maxsize=8)
def _train_step(draft_config: DraftConfig, target_config, config: TrainConfig, attn_impl: str):
    """The jit-compiled step for these static settings (cached, so repeated runs reuse it)."""
    optimizer = make_optimizer(config)

    def step(state: TrainState, target_params: Params, batch: Batch, used: jax.Array,
             t2d: jax.Array, key: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        signal = target_signal(target_params, target_config, batch, draft_config.tap_layers,
                               used, t2d, attn_impl)

        def loss_fn(params: Params):
            if draft_config.kind == "dflash":
                return dflash_loss(params, draft_config, target_params, batch, signal, key,
                                   config.num_anchors, config.loss_decay_gamma)
            if draft_config.parallel:
                return peagle_loss(params, draft_config, target_params, batch, signal,
                                   config.ttt_length, key, config.cod_rate, config.cod_floor)
            return ttt_loss(params, draft_config, target_params, batch, signal,
                            config.ttt_length, config.step_weight)

        (loss, (losses, accuracies)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            state.params)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        metrics = {"loss": loss, "step_loss": losses, "step_acc": accuracies,
                   "grad_norm": optax.global_norm(grads)}
        return TrainState(optax.apply_updates(state.params, updates), opt_state), metrics

    return jax.jit(step, donate_argnums=(0,))


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, num_rows: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(num_rows)


def batch_rows(step: int, batch_size: int, num_rows: int, seed: int) -> np.ndarray:
    """Row indices of batch `step`: the data is read in epochs, each an independent
    permutation seeded by (seed, epoch), so the order depends on the step alone."""
    samples = np.arange(step * batch_size, (step + 1) * batch_size)
    return np.array([_permutation(seed, int(s // num_rows), num_rows)[s % num_rows]
                     for s in samples])


def acceptance_length(draft: Draft, prompts: Sequence[str] | Sequence[Sequence[int]], *,
                      num_draft_tokens: int = 5, max_new_tokens: int = 64) -> float:
    """Mean greedy acceptance length (bonus token included) of `draft` over `prompts`,
    decoded as one batch (a DFlash drafter drafts at most its block less one)."""
    method = ("dflash" if draft.dflash else "parallel" if draft.parallel else "chain")
    if draft.dflash:
        num_draft_tokens = min(num_draft_tokens, draft.config.block_size - 1)
    results = generate(list(prompts), target=draft.target, draft=draft,
                       speculative=SpecConfig(num_draft_tokens=num_draft_tokens, method=method),
                       max_new_tokens=max_new_tokens)
    values = [r.metrics.acceptance_length for r in results if r.metrics.acceptance_length]
    return float(np.mean(values)) if values else 1.0


def _draft_vocab(target: Target, rows: PackedRows, config: TrainConfig,
                 init_head: Draft | None) -> DraftVocab:
    """The `config.draft_vocab` most frequent supervised tokens of `rows` (all of them for
    a full-vocabulary DFlash drafter), or `init_head`'s vocabulary (checked against
    `config`)."""
    dflash = config.method == "dflash"
    vocab_size = target.config.vocab_size
    size = config.draft_vocab(vocab_size)
    if init_head is None:
        return select_draft_vocab(rows, vocab_size, size)
    c = init_head.config
    wanted = {"kind": ("dflash" if dflash else "eagle3", c.kind),
              "num_layers": (config.num_layers, c.decoder.num_layers),
              "mask_token_id": (config.mask_token_id, c.mask_token_id),
              "block_size": (config.block_size, c.block_size),
              "draft_vocab_size": (size, c.draft_vocab_size)}
    wrong = [f"{name} {have!r} (settings: {want!r})" for name, (want, have) in wanted.items()
             if want != have]
    if wrong:
        raise InputError(f"init head {init_head.source}: {', '.join(wrong)}")
    if config.init_from_target:
        raise InputError("init_from_target and an init head exclude each other")
    if init_head.target.config != target.config:
        raise InputError(f"init head {init_head.source} was loaded for a different target "
                         f"than {target.source}")
    used = to_target_ids(np.arange(c.draft_vocab_size), np.asarray(init_head.d2t))
    return vocab_from_used(used, supervised_token_counts(rows, vocab_size))


def _latest_checkpoint(out: Path) -> int:
    """The step of the run's latest checkpoint (0 if none)."""
    steps = [int(p.name) for p in (out / "checkpoints").glob("*") if p.name.isdigit()]
    return max(steps, default=0)


def _host_copy(tree: Any) -> Any:
    """Host copies that survive the donation of the device buffers (async checkpoints)."""
    return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def _checksum(tree: Any) -> int:
    """CRC-32 of every array's bytes, in tree order."""
    crc = 0
    for leaf in jax.tree.leaves(tree):
        crc = zlib.crc32(np.ascontiguousarray(leaf).reshape(-1).view(np.uint8), crc)
    return crc


def _restore(manager: ocp.CheckpointManager, step: int, like: TrainState
             ) -> tuple[TrainState, int]:
    """(state, tokens seen) of checkpoint `step`, checked against its recorded checksum."""
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    state = TrainState(*restored.state)
    recorded = restored.meta.get("state_crc32")  # absent from checkpoints of older versions
    if recorded is not None and recorded != _checksum(state):
        raise ValueError("its state differs from when it was saved (CRC-32 mismatch)")
    return state, restored.meta["tokens_seen"]


def _set_aside(out: Path, step: int) -> Path:
    """Move checkpoint `step` to out/damaged-checkpoints/ (under a new name: never over
    anything), so that the resumed run can write that step again."""
    aside = out / "damaged-checkpoints"
    aside.mkdir(exist_ok=True)
    target, n = aside / str(step), 1
    while target.exists():
        target, n = aside / f"{step}.{n}", n + 1
    (out / "checkpoints" / str(step)).rename(target)
    return target


def _resume(manager: ocp.CheckpointManager, out: Path, fresh: TrainState
            ) -> tuple[int, TrainState, int]:
    """(step, state, tokens seen) from the latest intact checkpoint, or (0, `fresh`, 0) when
    there is none. Damaged checkpoints after it are set aside with a warning; when every
    checkpoint is damaged, nothing is moved and LoadError says so."""
    damaged: list[tuple[int, str]] = []
    drop_failed_restore_debris()
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            state, tokens_seen = _restore(manager, step, fresh)
        except Exception as err:  # orbax raises many kinds for damaged files
            damaged.append((step, describe_failure(err)))
            continue
        for bad, cause in damaged:
            warnings.warn(f"{out / 'checkpoints' / str(bad)}: damaged ({cause}); moved to "
                          f"{_set_aside(out, bad)}, resuming from step {step}", stacklevel=3)
        if damaged:
            manager.reload()
        return step, state, tokens_seen
    if damaged:
        causes = "; ".join(f"step {step}: {cause}" for step, cause in damaged)
        raise LoadError(f"{out / 'checkpoints'}: no intact checkpoint ({causes}); move that "
                        f"directory aside to start the run over")
    return 0, fresh, 0


class _Meter:
    """Means of the step metrics over a log interval, and tokens/s of this session."""

    def __init__(self):
        self.sums: dict[str, np.ndarray] = {}
        self.count = 0
        self.tokens = 0
        self.seconds = 0.0

    def add(self, metrics: dict[str, np.ndarray], tokens: int, seconds: float | None) -> None:
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + np.asarray(value, np.float64)
        self.count += 1
        if seconds is not None:  # None: the session's first step, which includes compiling
            self.tokens += tokens
            self.seconds += seconds

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds else None

    def means(self) -> dict[str, Any]:
        return {k: (v / self.count).round(5).tolist() for k, v in self.sums.items()}


def _postfix(metrics: dict[str, Any], tokens_per_s: float | None) -> str:
    accuracy = "/".join(f"{a:.2f}" for a in np.atleast_1d(metrics["step_acc"]))
    speed = f" {tokens_per_s:,.0f} tok/s" if tokens_per_s else ""
    return f"loss {float(metrics['loss']):.3f} acc {accuracy}{speed}"


def train(target: Target, rows: PackedRows, out: str | Path,
          config: TrainConfig = TrainConfig(), *,
          eval_prompts: Sequence[str] | Sequence[Sequence[int]] | None = None,
          init_head: Draft | None = None, progress: bool = True) -> TrainResult:
    """Train a drafter for `target` on packed `rows` (an EAGLE-3, P-EAGLE or DFlash one:
    `config.method`), in run directory `out`: a fresh one, or (`init_head`) continue
    training an existing one, keeping its draft vocabulary (fine-tuning, e.g. on the
    target's regenerated replies).

    Starting again with the same arguments resumes from the last checkpoint (a finished
    run just returns its head). With `eval_prompts` the greedy acceptance length of a K =
    `eval_num_draft_tokens` chain is measured at the start, every `eval_every` steps and at
    the end. The head is written to `out/head` in eaglejax format.
    """
    if rows.seq_len != config.seq_len:
        raise InputError(f"rows are {rows.seq_len} tokens long but seq_len is {config.seq_len}")
    vocab = _draft_vocab(target, rows, config, init_head)
    identity = {"settings": config.identity(), "target": target_fingerprint(target),
                "data": rows.fingerprint(), "rows": len(rows),
                "draft_vocab_coverage": round(vocab.coverage, 6)}
    if init_head is not None:
        identity["init_head"] = draft_fingerprint(init_head)
    out = open_run(out, identity)
    head_dir = out / "head"
    finished = _latest_checkpoint(out)
    if finished > config.steps:  # only an extendable run's steps may differ
        raise InputError(f"{out}: this run has already trained {finished} steps; ask for at "
                         f"least {finished}")
    if head_dir.is_dir():
        if finished == config.steps or not config.extendable:
            return TrainResult(load_draft(str(head_dir), target=target), read_log(out), out)
        head_dir.rename(out / f"head-step{finished}")  # the earlier head is kept
    if init_head is None and config.method == "dflash":
        draft = new_dflash_draft(target, num_layers=config.num_layers,
                                 block_size=config.block_size,
                                 mask_token_id=config.mask_token_id, used_tokens=vocab.used,
                                 seed=config.seed, from_target=config.init_from_target)
    elif init_head is None:
        draft = new_eagle3_draft(target, used_tokens=vocab.used, num_layers=config.num_layers,
                                 from_target=config.init_from_target, seed=config.seed,
                                 mask_token_id=config.mask_token_id)
    else:
        params = jax.tree.map(lambda p: jnp.array(p, target.dtype, copy=True), init_head.params)
        draft = dataclasses.replace(init_head, params=params, target=target)
    state = TrainState(draft.params, make_optimizer(config).init(draft.params))
    step_fn = _train_step(draft.config, target.config, config.core(), target.attn_impl)
    used, t2d = jnp.asarray(vocab.used), jnp.asarray(vocab.t2d)
    mesh = target.mesh
    if mesh is not None:  # data parallel: the head replicated, each batch's rows split

        if jax.process_count() > 1:
            raise InputError("train-draft runs over the devices of one process; every process "
                             "of a multi-process run would write the same checkpoints")
        state, used, t2d = replicate((state, used, t2d), mesh)
        draft = draft.for_target(target)
    schedule = learning_rate(config)

    def evaluate(step: int, params: Params) -> float:
        current = dataclasses.replace(draft, params=params, source=f"{out} step {step}")
        value = acceptance_length(current, eval_prompts,
                                  num_draft_tokens=config.eval_num_draft_tokens,
                                  max_new_tokens=config.eval_max_new_tokens)
        append_log(out, {"step": step, "acceptance_length": round(value, 4)})
        return value

    options = ocp.CheckpointManagerOptions(max_to_keep=config.keep_checkpoints)
    with ocp.CheckpointManager(out / "checkpoints", options=options,
                               item_names=("state", "meta")) as manager:
        start, state, tokens_seen = _resume(manager, out, state)
        truncate_log(out, start)
        bar = tqdm(total=config.steps, initial=start, unit="step", disable=not progress,
                   dynamic_ncols=True)
        bar.write(f"eaglejax train-draft: run {out}, checkpoints in {out / 'checkpoints'}; "
                  f"{len(rows)} rows of {config.seq_len} tokens; draft vocabulary "
                  f"{len(vocab.used)} covers {vocab.coverage:.1%} of supervised tokens"
                  + (f"; resuming at step {start}" if start else ""), file=sys.stderr)
        if eval_prompts and start == 0:
            bar.write(f"step 0: acceptance length {evaluate(0, state.params):.3f}",
                      file=sys.stderr)
        meter, session_meter = _Meter(), _Meter()
        for step in range(start, config.steps):
            batch_np = rows.take(batch_rows(step, config.batch_size, len(rows), config.seed))
            tokens = int((batch_np.segments > 0).sum())
            arrays = dataclasses.astuple(batch_np)
            batch = Batch(*(split_rows(arrays, mesh) if mesh is not None else
                            (jnp.asarray(a) for a in arrays)))
            began = time.perf_counter()
            key = jax.random.fold_in(jax.random.PRNGKey(config.seed), step)  # COD's draws
            with mesh_context(mesh):
                state, metrics = step_fn(state, target.params, batch, used, t2d, key)
            metrics = jax.device_get(metrics)
            seconds = None if step == start else time.perf_counter() - began
            tokens_seen += tokens
            meter.add(metrics, tokens, seconds)
            session_meter.add({}, tokens, seconds)
            done = step + 1
            bar.update(1)
            bar.set_postfix_str(_postfix(metrics, session_meter.tokens_per_s), refresh=False)
            if done % config.log_every == 0 or done == config.steps:
                append_log(out, {"step": done, **meter.means(), "lr": float(schedule(step)),
                                 "tokens_seen": tokens_seen,
                                 "tokens_per_s": session_meter.tokens_per_s})
                meter = _Meter()
            if done % config.checkpoint_every == 0 or done == config.steps:
                host_state = _host_copy(state)
                manager.save(done, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(host_state),
                    meta=ocp.args.JsonSave({"step": done, "tokens_seen": tokens_seen,
                                            "samples_seen": done * config.batch_size,
                                            "seed": config.seed,
                                            "state_crc32": _checksum(host_state)})))
            if eval_prompts and config.eval_every and done % config.eval_every == 0:
                bar.write(f"step {done}: acceptance length {evaluate(done, state.params):.3f}",
                          file=sys.stderr)
        bar.close()
        manager.wait_until_finished()
    if eval_prompts and not (config.eval_every and config.steps % config.eval_every == 0):
        evaluate(config.steps, state.params)
    final = dataclasses.replace(draft, params=state.params,
                                source=f"eaglejax train-draft {out} step {config.steps}")
    partial = out / "head.partial"
    if partial.exists():
        shutil.rmtree(partial)  # a previous attempt was killed while writing the head
    final.save(str(partial))
    partial.rename(head_dir)
    return TrainResult(final, read_log(out), out)
