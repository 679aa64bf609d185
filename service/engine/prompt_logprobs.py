"""Prompt logprobs (`echo` + `logprobs`, vLLM's `prompt_logprobs`): the model's log-softmax at prompt positions.

Row t of `logits` [T, V] is the distribution after prompt token t; it scores the prompt's next token. These
are the raw logprobs (no temperature, penalties or bias: what lm-eval's loglikelihood and vLLM report). The
rows come from the parallel prefill's every-position head over the request's chunk (`Engine.prefill_batch(...,
scores=)`, in the forward it shares with other prompts, sliced or whole) or, for a prompt token that went
through the batched step, from that step's logits row.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx

from dsv4_serve.kernels.upload import upload
from dsv4_serve.service.engine.request import PromptLogprob


class PendingPrompt:
    """Scored prompt positions still on the device; `result()` reads them back."""

    def __init__(self, outs: list[mx.array], k: int) -> None:
        self._outs, self._k = outs, k
        mx.async_eval(*outs)

    def result(self) -> list[PromptLogprob]:
        host = [o.tolist() for o in self._outs]
        out: list[PromptLogprob] = []
        for i, (lp, rank) in enumerate(zip(host[0], host[1], strict=True)):
            top: tuple[tuple[int, float], ...] = ()
            if self._k:
                pairs = sorted(zip(host[2][i], host[3][i], strict=True), key=lambda t: (-t[1], t[0]))
                top = tuple((int(t), float(v)) for t, v in pairs)
            out.append(PromptLogprob(float(lp), int(rank), top))
        return out


def score_lazy(logits: mx.array, next_ids: Sequence[int], k: int) -> PendingPrompt:
    """logits [T, V] (row t scores next_ids[t]); k: top alternatives per position (0: the token's only).
    Rank is 1 + the number of tokens scored strictly higher (vLLM's)."""
    t, v = logits.shape
    if len(next_ids) != t:
        raise ValueError(f"score_lazy: {t} logit rows but {len(next_ids)} next_ids")
    x = logits.astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    ids = upload([int(i) for i in next_ids])[:, None]
    chosen = mx.take_along_axis(lp, ids, axis=-1)
    rank = 1 + (lp > chosen).astype(mx.int32).sum(axis=-1)
    outs = [chosen[:, 0], rank]
    k = min(k, v)
    if k > 0:
        top = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
        outs += [top, mx.take_along_axis(lp, top, axis=-1)]
    return PendingPrompt(outs, k)
