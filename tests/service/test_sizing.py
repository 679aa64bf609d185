"""The default decode-state budget (`sizing.default_state_budget`): every row at max_model_len when memory allows,
else what free memory leaves, halved where the decode graphs keep a second copy of the pools live."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dsv4_serve.model.config import ModelArgs
from dsv4_serve.service.engine.sizing import default_state_budget, pools_for_budget

ROWS, LEN, PAGE = 4, 4096, 64


def budget(free: int, copies: int = 1, share: float = 0.0) -> int | None:
    return default_state_budget(ModelArgs.tiny(), max_rows=ROWS, max_model_len=LEN, dtype=mx.float32,
                                page_size=PAGE, mtp=False, cache_share=share, free_bytes=free, copies=copies)


def full_bytes() -> int:
    """The pools that let every row reach max_model_len, sized on their own."""
    return pools_for_budget(ModelArgs.tiny(), max_rows=ROWS, max_model_len=LEN, budget_bytes=None, dtype=mx.float32,
                            page_size=PAGE).bytes_total()


def test_ample_memory_sizes_every_row_at_max_model_len() -> None:
    assert budget(100 * full_bytes()) is None
    assert budget(100 * full_bytes(), copies=2) is None


def test_graphs_leave_room_for_a_second_copy_of_the_pools() -> None:
    free = full_bytes()  # 90% of it cannot hold the full pools: the budget binds
    one, two = budget(free), budget(free, copies=2)
    assert one is not None and two is not None
    assert one <= 0.9 * free and abs(2 * two - one) <= 2
    # what the halved budget buys fits twice beside itself in the memory the single one had
    pools = pools_for_budget(ModelArgs.tiny(), max_rows=ROWS, max_model_len=LEN, budget_bytes=two, dtype=mx.float32,
                             page_size=PAGE)
    assert 2 * pools.bytes_total() <= one + 1
    # the prefix cache's share comes off before the copies
    assert budget(free, copies=2, share=0.25) < two


def test_copies_must_be_positive() -> None:
    with pytest.raises(ValueError, match="copies must be >= 1"):
        budget(full_bytes(), copies=0)
