"""The engine's speculation state (service/engine/speculation.py runs it): k drafts a request, the drafts waiting
for their verify, the counters. Apart from speculation.py so that the Engine holds one without importing the
step functions that take the Engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from dsv4_serve.service.engine.request import Request


@dataclass
class Draft:
    """A request's drafted tokens for positions position + 1.., and the distribution each was drawn from."""

    position: int
    tokens: list[int]
    q: mx.array  # [k, V] f32 (unused for greedy rows)


@dataclass
class Speculator:
    """The engine's speculation: k drafts a request, the drafts waiting for their verify, the counters."""

    k: int
    max_rows: int
    drafts: dict[str, Draft] = field(default_factory=dict)
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # ... and accepted
    verifies: int = 0  # request-steps that verified a draft

    @property
    def max_spec(self) -> int:
        """Requests that verify drafts in one step: their k + 1 positions each fit the kernels' 8 rows."""
        return max(1, self.max_rows // (self.k + 1))

    def propose(self, request: Request, tokens: list[int]) -> list[int]:
        """The drafts `request` verifies next step, given the MTP block's (a test's subclass forces accept / reject
        patterns of greedy rows through it)."""
        return tokens

    def stats(self) -> dict[str, float]:
        return {"spec_drafted_tokens_total": self.drafted, "spec_accepted_tokens_total": self.accepted,
                "spec_verify_steps_total": self.verifies}  # fmt: skip
