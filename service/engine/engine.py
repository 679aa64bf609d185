"""Engine: the model, its decode-state pools and one batched step. Every method runs on the engine thread."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import mlx.core as mx

from model.config import ModelArgs
from model.deepseek_v4 import DeepseekV4
from model.state import StateHandle, StatePools

log = logging.getLogger("dsv4.engine")

Handle = StateHandle


def pools_for_budget(
    args: ModelArgs, *, max_rows: int, max_model_len: int, budget_bytes: int | None, dtype: mx.Dtype, page_size: int
) -> StatePools:
    """Size the page pools: by default every row can reach max_model_len; with a byte budget, fewer pages
    (admission then waits for pages instead of failing)."""
    probe = StatePools(args, max_slots=1, max_positions=1, page_size=page_size, dtype=dtype, pages={4: 0, 128: 0})
    pages = None
    if budget_bytes is not None:
        left = budget_bytes - max_rows * probe.slot_bytes()
        if left <= 0:
            raise ValueError(
                f"state budget {budget_bytes} B is below the fixed state of {max_rows} rows "
                f"({max_rows * probe.slot_bytes()} B)"
            )
        # Positions of growing state the budget holds, shared out over the ratios in step.
        per_pos = sum(probe.page_bytes(r) / (r * page_size) for r in probe.ratios) or 1.0
        positions = int(left / per_pos)
        pages = {r: positions // (r * page_size) for r in probe.ratios}
    return StatePools(
        args, max_slots=max_rows, max_positions=max_model_len, page_size=page_size, dtype=dtype, pages=pages
    )


class Engine:
    def __init__(
        self,
        model: DeepseekV4,
        *,
        max_rows: int = 8,
        max_model_len: int | None = None,
        state_budget_bytes: int | None = None,
        page_size: int = 64,
    ):
        args = model.args
        if not 1 <= max_rows <= 8:
            raise ValueError(f"max_rows must be in 1..8, got {max_rows}")
        limit = args.max_position_embeddings
        if max_model_len is not None and not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len must be in 1..{limit}, got {max_model_len}")
        self.model, self.args = model, args
        self.max_rows = max_rows
        self.max_model_len = max_model_len or limit
        self.vocab_size = args.vocab_size
        self.eos_token_id = args.eos_token_id
        self.pools = pools_for_budget(
            args, max_rows=max_rows, max_model_len=self.max_model_len, budget_bytes=state_budget_bytes,
            dtype=model.dtype, page_size=page_size,
        )

    # ---- state accounting ----------------------------------------------------------------------
    def state_bytes_for(self, n_tokens: int) -> int:
        return self.pools.bytes_for(n_tokens)

    def bytes_in_use(self) -> int:
        return self.pools.bytes_in_use()

    def bytes_budget(self) -> int:
        return self.pools.bytes_total()

    def fits_ever(self, n_tokens: int) -> bool:
        """Could a request of n_tokens positions be admitted into empty pools?"""
        p = self.pools
        if not 1 <= n_tokens <= self.max_model_len:
            return False
        return all(p.pages_for(n_tokens, r) <= p.pages[r] - 1 for r in p.ratios)

    def can_admit(self, n_tokens: int) -> bool:
        return self.pools.can_alloc(n_tokens)

    def admit(self, n_tokens: int) -> Handle:
        return self.pools.alloc(n_tokens)

    def release(self, handle: Handle) -> None:
        self.pools.free(handle)

    # ---- the step ------------------------------------------------------------------------------
    def step(self, feeds: Sequence[tuple[Handle, int, int]]) -> mx.array:
        """One batched step: row i feeds token feeds[i][1] at position feeds[i][2]. Returns logits [B, V] f32;
        the state update is already scheduled with them, so the sampler's one sync covers both."""
        if not 1 <= len(feeds) <= self.max_rows:
            raise ValueError(f"step: rows must be 1..{self.max_rows}, got {len(feeds)}")
        handles = [f[0] for f in feeds]
        batch = self.model.make_batch(self.pools, handles, [f[2] for f in feeds])
        tokens = mx.array([f[1] for f in feeds], dtype=mx.int32)
        logits = self.model.step(batch, tokens, self.pools)
        mx.async_eval(logits, self.pools.arrays())
        return logits

    def warmup(self) -> None:
        """Run full-width steps once so every kernel variant is compiled before /ready says yes."""
        t0 = time.perf_counter()
        handles = [self.admit(2) for _ in range(self.max_rows)]
        try:
            for width in sorted({1, self.max_rows}):
                mx.eval(self.step([(h, 0, 0) for h in handles[:width]]))
        finally:
            for h in handles:
                self.release(h)
        log.info("warm-up took %.2f s", time.perf_counter() - t0)


def build_engine(
    model_dir: str | None,
    *,
    max_rows: int = 8,
    max_model_len: int | None = None,
    state_budget_bytes: int | None = None,
):
    """(Engine, tokenizer or None). No model_dir: the embedded tiny model and tokenizer."""
    from model.loader import load_model, tiny_model
    from model.tokenizer import load_tokenizer

    if model_dir is None:
        model, _args, tokenizer = tiny_model()
    else:
        model, _args = load_model(model_dir)
        tokenizer = load_tokenizer(model_dir)
    engine = Engine(
        model, max_rows=max_rows, max_model_len=max_model_len, state_budget_bytes=state_budget_bytes
    )
    return engine, tokenizer
