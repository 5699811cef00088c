"""Generated tokens' log-probabilities on the host: what `generate()` and the serving engine
hand out from an output that keeps them (`decoding.output.Logprobs`)."""

from __future__ import annotations

import dataclasses

import numpy as np

from eaglejax import validation
from eaglejax.decoding.output import MAX_TOP_LOGPROBS


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token, its log-probability under the target model (log-softmax of the
    logits it was drawn from: before temperature, top-k and top-p) and the `top` most likely
    tokens there as (id, log-probability), most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def check_count(name: str, value: object) -> int | None:
    """`value` as a count of most likely tokens (0 to MAX_TOP_LOGPROBS), or None."""
    return None if value is None else validation.integer(name, value, 0, MAX_TOP_LOGPROBS)


def row_logprobs(tokens: np.ndarray, chosen: np.ndarray, top_ids: np.ndarray, top: np.ndarray,
                 start: int, end: int, count: int) -> list[TokenLogprob]:
    """Entries `start`..`end` of one row (host copies of `Output.tokens` [N] and
    `Logprobs.chosen` [N], `top_ids` / `top` [N,K]), with `count` <= K alternatives each."""
    return [TokenLogprob(int(tokens[i]), float(chosen[i]),
                         [(int(t), float(v)) for t, v in zip(top_ids[i, :count], top[i, :count])])
            for i in range(start, end)]
