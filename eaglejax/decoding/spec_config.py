"""How to speculate: a chain, an EAGLE-2 dynamic tree, a user-given static tree or a P-EAGLE
parallel chain or lattice tree, each with an optional context-lookup branch; device presets."""

from __future__ import annotations

import dataclasses
from typing import Literal, Sequence

import numpy as np

from eaglejax.decoding.lookup import MAX_MATCH
from eaglejax.decoding.tree import max_nodes, static_shape
from eaglejax.errors import InputError

Method = Literal["chain", "parallel", "tree", "parallel_tree", "static", "suffix",
                 "draft_model", "draft_model_tree", "dflash", "dflash_tree"]  # or a plug-in's


def _positive_int(name: str, value: object, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
        raise InputError(f"{name} must be an integer in [1, {high}], got {value!r}")


def normalize_paths(paths: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Validate a static tree given as paths of child ranks (Medusa / vLLM style:
    `(0,)` is the draft's top-1 token, `(0, 1)` the second-best child of that node) and
    return it sorted by depth then rank. Every path's prefix must be present."""
    if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence) or not paths:
        raise InputError("static tree: give a non-empty list of paths such as [(0,), (1,), (0, 0)]")
    seen: set[tuple[int, ...]] = set()
    for path in paths:
        if (isinstance(path, (str, bytes)) or not isinstance(path, Sequence) or not path
                or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < 64
                           for r in path)):
            raise InputError(f"static tree: path {path!r} must be a non-empty list of child "
                             f"ranks in [0, 64)")
        key = tuple(path)
        if key in seen:
            raise InputError(f"static tree: path {key} is given twice")
        seen.add(key)
    for key in seen:
        if len(key) > 1 and key[:-1] not in seen:
            raise InputError(f"static tree: path {key} needs its parent path {key[:-1]}")
    if len(seen) > 255:
        raise InputError(f"static tree: at most 255 nodes, got {len(seen)}")
    return tuple(sorted(seen, key=lambda p: (len(p), p)))


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """Static speculation settings (hashable: part of the compiled loop's key).

    method "chain": `num_draft_tokens` (K) tokens drafted one after another; when
    sampling, the draft samples them and the min(1, p/q) rule verifies.
    method "parallel": a chain of K tokens a P-EAGLE head proposed in ONE forward (the
    next-token slot and K-1 mask slots), verified as a chain.
    method "parallel_tree": a tree from that one forward's `depth` proposals: EAGLE-2's
    expansion (best `top_k` frontier nodes, `top_k` children each, the best
    `total_tokens - 1` by summed log-probability) over the lattice of each slot's top
    tokens (a slot's proposal does not depend on the tokens drafted before it).
    method "tree": an EAGLE-2 dynamic tree: `depth` expansion rounds of `top_k` children
    per frontier node, then the best `total_tokens - 1` candidates (root excluded) by
    cumulative draft log-probability are verified.
    method "static": a fixed tree of child-rank paths (`paths`), see `normalize_paths`.
    methods "draft_model" (a chain of K) and "draft_model_tree" (a dynamic tree): drafted
    by a smaller model of the target's tokenizer (`eaglejax.load_draft_model`) instead of
    a head. Method "suffix": drafted from the context alone (`drafters.suffix`). Methods
    "dflash" (a chain of K) and "dflash_tree" (a tree as "parallel_tree"'s): drafted from
    one forward of a DFlash head (`drafters.dflash`).
    Any other method registered in `decoding.drafters` is sized by the fields of its
    shape (`drafters.base.SHAPES`: a chain's `num_draft_tokens`, a tree's `top_k`, `depth`
    and `total_tokens`, or `paths`).
    Trees verify with greedy matching or recursive rejection sampling (lossless).

    `lookup` > 0 adds that many tokens copied from the context (prompt lookup: what followed
    the earlier occurrence of the context's longest suffix, up to 8 tokens, the latest among
    equals) as one more branch of the tree, grafted under the deepest node that already
    holds its first tokens (see `decoding.lookup`). With `lookup_replaces` the node count
    stays the shape's: in rounds where that match holds at least `lookup_ngram` tokens, the
    branch replaces the head's `lookup` lowest-ranked nodes. With sampling it needs a tree (a sampled chain's min(1, p/q)
    rule has no place for a second draft). With `lookup_history` the branch also searches
    the replies decoded before (`decoding.suffix_history`, the buffer suffix drafting
    reads), placed before the row's own context: a request that repeats or edits an
    earlier one copies from that reply.

    `long_lookup` > 0 (with a lookup branch) switches each round between two shapes: where
    some running row's match holds at least `long_ngram` tokens (text being copied: a quoted
    passage, a list, code, a greedy loop), the round verifies the root and `long_lookup`
    copied tokens as a chain instead of the head's tree; otherwise the shape's own round.
    One such round costs about one verify of `long_lookup + 1` tokens and no head step.

    `min_match` > 0 (method "suffix" only) gates each round: the tree is verified only when
    some running row's longest suffix match holds at least `min_match` tokens; every other
    round is a plain step (the target alone, its root), so text that repeats nothing decodes
    at about plain decoding's cost.
    """

    num_draft_tokens: int = 5
    method: Method = "chain"
    top_k: int = 4
    depth: int = 4
    total_tokens: int = 12
    paths: tuple[tuple[int, ...], ...] = ()
    lookup: int = 0
    lookup_ngram: int = 3
    lookup_replaces: bool = False
    lookup_history: bool = False
    long_lookup: int = 0
    long_ngram: int = MAX_MATCH
    min_match: int = 0

    def __post_init__(self):
        from eaglejax.decoding.drafters import methods  # (they import this module)

        if self.method not in methods():
            raise InputError(f"method must be one of {', '.join(map(repr, methods()))} (the "
                             f"registered drafters), got {self.method!r}")
        _positive_int("num_draft_tokens", self.num_draft_tokens, 64)
        if self.shape == "tree":
            _positive_int("top_k", self.top_k, 64)
            _positive_int("depth", self.depth, 32)
            most = min(max_nodes(self.top_k, self.depth), 256)
            if not isinstance(self.total_tokens, int) or not 2 <= self.total_tokens <= most:
                raise InputError(f"total_tokens must be an integer in [2, {most}] for top_k="
                                 f"{self.top_k}, depth={self.depth}; got {self.total_tokens!r}")
        if self.shape == "paths":
            object.__setattr__(self, "paths", normalize_paths(self.paths))
        if self.lookup != 0:
            _positive_int("lookup", self.lookup, 32)
        _positive_int("lookup_ngram", self.lookup_ngram, 8)
        if not isinstance(self.lookup_replaces, bool):
            raise InputError(f"lookup_replaces must be True or False, got {self.lookup_replaces!r}")
        if not isinstance(self.lookup_history, bool):
            raise InputError(f"lookup_history must be True or False, got {self.lookup_history!r}")
        if self.lookup_history and not self.lookup:
            raise InputError("lookup_history: the history is searched by a lookup branch; give "
                             "lookup > 0 tokens")
        if self.long_lookup != 0:
            _positive_int("long_lookup", self.long_lookup, 32)
            _positive_int("long_ngram", self.long_ngram, MAX_MATCH)
            if not self.lookup or self.long_lookup <= self.lookup:
                raise InputError(f"long_lookup={self.long_lookup}: a longer copied chain than "
                                 f"the lookup branch's ({self.lookup} tokens) needs that branch")
            if self.long_ngram < self.lookup_ngram:
                raise InputError(f"long_ngram={self.long_ngram}: a long copy needs a match at "
                                 f"least as long as the branch's lookup_ngram="
                                 f"{self.lookup_ngram}")
        if self.min_match != 0:
            _positive_int("min_match", self.min_match, MAX_MATCH)
            if self.method != "suffix":
                raise InputError(f"min_match gates suffix drafting's rounds (method 'suffix'), "
                                 f"not method {self.method!r}")
        if self.lookup_replaces and self.lookup >= self.num_nodes:
            raise InputError(f"lookup_replaces: the branch ({self.lookup} tokens) must leave the "
                             f"head at least its root; the shape verifies {self.num_nodes} nodes")

    @classmethod
    def chain(cls, num_draft_tokens: int = 5) -> "SpecConfig":
        return cls(num_draft_tokens=num_draft_tokens)

    @classmethod
    def parallel(cls, num_draft_tokens: int = 5) -> "SpecConfig":
        """P-EAGLE: K draft tokens from one forward of a parallel head."""
        return cls(num_draft_tokens=num_draft_tokens, method="parallel")

    @classmethod
    def parallel_tree(cls, top_k: int = 4, depth: int = 5, total_tokens: int = 12
                      ) -> "SpecConfig":
        """A tree over one P-EAGLE forward's `depth` proposals (see the class docstring)."""
        return cls(method="parallel_tree", top_k=top_k, depth=depth, total_tokens=total_tokens)

    @classmethod
    def tree(cls, top_k: int = 4, depth: int = 4, total_tokens: int = 12) -> "SpecConfig":
        return cls(method="tree", top_k=top_k, depth=depth, total_tokens=total_tokens)

    @classmethod
    def suffix(cls, top_k: int = 4, depth: int = 6, total_tokens: int = 4,
               min_match: int = 2) -> "SpecConfig":
        """Suffix drafting, no draft head: a tree of what followed the `top_k` best earlier
        matches of the context's latest tokens, `depth` deep (`drafters.suffix`); rounds
        whose longest match is shorter than `min_match` are plain steps (0: none). The
        defaults ran fastest on a 2-core CPU on chat, a mixed and a repetitive workload
        (BENCHMARKS.md, session 47)."""
        return cls(method="suffix", top_k=top_k, depth=depth, total_tokens=total_tokens,
                   min_match=min_match)

    @classmethod
    def dflash(cls, num_draft_tokens: int = 7) -> "SpecConfig":
        """A DFlash head's chain: the first K of its block's proposals (K < block size)."""
        return cls(num_draft_tokens=num_draft_tokens, method="dflash")

    @classmethod
    def dflash_tree(cls, top_k: int = 4, depth: int = 7, total_tokens: int = 12
                    ) -> "SpecConfig":
        """A tree over a DFlash block's first `depth` proposals (as `parallel_tree` over a
        P-EAGLE head's)."""
        return cls(method="dflash_tree", top_k=top_k, depth=depth, total_tokens=total_tokens)

    @classmethod
    def draft_model(cls, num_draft_tokens: int = 4) -> "SpecConfig":
        """A draft model's chain of K tokens (`drafters.draft_model`)."""
        return cls(num_draft_tokens=num_draft_tokens, method="draft_model")

    @classmethod
    def draft_model_tree(cls, top_k: int = 4, depth: int = 4, total_tokens: int = 12
                         ) -> "SpecConfig":
        """EAGLE-2's dynamic tree drafted by a draft model (see the class docstring's
        "tree")."""
        return cls(method="draft_model_tree", top_k=top_k, depth=depth,
                   total_tokens=total_tokens)

    @classmethod
    def static_tree(cls, paths: Sequence[Sequence[int]]) -> "SpecConfig":
        return cls(method="static", paths=tuple(tuple(p) for p in paths))

    @classmethod
    def preset(cls, platform: str, batch_size: int = 1) -> "SpecConfig":
        """The default for a device kind ("cpu", "gpu", "tpu") and batch size: the tree
        shrinks toward a chain as the batch grows, since verifying costs batch x nodes
        tokens (see BENCHMARKS.md for the CPU measurements behind these)."""
        if platform == "cpu":
            if batch_size <= 2:
                return cls.tree(top_k=4, depth=4, total_tokens=12)
            return cls.chain(4) if batch_size <= 8 else cls.chain(3)
        # Accelerators verify dozens of tokens for nearly the cost of one (EAGLE-2/3 defaults).
        if batch_size <= 2:
            return cls.tree(top_k=8, depth=6, total_tokens=60)
        if batch_size <= 8:
            return cls.tree(top_k=6, depth=5, total_tokens=32)
        if batch_size <= 32:
            return cls.tree(top_k=4, depth=4, total_tokens=12)
        return cls.chain(3)

    @classmethod
    def default_for(cls, parallel_head: bool, platform: str, batch_size: int = 1, *,
                    drafts_with: str | None = "head", dflash_block: int = 0) -> "SpecConfig":
        """The shape a draft runs when none is asked for: a P-EAGLE head's parallel chain (K
        of its paper on accelerators, 5 on a CPU), a DFlash head's chain (`dflash_block` > 0:
        its whole block on accelerators, 7 tokens at most on a CPU), else `preset`, drafted
        by a draft model's methods when `drafts_with` is "model"."""
        if parallel_head:
            return cls.parallel(5 if platform == "cpu" else 7)
        if dflash_block:
            return cls.dflash(min(dflash_block - 1, 7) if platform == "cpu" else
                              dflash_block - 1)
        preset = cls.preset(platform, batch_size)
        return preset.drafted_by_model() if drafts_with == "model" else preset

    def drafted_by_model(self) -> "SpecConfig":
        """This chain or dynamic tree drafted by a draft model (methods "draft_model",
        "draft_model_tree")."""
        if self.method not in ("chain", "tree", "draft_model", "draft_model_tree"):
            raise InputError(f"{self.describe()}: a draft model drafts chains and dynamic "
                             f"trees only")
        method = "draft_model" if self.is_chain else "draft_model_tree"
        return dataclasses.replace(self, method=method)

    def with_lookup(self, lookup: int, ngram: int = 3, replaces: bool = False,
                    history: bool = False) -> "SpecConfig":
        """This shape plus a context-lookup branch of `lookup` tokens (0: none); `replaces`:
        in place of the head's lowest-ranked nodes where `ngram` tokens or more matched;
        `history`: searching the replies decoded before too."""
        return dataclasses.replace(self, lookup=lookup, lookup_ngram=ngram,
                                   lookup_replaces=replaces, lookup_history=history)

    def with_long_lookup(self, tokens: int, ngram: int = MAX_MATCH) -> "SpecConfig":
        """This shape, whose rounds verify a chain of `tokens` copied tokens instead where the
        context matched `ngram` tokens or more (0: never; see the class docstring)."""
        return dataclasses.replace(self, long_lookup=tokens, long_ngram=ngram)

    def without_long_lookup(self) -> "SpecConfig":
        """This shape's own rounds (the rounds where no long copy is verified)."""
        return dataclasses.replace(self, long_lookup=0, long_ngram=MAX_MATCH)

    @property
    def uses_history(self) -> bool:
        """Whether this shape's drafts read the history of earlier replies
        (`decoding.suffix_history`): suffix drafting, or a lookup branch with history.
        Whoever decodes with it adds the replies to that history."""
        return self.method == "suffix" or self.lookup_history

    @property
    def samples_losslessly(self) -> bool:
        """Whether sampled rows can be verified losslessly with this shape (a lookup branch
        on a chain cannot: a sampled chain verifies only its own draft)."""
        return not (self.lookup and self.is_chain)

    def check_sampling(self, greedy: bool) -> None:
        """InputError when this shape cannot be verified losslessly with sampling."""
        if not greedy and not self.samples_losslessly:
            raise InputError(f"{self.describe()}: a lookup branch with sampling needs a tree "
                             f"(method 'tree' or 'static'); a sampled chain verifies only its "
                             f"own draft")

    @property
    def shape(self) -> str:
        """The shape of the method's trees: "chain", "tree" or "paths" (`drafters.SHAPES`)."""
        from eaglejax.decoding.drafters.base import shape_of

        return shape_of(self.method)

    @property
    def drafts_with(self) -> str | None:
        """What the method drafts with: "head" (an EAGLE head, `eaglejax.load_draft`),
        "model" (a draft model, `eaglejax.load_draft_model`) or None (nothing)."""
        from eaglejax.decoding.drafters.base import drafts_with

        return drafts_with(self.method)

    @property
    def is_chain(self) -> bool:
        """One path of K draft tokens (drafted one by one, or in parallel)."""
        return self.shape == "chain"

    @property
    def is_dynamic_tree(self) -> bool:
        """EAGLE-2's dynamic tree, drafted by a head, a draft model or over a DFlash block,
        or a suffix tree (nodes scored by their match counts): its best `n` nodes by score
        come first, so a smaller tree's nodes are a prefix (`decoding.calibration`)."""
        return self.method in ("tree", "draft_model_tree", "dflash_tree", "suffix")

    @property
    def is_dflash(self) -> bool:
        """Drafted from a DFlash head's block (`draft_depth` of its proposals)."""
        return self.method in ("dflash", "dflash_tree")

    @property
    def is_parallel(self) -> bool:
        """Drafted from one P-EAGLE forward (`draft_depth` proposals)."""
        return self.method in ("parallel", "parallel_tree")

    @property
    def max_depth(self) -> int:
        """The longest draft path: most draft tokens one round can accept."""
        return max(self.draft_depth + self.lookup, self.long_lookup)

    @property
    def draft_depth(self) -> int:
        """The head's longest draft path (the lookup branch aside)."""
        if self.is_chain:
            return self.num_draft_tokens
        if self.shape == "tree":
            return self.depth
        return max(len(p) for p in self.paths)

    @property
    def max_children(self) -> int:
        """Most children of one node (a lookup branch may add one to any node)."""
        if self.shape == "tree":
            most = self.top_k
        elif self.shape == "paths":
            most = int(np.bincount(static_shape(self.paths).parents[1:]).max())
        else:
            most = 1
        return most + (self.lookup > 0)

    @property
    def num_nodes(self) -> int:
        """Tokens the target verifies per round, the root (last accepted token) included."""
        if self.is_chain:
            head = self.num_draft_tokens + 1
        elif self.shape == "tree":
            head = self.total_tokens
        else:
            head = len(self.paths) + 1
        return head + (0 if self.lookup_replaces else self.lookup)

    @property
    def most_nodes(self) -> int:
        """Tokens the target verifies in this shape's largest round (a long copy's, if
        larger): the cache rows a round needs beyond the kept tokens."""
        return max(self.num_nodes, self.long_lookup + 1)

    def describe(self) -> str:
        if self.is_chain:
            shape = f"{self.method} K={self.num_draft_tokens}"
        elif self.shape == "tree":
            shape = (f"{self.method.replace('_', ' ')} top_k={self.top_k} depth={self.depth} "
                     f"total={self.total_tokens}")
        else:
            shape = f"{self.method} tree of {len(self.paths)} nodes, depth {self.draft_depth}"
        if self.lookup:
            replacing = ", replacing" if self.lookup_replaces else ""
            history = ", history" if self.lookup_history else ""
            shape += f" + lookup {self.lookup} (ngram {self.lookup_ngram}{replacing}{history})"
        if self.long_lookup:
            shape += f", long copy {self.long_lookup} at matches of {self.long_ngram}+"
        if self.min_match:
            shape += f", matches of {self.min_match}+"
        return shape
