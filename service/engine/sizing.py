"""The decode-state pools' size: what a state budget buys, and what memory is left for the state."""

from __future__ import annotations

import mlx.core as mx

from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.state import StatePools


def pools_for_budget(
    args: ModelArgs, *, max_rows: int, max_model_len: int, budget_bytes: int | None, dtype: mx.Dtype, page_size: int,
    mtp: bool = False,
) -> StatePools:
    """Size the page pools: by default every row can reach max_model_len. A byte budget buys whole
    max_model_len requests' worth of pages (admission then waits for pages instead of failing; shorter
    requests fit more); what is left over goes to more CSA pages. mtp: the MTP block's window ring a slot too."""
    probe = StatePools(args, max_slots=1, max_positions=1, page_size=page_size, dtype=dtype, pages={4: 0, 128: 0},
                       mtp=mtp)
    pages = None
    if budget_bytes is not None:
        left = budget_bytes - max_rows * probe.slot_bytes()
        per_req = {r: probe.pages_for(max_model_len, r) for r in probe.ratios}
        req_bytes = sum(n * probe.page_bytes(r) for r, n in per_req.items())
        if left < req_bytes:
            raise ValueError(
                f"state budget of {budget_bytes} B does not hold {max_rows} rows' fixed state "
                f"({max_rows * probe.slot_bytes()} B) plus one request of max_model_len {max_model_len} "
                f"({req_bytes} B): raise the budget or lower max_model_len / max_rows"
            )
        k = left // max(req_bytes, 1)
        pages = {r: k * n for r, n in per_req.items()}
        if 4 in pages:
            pages[4] += (left - k * req_bytes) // probe.page_bytes(4)
    return StatePools(
        args, max_slots=max_rows, max_positions=max_model_len, page_size=page_size, dtype=dtype, pages=pages, mtp=mtp
    )


def default_state_budget(args: ModelArgs, *, max_rows: int, max_model_len: int, dtype: mx.Dtype, page_size: int,
                         mtp: bool, cache_share: float, free_bytes: int, copies: int = 1) -> int | None:  # fmt: skip
    """The state budget when none is given: what every row reaching max_model_len needs (None), unless that is more
    than 90% of `free_bytes` (less `cache_share` / (1 + cache_share) of it for the prefix cache's slot copies,
    which live outside the pools) over `copies`, the pools' bytes that can be live at once: 2 with the decode
    graphs, which hold each pool's home while MLX writes a copy of it (docs/cuda_graphs.md#serving-at-full-depth)."""
    if copies < 1:
        raise ValueError(f"copies must be >= 1, got {copies}")
    full = pools_for_budget(args, max_rows=max_rows, max_model_len=1, budget_bytes=None, dtype=dtype,
                            page_size=page_size, mtp=mtp)  # fmt: skip
    need = max_rows * full.bytes_for(max_model_len)
    spare = int(0.9 * free_bytes * (1 - cache_share / (1 + cache_share)) / copies)
    return None if need <= spare else spare


def free_device_bytes() -> int:
    """Memory still free for decode state after the weights are loaded: the accelerator's, or the host's."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    total = info.get("memory_size") or info.get("total_memory")
    if mx.default_device() != mx.cpu and total:
        return max(0, int(total) - mx.get_active_memory())
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: no limit beyond the pools' own size
