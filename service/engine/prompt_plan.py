"""The scheduler's prompt planning (a mixin of `Scheduler`): the prefix cache's adoption, the pieces of prompts
handed to the engine's parallel prefill before each step, and where those pieces end (the snapshot grid, a
chat's system prompt, a prefix shared with another piece of the same forward). Pure Python, no mlx.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dsv4_serve.service.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from dsv4_serve.model.state import StateHandle

Piece = tuple[Request, "StateHandle", list[int], int]  # (request, state handle, prompt tokens, start position)

# A chat's system prompt (the positions before its first user turn) is snapshotted on its own, at the cost of one
# more prefill forward for the first conversation, from this many positions on (a shorter one costs less to
# compute again than that forward).
SYSTEM_SNAPSHOT_MIN = 512


def first_turn(prompt_ids: list[int], token: int | None) -> int:
    """The position of the first `token` (the first user turn's marker) in the prompt; -1 if none."""
    if token is None:
        return -1
    try:
        return prompt_ids.index(token)
    except ValueError:
        return -1


class PromptPlanning:
    """Needs `admission` (its optional prefix-cache hooks: snapshot_interval, snapshot_token, prefix_version,
    reuse) and `handles` (request id -> state handle), as Scheduler has them."""

    admission: Any
    handles: dict[str, StateHandle]

    def reuse_prefix(self, r: Request) -> None:
        """A prefilling request adopts the longest cached prefix of its prompt beyond what it has fed
        (looked up again only when the cache has changed since its last lookup). Not with prompt logprobs:
        those score every prompt position, so each must be computed."""
        reuse = getattr(self.admission, "reuse", None)
        if reuse is None or r.status is not RequestStatus.RUNNING or r.fed >= len(r.prompt_ids) - 1:
            return
        if r.params.prompt_logprobs is not None or r.leader is not None or r.canary:
            return
        version = self.admission.prefix_version()  # type: ignore[attr-defined]
        if r.prefix_seen == version:
            return
        r.prefix_seen = version
        got = reuse(self.handles[r.request_id], r.prompt_ids, r.fed, r.namespace)
        if got is not None:
            self.handles[r.request_id], r.fed = got
            r.cached = r.fed

    def prefill_work(self, plan: list[Request], budget: int) -> list[Piece]:
        """(request, handle, prompt tokens, start position) to prefill before this step, at most `budget`
        tokens in all, one piece a request, oldest first (a prompt's rows then sit where they would alone,
        which keeps its logits' bits: a row's offset in a forward can change them); a prompt's last token is left for
        the step (its logits are sampled). With a snapshot interval, a piece short of the prompt's end ends at
        the interval's last multiple in it (a prefix cache snapshot follows each piece). Not cut at every
        multiple: each piece would be a forward of its own, and a forward has a large fixed cost (16K-token
        first turn on the H200 with cuts at every 128: 113 s, against 32 s with the cache off, 383f696)."""
        work: list[Piece] = []
        every = getattr(self.admission, "snapshot_interval", 0)
        for r in plan:
            start, last = r.fed, len(r.prompt_ids) - 1
            end = start + max(0, min(budget, last - start))
            if every and end < last and end // every * every > start:
                end = end // every * every
            at = first_turn(r.prompt_ids, getattr(self.admission, "snapshot_token", None)) if every else -1
            if start < at < end and at >= SYSTEM_SNAPSHOT_MIN:
                end = at  # a snapshot before the first user turn: other conversations share the system prompt
            if every and end > start and self._share(work, r, start, end, every):
                continue  # it adopts the earlier piece's snapshot next step instead of computing it again
            budget -= end - start
            if end > start:
                work.append((r, self.handles[r.request_id], r.prompt_ids[start:end], start))
        return work

    @staticmethod
    def _share(work: list[Piece], r: Request, start: int, end: int, every: int) -> bool:
        """Does r's piece begin with >= `every` tokens of an earlier piece at the same start (prompts that arrive
        together with a shared system prompt)? Then that piece is cut at the shared part's last snapshot
        boundary (its snapshot is what r adopts) and r waits a step. Pieces are compared as lists."""
        for i, (q, h, toks, s) in enumerate(work):
            if s != start:
                continue
            n = next((j for j, (x, y) in enumerate(zip(toks, r.prompt_ids[start:end], strict=False)) if x != y),
                     min(len(toks), end - start))  # fmt: skip
            if n >= len(toks) >= every:  # that piece ends inside the shared part: its snapshot serves as it is
                return True
            cut = (start + n) // every * every
            if cut - start >= every:
                work[i] = (q, h, toks[: cut - start], s)
                return True
        return False

    def prefilled(self, request: Request, n: int) -> None:
        """`n` prompt tokens of `request` were fed by a parallel prefill."""
        request.fed += n
