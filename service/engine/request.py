"""Pure data shared by the event loop and the engine thread: no mlx here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple


@dataclass(frozen=True)
class Guide:
    """A grammar the row's output must match (service/engine/grammar.py compiles and enforces it): the
    compiled grammar (opaque here) and the request field that asked for it."""

    grammar: Any = field(compare=False)
    source: str = "grammar"


class PromptLogprob(NamedTuple):
    """One scored prompt position: the prompt token's raw logprob, its rank, the top alternatives."""

    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()

# A request's prefix cache namespace: (tenant, cache_salt). The tenant is a digest of its API key
# (service/api/auth.py; "" when the server runs without keys), the salt vLLM's `cache_salt` ("" when none):
# cached state is found, stored, exported and imported only within one namespace.
Namespace = tuple[str, str]
SHARED: Namespace = ("", "")

SAMPLING_EPS = 1e-5
LOGPROB_FLOOR = -9999.0  # what vLLM reports for a -inf logprob: every number on the wire is finite


def finite_logprob(v: float) -> float:
    """v, or LOGPROB_FLOOR for -inf (a masked token) and NaN."""
    return v if v >= LOGPROB_FLOOR else LOGPROB_FLOOR


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # None: no logprobs. 0: the chosen token's logprob only. k > 0: plus the top k alternatives.
    logprobs: int | None = None
    # Prompt logprobs: None off, else the number of alternatives per prompt position (0: the token's only).
    prompt_logprobs: int | None = None
    # (token id, bias) added to the logits before sampling (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    guide: Guide | None = None  # constrained decoding: every sampled token keeps the output inside it

    @property
    def greedy(self) -> bool:
        """Temperatures below SAMPLING_EPS are greedy (as vLLM): dividing by them overflows f32."""
        return self.temperature < SAMPLING_EPS


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id, or (API side) a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client gone or server draining


class FirstToken(NamedTuple):
    """A request's way to its first token, perf_counter stamps taken on the engine thread (the API side adds its
    arrival before and the first byte after: /metrics' dsv4_ttft_phase_seconds)."""

    submitted: float  # queued by the worker (worker.submit_n)
    admitted: float  # given a row and its state (Scheduler.plan)
    prefilled: float  # its prompt fed but the last token: the step that samples it begins (Scheduler.resume)
    sampled: float  # its first token read back (Scheduler.on_step)


@dataclass(frozen=True)
class TokenEvent:
    """One generated token, or the end of a request (finish_reason set), or an engine error."""

    request_id: str
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    finish_reason: FinishReason | None = None
    error: str | None = None
    # With `error`: the request field whose ask ended it (a grammar over its mask budget: a 400 naming it, not
    # an engine failure).
    error_param: str | None = None
    # A STOP event's stop token (EOS or a stop id), with `logprob` / `top_logprobs`: never text, but a
    # generated token for usage and logprobs (lm-eval's loglikelihood drops the last generated entry).
    stop_token: int | None = None
    # Scored prompt positions, in order (positions 1.. of the prompt; position 0 has none).
    prompt_logprobs: tuple[PromptLogprob, ...] = ()
    cached_tokens: int | None = None  # prompt tokens taken from the prefix cache (None: no cache)
    first: FirstToken | None = field(default=None, compare=False)  # on its first generated token only (timing)


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens already fed through the model (prompt first, then generated ones).
    fed: int = 0
    # n > 1: rows sharing this prompt; they are admitted with it and take a copy of its state once its
    # prompt (all but the last token) is fed (`Scheduler.fork`). `leader` is set on them until then.
    followers: list[Request] = field(default_factory=list, repr=False, compare=False)
    leader: Request | None = field(default=None, repr=False, compare=False)
    # The prompt logprobs scored so far, kept for followers (they get them at the fork).
    scored: list[PromptLogprob] = field(default_factory=list, repr=False, compare=False)
    guide_state: Any = None  # the grammar matcher of a guided request (engine thread only)
    cached: int | None = None  # prompt tokens adopted from the prefix cache (None: the cache is off)
    prefix_seen: int = -1  # the prefix cache's version at this request's last lookup
    namespace: Namespace = SHARED  # where its prefix cache lookups and stores go
    canary: bool = False  # the correctness canary's row (canary.py): no prefix cache, no client, no usage
    # Stamps on the way to the first token (FirstToken): perf_counter seconds, 0.0 until reached.
    submitted: float = field(default_factory=time.perf_counter, repr=False, compare=False)
    admitted: float = field(default=0.0, repr=False, compare=False)
    prefilled_at: float = field(default=0.0, repr=False, compare=False)

    @property
    def total_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def first_token(self, sampled: float) -> FirstToken:
        """Its way to the first token, sampled at `sampled` (a prompt fed whole by admission: prefilled then)."""
        return FirstToken(self.submitted, self.admitted, self.prefilled_at or self.admitted, sampled)


def check_admissible(prompt_ids: list[int], params: SamplingParams, max_model_len: int, max_fit_tokens: int,
                     bytes_budget: int) -> None:  # fmt: skip
    """ValueError (the API's 400) for a request that can never run: empty prompt, no tokens asked,
    longer than the model's context or than one request's decode state can ever hold."""
    n = len(prompt_ids) + params.max_tokens
    if not prompt_ids:
        raise ValueError("prompt is empty")
    if params.max_tokens < (0 if params.prompt_logprobs is not None else 1):  # 0: score the prompt only
        raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
    what = f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {n}"
    if n > max_model_len:
        raise ValueError(f"{what} exceeds max_model_len {max_model_len}")
    if n > max_fit_tokens:
        raise ValueError(f"{what} positions exceed the {max_fit_tokens} that fit the decode state "
                         f"budget of {bytes_budget} bytes")  # fmt: skip


class StateError(ValueError):
    """A decode state this server cannot import or export: malformed, corrupt, another version or model."""


class StateNotFound(LookupError):
    """No cached decode state under this id for this API key (never finished here, evicted, or another key's)."""


class StateConflict(StateError):
    """An import that would change nothing or replace something: its tokens are cached in its namespace already,
    or this export was imported here before (a replay)."""
