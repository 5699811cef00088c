"""The `eaglejax` command line: generate, bench, roofline, convert, train-draft, serve."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Sequence

import jax

from eaglejax import compilation_cache, validation
from eaglejax.bench import (
    beside_roofline,
    bench_plain,
    bench_speculative,
    describe_beside_roofline,
    profile_rounds,
)
from eaglejax.datasets import interleave_categories, mt_bench_questions
from eaglejax.decoding.output import MAX_TOP_LOGPROBS
from eaglejax.decoding.spec_config import SpecConfig
from eaglejax.draft import load_draft, load_draft_model
from eaglejax.draft.draft import new_eagle3_draft
from eaglejax.draft.formats import WRITERS
from eaglejax.draft.loading import named_verifier
from eaglejax.draft.shipped import shipped_head
from eaglejax.errors import EaglejaxError, InputError
from eaglejax.generate import generate
from eaglejax.loading.builtin import builtin_model
from eaglejax.loading.hf_export import export_hf
from eaglejax.loading.hub import ResolvedSource, is_hub_id, resolve_source
from eaglejax.loading.target_loader import load_target
from eaglejax.programs import roofline
from eaglejax.round_split import describe_split
from eaglejax.serving.prefix_cache import PREFIX_CACHE_TOKENS
from eaglejax.sharding import make_mesh
from eaglejax.sharding.distributed import initialize
from eaglejax.training.pipeline import mt_bench_prompts, prepare_rows
from eaglejax.training.regenerate import RegenConfig
from eaglejax.training.trainer import SCHEDULES, TrainConfig, train

DEFAULT_MODEL = "smollm2-135m-instruct"
MAX_WAITING = 256  # `serve`'s requests waiting for a slot before more are refused
SPECULATION_FLAGS = ("num_draft_tokens", "parallel", "tree", "static_tree", "auto_tree", "lookup",
                     "lookup_replaces", "lookup_history", "long_copy")


class _Parser(argparse.ArgumentParser):
    """argparse with eaglejax's error style: one line on stderr, exit status 2."""

    def error(self, message: str):
        self.exit(2, f"eaglejax: error: {message} (see `{self.prog} --help`)\n")


def _add_model_args(parser: argparse.ArgumentParser, weight_dtype: str | None = "auto") -> None:
    parser.add_argument("--model", default=None,
                        help="built-in name, GGUF file, Hugging Face directory, eaglejax "
                             "checkpoint or Hugging Face Hub id (org/name[@revision]; a local "
                             "path of that name wins) (default: the verifier a speculators "
                             f"--draft head names, else {DEFAULT_MODEL})")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="parameter dtype (default: float32 on CPU, bfloat16 on GPU/TPU)")
    parser.add_argument("--weight-dtype", default=weight_dtype,
                        choices=["auto", "float32", "bfloat16", "float16", "int8", "int4", "int4-sym",
                                 "gguf"],
                        help="store the weight matrices in this dtype and compute in --dtype "
                             "(bfloat16 halves the bytes a CPU decode step reads; int8 "
                             "quarters them and multiplies int8 activations, quantized in "
                             "blocks of 32; int4 stores 4-bit blocks of 32 with a scale and "
                             "a minimum (5 bits a weight), multiplied the same way; int4-sym "
                             "with a scale alone (4.5 bits, Q4_0's layout); both keep the "
                             "embedding and output head in 8-bit Q8_0 blocks; gguf "
                             "keeps a GGUF file's Q4_0/Q4_1/Q8_0 blocks as stored; see "
                             "BENCHMARKS.md for speed and agreement); auto: what decodes "
                             "fastest here (a GGUF file's blocks on CPUs with AVX-512 VNNI, "
                             "else bfloat16 on CPUs with AVX-512, else as loaded; "
                             f"default: {weight_dtype or 'as loaded'})")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="render prompts with the model's chat template (default: on)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--draft", default=None,
                        help="draft head for speculative decoding (any layout load_draft "
                             "reads; a directory or a Hugging Face Hub id)")
    parser.add_argument("--draft-model", default=None, metavar="MODEL",
                        help="instead of a head, a smaller model of the target's tokenizer "
                             "drafts (any model --model takes; the shape flags shape its "
                             "chain or dynamic tree)")
    shape = parser.add_mutually_exclusive_group()
    shape.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                       help="speculate with a chain of K draft tokens")
    shape.add_argument("--parallel", type=int, default=None, metavar="K",
                       help="a P-EAGLE head's K draft tokens from one forward (the default "
                            "for such heads: 5 on CPU, 7 on accelerators)")
    shape.add_argument("--tree", default=None, metavar="TOP_K,DEPTH,TOTAL",
                       help="speculate with an EAGLE-2 dynamic tree, e.g. 4,4,12")
    shape.add_argument("--static-tree", default=None, metavar="JSON",
                       help="speculate with a static tree of child-rank paths, "
                            "e.g. '[[0],[1],[0,0]]'")
    shape.add_argument("--suffix", nargs="?", const="4,6,4,2", default=None,
                       metavar="TOP_K,DEPTH,TOTAL[,MIN_MATCH]|auto",
                       help="suffix drafting with no draft at all: a tree of what followed "
                            "the context's latest tokens where they occurred before "
                            "(default 4,6,4,2); MIN_MATCH: rounds whose longest match is "
                            "shorter are plain steps (default 2; 0: none); 'auto': switch "
                            "between plain decoding and suffix trees while decoding, as "
                            "--auto-tree does with a draft")
    shape.add_argument("--auto-tree", action="store_true",
                       help="switch between plain decoding and a few dynamic trees while "
                            "decoding, from the acceptance and round times it measures "
                            "(speculative='auto')")
    parser.add_argument("--lookup", type=int, default=None, metavar="N",
                        help="add a branch of N tokens copied from the context (prompt lookup) "
                             "to the chain or tree given by --num-draft-tokens, --tree or "
                             "--static-tree")
    parser.add_argument("--lookup-ngram", type=int, default=3, metavar="G",
                        help="--lookup-replaces needs a match of at least G tokens (default "
                             "3; --lookup copies after the longest match, up to 8 tokens)")
    parser.add_argument("--lookup-replaces", action="store_true",
                        help="--lookup keeps the node count: where G tokens or more matched, "
                             "the branch replaces the head's N lowest-ranked nodes")
    parser.add_argument("--lookup-history", action="store_true",
                        help="--lookup also copies from the replies decoded before in this "
                             "process or server (as suffix drafting does): a request that "
                             "repeats or edits an earlier one copies from its reply")
    parser.add_argument("--long-copy", default=None, metavar="T[,G]",
                        help="with --lookup: rounds where the context matched G tokens or more "
                             "(default 8) verify the root and T copied tokens as a chain "
                             "instead of the shape's tree")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.add_argument("--no-compilation-cache", action="store_true",
                        help="do not keep compiled programs in eaglejax's persistent cache "
                             "($EAGLEJAX_CACHE/jax-compilation or ~/.cache/eaglejax/"
                             "jax-compilation; also EAGLEJAX_COMPILATION_CACHE=0)")


def _add_mesh_args(parser: argparse.ArgumentParser) -> None:
    mesh = parser.add_argument_group(
        "devices", "run over a device mesh, on this host or several (jax.distributed)")
    mesh.add_argument("--tp", type=int, default=1, help="tensor-parallel devices (heads, MLP, "
                      "vocabulary split over them)")
    mesh.add_argument("--dp", type=int, default=1, help="data-parallel devices (rows split)")
    mesh.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                      help="process 0's address, for a multi-process run (also "
                           "$EAGLEJAX_COORDINATOR)")
    mesh.add_argument("--num-processes", type=int, default=None,
                      help="processes in the run (also $EAGLEJAX_NUM_PROCESSES)")
    mesh.add_argument("--process-id", type=int, default=None,
                      help="this process's rank, 0 .. N-1 (also $EAGLEJAX_PROCESS_ID)")


def _mesh(args: argparse.Namespace):
    """Join the multi-process run the flags or environment describe, then the --tp x --dp
    mesh over every process's devices (None for one device)."""
    validation.integer("--tp", args.tp, 1)
    validation.integer("--dp", args.dp, 1)

    multi = initialize(args.coordinator, args.num_processes, args.process_id)
    if args.tp * args.dp == 1 and not multi:
        return None

    return make_mesh(tp=args.tp, dp=args.dp)


def _is_first_process() -> bool:
    return jax.process_index() == 0


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 (default) is off")
    parser.add_argument("--seed", type=int, default=0)


def _check_draft_flags(args: argparse.Namespace) -> None:
    """InputError for draft flags that exclude each other (--draft, --draft-model, --suffix,
    --no-draft where the command has it)."""
    given = [flag for flag, value in (("--draft", args.draft), ("--draft-model",
             args.draft_model), ("--suffix", args.suffix),
             ("--no-draft", getattr(args, "no_draft", False))) if value not in (None, False)]
    if len(given) > 1:
        raise InputError(f"{given[0]} and {given[1]} exclude each other")


def _wants_shipped_head(args: argparse.Namespace) -> bool:
    """Whether no flag names what drafts (or --no-draft): a built-in --model then
    speculates with the head eaglejax ships for it."""
    return not (args.draft or args.draft_model or args.suffix or args.no_draft)


def _speculation(args: argparse.Namespace):
    """The SpecConfig (or "auto", or None for the device preset) the flags ask for;
    InputError for a malformed shape or a shape flag without --draft or --draft-model."""
    _check_draft_flags(args)
    if args.suffix == "auto":
        shape = "auto"  # with no draft: suffix trees against plain decoding
    elif args.suffix is not None:
        form = "TOP_K,DEPTH,TOTAL" + (",MIN_MATCH" if args.suffix.count(",") == 3 else "")
        shape = SpecConfig.suffix(*_integers("--suffix", args.suffix, form))
    elif args.draft is None and args.draft_model is None:
        used = [name for name in SPECULATION_FLAGS if getattr(args, name) not in (None, False)]
        if used:
            raise InputError(f"{validation.cli_flag(used[0])} needs --draft HEAD or "
                             f"--draft-model MODEL (it shapes speculative decoding)")
        return None
    else:
        shape = _speculation_shape(args)
        if args.draft_model is not None and isinstance(shape, SpecConfig):
            shape = shape.drafted_by_model()
    if args.lookup is None:
        for flag in ("lookup_replaces", "lookup_history", "long_copy"):
            if getattr(args, flag):
                raise InputError(f"{validation.cli_flag(flag)} needs --lookup N")
        return shape
    if not isinstance(shape, SpecConfig):
        raise InputError("--lookup needs the shape it extends: --num-draft-tokens, --parallel, "
                         "--tree or --static-tree")
    shape = shape.with_lookup(args.lookup, args.lookup_ngram, args.lookup_replaces,
                              args.lookup_history)
    if args.long_copy is None:
        return shape
    form = "T" + (",G" if "," in args.long_copy else "")
    return shape.with_long_lookup(*_integers("--long-copy", args.long_copy, form))


def _speculation_shape(args: argparse.Namespace):
    """The chain, tree, static tree or "auto" the shape flags name (None: preset)."""
    if args.num_draft_tokens is not None:
        return SpecConfig.chain(args.num_draft_tokens)
    if args.parallel is not None:
        return SpecConfig.parallel(args.parallel)
    if args.tree is not None:
        return SpecConfig.tree(*_integers("--tree", args.tree, "TOP_K,DEPTH,TOTAL"))
    if args.static_tree is not None:
        try:
            paths = json.loads(args.static_tree)
        except json.JSONDecodeError as e:
            raise InputError(f"--static-tree is not valid JSON ({e}): "
                             f"{args.static_tree!r}") from None
        return SpecConfig.static_tree(paths)
    return "auto" if args.auto_tree else None


def _integers(flag: str, value: str, form: str) -> tuple[int, ...]:
    """The comma-separated integers of a flag's value in `form` (InputError otherwise)."""
    try:
        numbers = tuple(int(v) for v in value.split(","))
    except ValueError:
        numbers = ()
    if len(numbers) != len(form.split(",")):
        raise InputError(f"{flag} wants {form} ({len(form.split(','))} integers), "
                         f"got {value!r}")
    return numbers


def _check_decoding_args(args: argparse.Namespace):
    """Check the flags `generate` and `bench` share before any model is loaded; returns
    the speculation shape (see `_speculation`)."""
    validation.integer("--max-new-tokens", args.max_new_tokens, 1)
    validation.sampling(args.temperature, args.top_k, args.top_p, name=validation.cli_flag)
    validation.seed("--seed", args.seed)
    _check_draft_flags(args)
    if args.draft not in (None, "random"):
        _check_path("--draft", args.draft, directory=True)
    speculative = _speculation(args)
    _set_compilation_cache(args.no_compilation_cache)
    return speculative


def _check_path(name: str, value: str, directory: bool = False) -> None:
    """An existing path (a directory when `directory`), or a Hub id, fetched when loaded."""
    if not is_hub_id(value) or Path(value).expanduser().exists():
        validation.existing_path(name, value, directory=directory)


def _resolved(what: str, name: str, note: str = "") -> str | ResolvedSource:
    """`name` as the loaders take it: a built-in name as it is, else resolved (a Hub id is
    fetched); one line on stderr says what a Hub-shaped name meant (and `note`)."""
    source = name if builtin_model(name) is not None else resolve_source(name)
    if note or (is_hub_id(name) and isinstance(source, ResolvedSource)):
        where = source.description if isinstance(source, ResolvedSource) else name
        print(f"{what}: {where}{note}", file=sys.stderr)
    return source


def _model_source(args: argparse.Namespace) -> str | ResolvedSource:
    """--model resolved; when it is omitted, the verifier a --draft head's config names
    (--draft resolved first: `_draft_source`) where it is here or on the Hub, else the
    default model."""
    note, head = "", args.draft
    if args.model is None:
        verifier = named_verifier(head.path) \
            if isinstance(head, ResolvedSource) and head.path.is_dir() else None
        usable = verifier is not None and (builtin_model(verifier) is not None or
                                           is_hub_id(verifier) or
                                           Path(verifier).expanduser().exists())
        args.model = verifier if usable else DEFAULT_MODEL
        if usable:
            note = f" (the verifier --draft {head.name} names)"
        elif verifier is not None:
            note = f" (the default: {verifier}, the verifier --draft {head.name} names, is " \
                   f"not on this machine)"
    return _resolved("model", args.model, note)


def _draft_source(args: argparse.Namespace) -> None:
    """Resolve --draft (a path or a Hub id) and --draft-model in `args`, before --model."""
    if args.draft not in (None, "random"):
        args.draft = _resolved("draft", args.draft)
    if args.draft_model is not None:
        args.draft_model = _resolved("draft model", args.draft_model)


def _set_compilation_cache(off: bool) -> None:
    """--no-compilation-cache; otherwise a malformed $EAGLEJAX_COMPILATION_CACHE fails here,
    before any model is loaded."""
    if off:
        compilation_cache.disable()
    else:
        compilation_cache.enabled()


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="eaglejax", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("prompts", nargs="+", help="prompt text (several run as one batch)")
    _add_model_args(gen)
    _add_sampling_args(gen)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past EOS")
    gen.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="print each token's log-probability under the model and its N most "
                          f"likely alternatives (0 to {MAX_TOP_LOGPROBS}; with --json: a "
                          "`logprobs` list per prompt)")
    gen.add_argument("--no-draft", action="store_true",
                     help="decode plainly even where eaglejax ships a head for --model (by "
                          "default a built-in model with a shipped head speculates with it "
                          "`auto`, which speculates while that is faster on this machine)")
    _add_mesh_args(gen)

    bench = commands.add_parser("bench", help="decoding speed on MT-bench first turns")
    _add_model_args(bench)
    _add_sampling_args(bench)
    bench.add_argument("--batch-size", type=int, default=1)
    bench.add_argument("--num-prompts", type=int, default=16,
                       help="first N MT-bench questions (default 16; 80 is all)")
    bench.add_argument("--questions", default=None,
                       help="MT-bench question.jsonl (default: ../shared/datasets/mt_bench)")
    bench.add_argument("--balanced", action="store_true",
                       help="take the questions round-robin over the 8 categories")
    bench.add_argument("--stop-at-eos", action="store_true",
                       help="stop rows at EOS (default: always decode max-new-tokens)")
    bench.add_argument("--profile", action="store_true",
                       help="with a draft head, also split a speculative round into draft, "
                            "verify forward, accept + commit, head catch-up and the rest, in "
                            "ms and plain steps (timed in the compiled loop on the first "
                            "prompt; with auto, for each shape it can choose)")
    bench.add_argument("--roofline", default=None, metavar="DEVICE",
                       help="predict decode speed on DEVICE "
                            f"({', '.join(roofline.DEVICES)}) from XLA's cost analysis of "
                            "the compiled programs: with --model, --draft or --draft-model, "
                            "of this run's model and shape at its measured acceptance, "
                            "printed beside what it measured; without them, instead of a "
                            "run, Llama-3.1-8B with EAGLE-3 and other drafters (batch 1 and 8; "
                            "no model is loaded; its weights in --weight-dtype bfloat16 (auto), "
                            "int8 or int4); a loaded model's in the storage it loaded with")

    roof = commands.add_parser(
        "roofline", help="predicted accelerator decode speed of Llama-3.1-8B with EAGLE-3 and "
                         "other drafters, from XLA's cost analysis (no model is loaded)")
    roof.add_argument("devices", nargs="+", metavar="DEVICE",
                      help=f"one or more of {', '.join(roofline.DEVICES)}")
    roof.add_argument("--storage", default="bfloat16", choices=roofline.STORAGES,
                      help="the target's weight storage: bfloat16, int8 (a float32 scale per "
                           "output row) or int4 (4-bit blocks of 32 with a float16 scale and "
                           "minimum; embedding and output head in Q8_0), dequantized to bfloat16 in the matmuls (default: "
                           "bfloat16)")
    roof.add_argument("--batch-size", type=int, nargs="+", default=[1, 8],
                      help="batch sizes (default: 1 8)")
    roof.add_argument("--json", action="store_true")

    convert = commands.add_parser(
        "convert", help="convert a draft head between checkpoint layouts, or write a target "
                        "model as a Hugging Face directory (--to hf)")
    convert.add_argument("src", help="draft head directory: EAGLE-1/2, EAGLE-3 (reference, "
                                     "SpecForge, speculators), DFlash (z-lab, speculators) "
                                     "or eaglejax; with --to hf the "
                                     "TARGET model: built-in name, GGUF file, Hugging Face "
                                     "directory or eaglejax checkpoint")
    convert.add_argument("dst", help="new (or empty) output directory")
    convert.add_argument("--target", default=None,
                         help="the head's target model: built-in name, GGUF file, Hugging Face "
                              "directory or eaglejax checkpoint (required for the head "
                              "layouts; not with --to hf)")
    convert.add_argument("--to", default="eaglejax",
                         choices=["eaglejax", "reference", "speculators", "dflash", "hf"],
                         help="output layout (default: eaglejax); reference: EAGLE-3 heads "
                              "for SafeAILab/EAGLE, SpecForge and SGLang; speculators: "
                              "EAGLE-3, P-EAGLE and DFlash drafters for vLLM and the "
                              "speculators package; dflash: DFlash drafters in the z-lab "
                              "layout (vLLM, SGLang); hf: SRC is a target model, written for "
                              "transformers and vLLM (config.json, safetensors, tokenizer)")
    convert.add_argument("--quantize", default=None,
                         choices=["int8", "int4", "int4-sym", "gguf"],
                         help="instead, write the TARGET model SRC as an eaglejax checkpoint "
                              "with its matrices in int8 (per-row scales), int4 (4-bit "
                              "blocks of 32 with a scale and a minimum), int4-sym (with a "
                              "scale alone; both keep the embedding and output head in "
                              "Q8_0) or, from a GGUF "
                              "file, its own Q4_0/Q4_1/Q8_0 blocks as stored; it loads "
                              "without quantizing again: --model DST")
    convert.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                         help="parameter dtype (default: the target's as it loads: an "
                              "eaglejax checkpoint's saved dtype, else float32 on CPU and "
                              "bfloat16 on GPU/TPU)")
    _add_train_args(commands)
    _add_serve_args(commands)
    return parser


def _add_serve_args(commands) -> None:
    serve = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server (continuous batching)",
        description="Serve --model over an OpenAI-compatible HTTP API: /v1/models, "
                    "/v1/completions, /v1/chat/completions (streaming too), /health and "
                    "/metrics. Every prompt bucket is compiled at start-up.")
    # --max-new-tokens: max_tokens for requests that give none
    _add_model_args(serve)
    serve.add_argument("--no-draft", action="store_true",
                       help="decode plainly even where eaglejax ships a head for --model")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; 0.0.0.0: every "
                            "interface)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--num-slots", type=int, default=8,
                       help="requests decoded at once (default 8); more wait in a queue")
    serve.add_argument("--capacity", type=int, default=1024,
                       help="tokens a slot holds: prompt plus reply (default 1024)")
    serve.add_argument("--kv-tokens", type=int, default=None,
                       help="a paged KV cache of this many positions (blocks of 32) shared by "
                            "the slots: each request holds only what it fills, so "
                            "--num-slots may be far larger at the same memory; when blocks "
                            "run out the newest request is preempted and resumed later "
                            "(default: none, every slot holds --capacity positions)")
    serve.add_argument("--max-waiting", type=int, default=MAX_WAITING,
                       help="requests that may wait for a slot; more are refused with 429 "
                            f"and Retry-After (default {MAX_WAITING})")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds a request may take, waiting for a slot and decoding "
                            "(default: no limit; a request's own `timeout` may be shorter): "
                            "past it a running reply ends with what it has (finish reason "
                            "length, `eaglejax.timed_out`), a waiting one gets 503")
    serve.add_argument("--max-logprobs", type=int, default=MAX_TOP_LOGPROBS,
                       help="most likely tokens a request may ask log-probabilities of "
                            f"(`logprobs`, `top_logprobs`; default {MAX_TOP_LOGPROBS}; -1: "
                            "no request may ask, and replies keep none)")
    serve.add_argument("--prefix-cache-tokens", type=int, default=PREFIX_CACHE_TOKENS,
                       help="positions of earlier prompts and replies kept on the device for "
                            "requests that start with them (a chat's later turns, a shared "
                            f"system prompt; default {PREFIX_CACHE_TOKENS}, 0: none)")
    serve.add_argument("--profile-rounds", action="store_true",
                       help="at start-up, measure where each speculative shape's round goes "
                            "(draft, verify, accept + commit, catch-up, other) and show it "
                            "in /metrics (eaglejax_round_phase_seconds); tens of seconds")
    serve.add_argument("--served-model-name", default=None,
                       help="the model's name in the API (default: --model's file or "
                            "folder name)")
    _add_mesh_args(serve)


def _add_train_args(commands) -> None:
    train = commands.add_parser(
        "train-draft", help="train a draft head for a target: EAGLE-3, P-EAGLE or DFlash "
                            "(resumable)",
        description="Train a draft head (EAGLE-3 with training-time test, P-EAGLE, or a "
                    "DFlash block drafter) on ShareGPT-shaped conversations. Running the same "
                    "command again resumes the run in --out; the head is written to OUT/head.")
    train.add_argument("--target", default=DEFAULT_MODEL,
                       help=f"built-in name, GGUF file, Hugging Face directory or eaglejax "
                            f"checkpoint (default: {DEFAULT_MODEL})")
    train.add_argument("--data", required=True,
                       help="ShareGPT-shaped JSONL (.gz) file, e.g. "
                            "../shared/datasets/sharegpt/sharegpt_v3.jsonl.gz")
    train.add_argument("--out", required=True, help="run directory (new, or this run's to resume)")
    train.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                       help="target dtype (default: float32 on CPU, bfloat16 on GPU/TPU)")
    train.add_argument("--max-conversations", type=int, default=None,
                       help="use the first N conversations (default: all)")
    train.add_argument("--schedule", choices=SCHEDULES, default=TrainConfig.schedule,
                       help="after warm-up: cosine decay to 10%% at --steps, or constant "
                            "(a constant run can be extended later by asking for more steps)")
    train.add_argument("--method", choices=["eagle3", "peagle", "dflash"], default="eagle3",
                       help="eagle3: a head drafting one token per forward (TTT over "
                            "--ttt-length steps); peagle: P-EAGLE, --ttt-length tokens per "
                            "forward (mask slots, depths sampled as --cod-rate^d, at least "
                            "--cod-floor); dflash: a --num-layers drafter filling blocks of "
                            "--block-size (--num-anchors blocks per row) over the target's "
                            "whole vocabulary, or its own head over --draft-vocab-size "
                            "tokens")
    train.add_argument("--mask-token-id", type=int, default=None,
                       help="peagle, dflash: the mask slots' token (default: the tokenizer's "
                            "highest special token that text and chat turns never use)")
    train.add_argument("--block-size", type=int, default=None,
                       help="dflash: tokens per block, the last accepted one then masks "
                            "(default: 8)")
    train.add_argument("--init-from-target", action="store_true",
                       help="warm-start from the target: an EAGLE-3 head's lm_head, final "
                            "norm and fc; a DFlash drafter's layers (its last ones), final "
                            "norm and fc")
    train.add_argument("--init-head", default=None, metavar="PATH",
                       help="continue training this EAGLE-3 head (any layout --draft reads), "
                            "keeping its draft vocabulary: fine-tuning or a decay phase")
    train.add_argument("--eval-questions", type=int, default=8,
                       help="MT-bench first turns evaluated (round-robin over categories; "
                            "0: no evaluation)")
    train.add_argument("--regenerate", action="store_true",
                       help="replace the assistant turns by the target's own replies first "
                            "(cached on disk, resumable)")
    train.add_argument("--cut-repeats", type=int, default=0, metavar="N",
                       help="end each conversation where a supervised N-gram repeats an earlier "
                            "one (a small target's greedy loops); 0: off")
    train.add_argument("--regen-cache", default=None,
                       help="regeneration cache folder (default: $EAGLEJAX_CACHE/regenerated "
                            "or ~/.cache/eaglejax/regenerated)")
    train.add_argument("--no-progress", action="store_true", help="no progress bars")
    for dest, (cls, name) in _TRAIN_FLAGS.items():  # bounds and help: the dataclass field
        field = _config_field(cls, name)
        train.add_argument(validation.cli_flag(dest), dest=dest, default=field.default,
                           type=validation.KINDS[field.metadata["bounds"][0]],
                           help=field.metadata["help"])
    _add_mesh_args(train)


# train-draft's flags that set a config field (flag name -> the dataclass and field)
_TRAIN_FLAGS = {
    **{name: (TrainConfig, name) for name in (
        "seq_len", "batch_size", "steps", "lr", "warmup_steps", "weight_decay", "grad_clip",
        "ttt_length", "num_layers", "draft_vocab_size", "cod_rate", "cod_floor", "seed",
        "checkpoint_every", "eval_every", "eval_max_new_tokens", "num_anchors",
        "loss_decay_gamma")},
    "regen_temperature": (RegenConfig, "temperature"),
    "regen_max_new_tokens": (RegenConfig, "max_new_tokens"),
    "regen_slots": (RegenConfig, "num_slots"),
}


def _config_field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def _generate(args: argparse.Namespace) -> None:
    speculative = _check_decoding_args(args)
    validation.prompt_list(args.prompts)
    validation.stop_strings(args.stop, name="--stop")

    mesh = _mesh(args)
    _draft_source(args)
    model = _model_source(args)
    default_head = shipped_head(args.model) if _wants_shipped_head(args) else None
    if default_head is not None:  # auto measures one machine; several processes take the preset
        args.draft = str(default_head)
        speculative = "auto" if jax.process_count() == 1 else None
    target = load_target(model, dtype=args.dtype, weight_dtype=args.weight_dtype, mesh=mesh)
    results = generate(args.prompts, target=target, draft=_load_draft(args, target),
                       speculative=speculative,
                       max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_p=args.top_p, top_k=args.top_k, seed=args.seed, chat=args.chat,
                       stop=args.stop, ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    if not _is_first_process():
        return  # every process holds the results; process 0 prints them
    if args.json:
        print(json.dumps([{"text": r.text, "token_ids": r.token_ids,
                           "finish_reason": r.finish_reason,
                           "metrics": {**dataclasses.asdict(r.metrics),
                                       "speedup_over_plain": r.metrics.speedup_over_plain},
                           **({} if r.logprobs is None else {"logprobs": [
                               dataclasses.asdict(e) for e in r.logprobs]})}
                          for r in results], indent=2))
        return
    for r in results:
        if len(results) > 1:
            print("-" * 40)
        print(r.text)
        for e in r.logprobs or []:
            alternatives = "  ".join(f"{target.tokenizer.decode([t])!r} {v:.3f}" for t, v in e.top)
            print(f"  {target.tokenizer.decode([e.token_id])!r:>16} {e.logprob:8.3f}   "
                  f"{alternatives}")
        m = r.metrics
        al = f", {target.storage} weights"
        al += f", {m.speculative}" if m.speculative else ""
        al += f", AL {m.acceptance_length:.2f}" if m.acceptance_length else ""
        if m.speedup_over_plain:
            al += f", {m.speedup_over_plain:.2f}x plain decoding (its steps: " \
                  f"{1e3 * m.plain_step_s:.1f} ms)"
        print(f"[{m.new_tokens} tokens, finish: {r.finish_reason}, compile {m.compile_s:.2f} s, "
              f"prefill {m.prefill_s:.3f} s, decode {m.decode_tokens_per_s:.1f} tok/s{al}]",
              file=sys.stderr)


def _load_draft(args: argparse.Namespace, target):
    """The --draft head (or --draft-model) for `target`; `random` is a freshly initialised
    EAGLE-3 head (its acceptance is near 1: it measures the speculative loop's own
    overhead)."""
    if args.draft_model is not None:
        return load_draft_model(args.draft_model, target=target)
    if args.draft is None:
        return None
    if args.draft == "random":
        return new_eagle3_draft(target)
    return load_draft(args.draft, target=target)


def _bench(args: argparse.Namespace) -> None:
    if args.roofline is not None:
        roofline.device(args.roofline)  # an unknown device is refused before any work
        if (args.model, args.draft, args.draft_model) == (None, None, None):
            storage = "bfloat16" if args.weight_dtype == "auto" else args.weight_dtype
            if storage not in roofline.STORAGES:
                raise InputError(f"--roofline without a model predicts weights in "
                                 f"{', '.join(roofline.STORAGES)} (--weight-dtype), not "
                                 f"{storage}")
            print(roofline.report(args.roofline, as_json=args.json, storage=storage))
            return
    validation.integer("--batch-size", args.batch_size, 1)
    validation.integer("--num-prompts", args.num_prompts, 1)
    speculative = _check_decoding_args(args)
    questions = mt_bench_questions(args.questions)
    if args.num_prompts > len(questions):
        raise InputError(f"--num-prompts {args.num_prompts}: the questions file has only "
                         f"{len(questions)}")
    _draft_source(args)
    target = load_target(_model_source(args), dtype=args.dtype, weight_dtype=args.weight_dtype)
    if args.balanced:
        questions = interleave_categories(questions)
    questions = questions[:args.num_prompts]
    sampling = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                    seed=args.seed) if args.temperature > 0 else None
    common = dict(batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                  chat=args.chat, ignore_eos=not args.stop_at_eos, sampling=sampling)
    draft = _load_draft(args, target)
    if draft is None and speculative is None:
        report = bench_plain(target, questions, **common)
    else:
        report = bench_speculative(target, draft, questions, speculative=speculative, **common)
        if args.profile:
            report["round_split"] = profile_rounds(target, draft, questions[0].prompt,
                                                   speculative, chat=args.chat,
                                                   sampling=sampling)
    if args.roofline is not None:
        report["roofline"] = beside_roofline(report, target, draft, speculative, args.roofline)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for key, value in report.items():
        if key == "round_split":
            for split in value:
                print(describe_split(split))
        elif key == "roofline":
            print(describe_beside_roofline(value))
        else:
            print(f"{key:>26}: {value:.3f}" if isinstance(value, float)
                  else f"{key:>26}: {value}")


def _roofline(args: argparse.Namespace) -> None:
    for name in args.devices:
        roofline.device(name)  # unknown devices refused before any compile
    for batch in args.batch_size:
        validation.integer("--batch-size", batch, 1)
    print(roofline.report(args.devices, as_json=args.json, storage=args.storage,
                          batches=tuple(args.batch_size)))


def _convert(args: argparse.Namespace) -> None:
    if args.quantize is not None:
        _quantize_target(args)
        return
    if args.to == "hf":
        _convert_target(args)
        return
    if args.target is None:
        raise InputError(f"--target is required with --to {args.to}: the draft head's target "
                         f"model (built-in name, GGUF file, Hugging Face directory or eaglejax "
                         f"checkpoint)")
    _check_path("SRC", args.src, directory=True)
    validation.new_output_dir("DST", args.dst)
    draft_source = _resolved("head", args.src)
    target = load_target(_resolved("target", args.target), dtype=args.dtype)
    draft = load_draft(draft_source, target=target)
    out = WRITERS[args.to](draft, args.dst)
    c = draft.config
    print(f"wrote {out} ({args.to} layout; {c.kind} head, {c.decoder.num_layers} layer(s), "
          f"draft vocab {c.draft_vocab_size}, taps {list(c.tap_layers)})")


def _convert_target(args: argparse.Namespace) -> None:
    """`convert SRC DST --to hf`: the target model SRC as a Hugging Face directory."""
    if args.target is not None:
        raise InputError("--target is not used with --to hf: SRC is the target model itself "
                         "(built-in name, GGUF file, Hugging Face directory or eaglejax "
                         "checkpoint)")
    if builtin_model(args.src) is None:
        _check_path("SRC", args.src)
    dst = validation.new_output_dir("DST", args.dst)
    target = load_target(_resolved("model", args.src), dtype=args.dtype)
    out = export_hf(target, dst)
    c = target.config
    tokenizer = "tokenizer" if target.tokenizer is not None else "NO tokenizer (none loaded)"
    print(f"wrote {out} (Hugging Face layout; {c.model_type}, {c.num_layers} layers, vocab "
          f"{c.vocab_size}, {target.dtype.name}, {tokenizer})")


def _quantize_target(args: argparse.Namespace) -> None:
    """`convert SRC DST --quantize int8|int4|int4-sym|gguf`: the target model SRC as an eaglejax
    checkpoint with its matrices stored so (it loads without quantizing again)."""
    if args.target is not None or args.to != "eaglejax":
        raise InputError("--quantize writes the target model SRC as an eaglejax checkpoint: "
                         "it takes neither --target nor --to")
    if builtin_model(args.src) is None:
        _check_path("SRC", args.src)
    dst = validation.new_output_dir("DST", args.dst)
    target = load_target(_resolved("model", args.src), dtype=args.dtype,
                         weight_dtype=args.quantize)
    target.save(str(dst))
    print(f"wrote {dst} (eaglejax checkpoint; {target.config.model_type}, "
          f"{target.config.num_layers} layers, {target.storage} matrices, "
          f"{target.dtype.name} compute)")


def _train_draft(args: argparse.Namespace) -> None:
    _check_train_args(args)
    config = TrainConfig(
        schedule=args.schedule, init_from_target=args.init_from_target,
        **{name: getattr(args, dest) for dest, (cls, name) in _TRAIN_FLAGS.items()
           if cls is TrainConfig and name not in ("cod_rate", "cod_floor")})  # peagle's: below
    regen = RegenConfig(args.regen_temperature, args.regen_max_new_tokens, args.seq_len,
                        args.regen_slots, args.seed) if args.regenerate else None
    target = load_target(_resolved("target", args.target), dtype=args.dtype, mesh=_mesh(args))
    if args.method in ("peagle", "dflash"):
        mask = args.mask_token_id
        if mask is None:
            mask = target.tokenizer.spare_special_token_id()
        if mask is None:
            raise InputError(f"{args.target}: its tokenizer has no spare special token to "
                             f"serve as the mask token; name one with --mask-token-id")
        validation.integer("--mask-token-id", mask, 0, target.config.vocab_size - 1)
        config = dataclasses.replace(config, mask_token_id=mask)
    if args.method == "peagle":
        config = dataclasses.replace(config, cod_rate=args.cod_rate, cod_floor=args.cod_floor)
    if args.method == "dflash":
        config = dataclasses.replace(config, block_size=args.block_size or DFLASH_BLOCK)
    rows = prepare_rows(target, args.data, seq_len=args.seq_len,
                        max_conversations=args.max_conversations, regen=regen,
                        regen_cache=args.regen_cache, cut_repeats=args.cut_repeats,
                        progress=not args.no_progress)
    prompts = mt_bench_prompts(args.eval_questions) if args.eval_questions > 0 else None
    init_head = load_draft(_resolved("init head", args.init_head), target=target) \
        if args.init_head else None
    result = train(target, rows, args.out, config, eval_prompts=prompts, init_head=init_head,
                   progress=not args.no_progress)
    evals = [e["acceptance_length"] for e in result.log if "acceptance_length" in e]
    al = f"; acceptance length {evals[0]:.2f} at the start, {evals[-1]:.2f} at the end" \
        if evals else ""
    print(f"wrote {result.out / 'head'} (load it with --draft){al}")


DFLASH_BLOCK = 8  # train-draft --method dflash's default block
# Least values of train-draft's integer flags that set no config field.
_TRAIN_MINIMUM = {"eval_questions": 0, "cut_repeats": 0, "max_conversations": 1}


def _check_train_args(args: argparse.Namespace) -> None:
    """Check train-draft's flags and paths before a model is loaded or --out is created
    (the config fields' bounds: `_TRAIN_FLAGS`; cross-field rules: TrainConfig)."""
    for dest, (cls, name) in _TRAIN_FLAGS.items():
        validation.check_field(_config_field(cls, name), getattr(args, dest),
                               validation.cli_flag(dest))
    for name, low in _TRAIN_MINIMUM.items():
        value = getattr(args, name)
        if value is not None:  # --max-conversations defaults to None
            validation.integer(validation.cli_flag(name), value, low)
    if args.method == "eagle3" and args.mask_token_id is not None:
        raise InputError("--mask-token-id needs --method peagle or dflash")
    if args.block_size is not None:
        if args.method != "dflash":
            raise InputError("--block-size needs --method dflash")
        validation.integer("--block-size", args.block_size, 2)
    validation.existing_path("--data", args.data)
    if args.init_head is not None:
        _check_path("--init-head", args.init_head, directory=True)
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise InputError(f"--out: {out} exists and is not a directory")


def _serve(args: argparse.Namespace) -> None:
    for used, flag in ((args.json, "--json"), (not args.chat, "--no-chat")):
        if used:
            raise InputError(f"{flag} does not apply to serve (the chat endpoint renders the "
                             f"chat template; /v1/completions encodes prompts as they are)")
    validation.integer("--max-new-tokens", args.max_new_tokens, 1)
    validation.integer("--port", args.port, 0, 65535)
    validation.integer("--num-slots", args.num_slots, 1)
    validation.integer("--capacity", args.capacity, 2)
    validation.integer("--prefix-cache-tokens", args.prefix_cache_tokens, 0)
    validation.integer("--max-waiting", args.max_waiting, 0)
    validation.integer("--max-logprobs", args.max_logprobs, -1, MAX_TOP_LOGPROBS)
    if args.request_timeout is not None:
        validation.real("--request-timeout", args.request_timeout, 0.0, low_open=True)
    _check_draft_flags(args)
    if args.draft not in (None, "random"):
        _check_path("--draft", args.draft, directory=True)
    speculative = _speculation(args)  # None: auto where one process serves (the engine's)
    _set_compilation_cache(args.no_compilation_cache)
    # Imported here: the server stack (FastAPI, uvicorn) adds seconds to every other command.
    from eaglejax.serving.engine import Engine
    from eaglejax.serving.lockstep import LockstepEngine, follow
    from eaglejax.serving.server import run_server

    mesh = _mesh(args)
    _draft_source(args)
    model = _model_source(args)
    default_head = shipped_head(args.model) if _wants_shipped_head(args) else None
    if default_head is not None:
        args.draft = str(default_head)
    target = load_target(model, dtype=args.dtype, weight_dtype=args.weight_dtype, mesh=mesh)
    engine = Engine(target, _load_draft(args, target), speculative=speculative,
                    num_slots=args.num_slots, capacity=args.capacity,
                    prefix_cache_tokens=args.prefix_cache_tokens,
                    max_waiting=args.max_waiting, kv_tokens=args.kv_tokens,
                    max_logprobs=None if args.max_logprobs == -1 else args.max_logprobs)
    if jax.process_index() > 0:  # a multi-process run: process 0 serves, this one follows
        with compilation_cache.caching_every_program(), contextlib.suppress(KeyboardInterrupt):
            follow(engine)  # until process 0 closes (or Ctrl-C)
        return
    if jax.process_count() > 1:
        engine = LockstepEngine(engine)
    start = time.perf_counter()
    with compilation_cache.caching_every_program():  # a restart loads them from disk
        engine.warmup(progress=True)
    print(f"eaglejax: warmed up in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    if args.profile_rounds:
        for split in engine.profile_rounds():
            print(describe_split(split), file=sys.stderr)
    try:
        run_server(engine, host=args.host, port=args.port,
                   model_name=args.served_model_name or _served_name(model),
                   default_max_tokens=args.max_new_tokens,
                   request_timeout=args.request_timeout)
    finally:
        if isinstance(engine, LockstepEngine):
            engine.close()


def _served_name(model: str | ResolvedSource) -> str:
    """The model's name in the API: a Hub id, else the file or folder name."""
    if isinstance(model, ResolvedSource):
        return model.hub_id or model.path.name
    return Path(model).name


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        {"generate": _generate, "bench": _bench, "roofline": _roofline, "convert": _convert,
         "train-draft": _train_draft, "serve": _serve}[args.command](args)
    except EaglejaxError as err:
        print(f"eaglejax: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
