"""Launch-plan arithmetic of the CUDA fast path (pure Python: runs without a GPU).

The kernels assume things of their plans that no GPU test would show as a clean failure: a
segment size the pipeline chunk divides, shared memory within the H200's 227 KB per block, no
empty split, one split exactly when the combine launch is dropped.
"""

from __future__ import annotations

import math

import pytest

from dsv4_serve.kernels.cuda import attention as at
from dsv4_serve.kernels.cuda import indexer as ix

SMEM_MAX = 227 * 1024  # per block on sm_90


@pytest.mark.parametrize("topk", [1, 100, 512, 1024, 2048])
@pytest.mark.parametrize("cap", [ix.ONE_MAX + 64, 65_536, 262_144, 1 << 20, 1 << 22])
def test_indexer_segment_size(cap: int, topk: int) -> None:
    seg = ix.segment_size(cap, topk)
    nseg = math.ceil(cap / seg)
    assert seg & (seg - 1) == 0 and seg % ix.CH == 0  # whole pipeline chunks
    assert seg >= 2 * ix.next_pow2(topk)  # a segment keeps at most half of what it scores
    assert nseg >= 2  # beyond ONE_MAX a row always spans segments (the merge has work)
    assert nseg <= 32 or seg == ix.MAX_SEG  # the merge reads nseg * topk candidates per row
    for ni, di in ((16, 16), (64, 128), (128, 256)):
        assert ix.smem_bytes(ni, di, seg + 2048) <= SMEM_MAX
    assert 8 * ix.MERGE_CAP + 2048 * 4 + 256 <= SMEM_MAX  # the merge's kept candidates + histogram


# seg by hand: ctx / 4 entries in ~32 segments (a power of 2), at least max(1024, 2 x topk) entries each
@pytest.mark.parametrize(
    ("ctx", "topk", "seg", "dense"),
    [(131_072, 512, 1024, True), (131_072, 1024, 2048, True), (131_072, 100, 1024, False),
     (524_288, 512, 4096, False), (1 << 20, 512, 8192, False), (1 << 20, 2048, 8192, False)],
)  # fmt: skip
def test_indexer_dense_segments_rule(ctx: int, topk: int, seg: int, dense: bool) -> None:
    """Segments of at most 2 * topk entries (a select would keep at least half of one) hand the merge every
    key: 128K context at top-512 / 1024."""
    assert ix.segment_size(ctx // 4, topk) == seg
    assert ix.dense_segments(seg, topk) == dense


def test_indexer_carveout_padding() -> None:
    """The 128K form's padding puts the segment kernel (2 blocks an SM) and the merge (1) in the SM's largest
    carveout (above 196 KB, within 228), keeps their occupancy and a block's 227 KB limit, and is only ever
    larger than what the kernels need."""
    seg = ix.segment_size(131_072 // 4, 512)
    assert ix.segment_min_blocks(seg) == 2
    need = ix.smem_bytes(64, 128, seg + 2048)
    assert need <= ix.CARVE_SEG and 196 * 1024 < 2 * (ix.CARVE_SEG + 1024) <= 228 * 1024
    assert 8 * ix.MERGE_CAP <= ix.CARVE_MERGE and 196 * 1024 < ix.CARVE_MERGE + 1024 <= SMEM_MAX


def test_indexer_carveout_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off with DSV4_IDX_CARVE=0, on a CPU (no compute capability), and on GPUs without 228 KB of shared
    memory an SM (8.x, 12.x: the padded 200 KB merge would not launch there)."""
    monkeypatch.setenv("DSV4_IDX_CARVE", "0")
    assert not ix.carve()
    monkeypatch.setenv("DSV4_IDX_CARVE", "1")
    if ix.mx.default_device() == ix.mx.cpu:
        assert not ix.carve()
    for major, on in ((8, False), (9, True), (10, True), (12, False)):  # each GPU kind, by its reported capability
        monkeypatch.setattr(ix.mx, "device_info", lambda m=major: {"compute_capability_major": m})
        assert ix.carve() is on, major


@pytest.mark.parametrize("cap", [64, 2048, 8192, 8256, ix.ONE_MAX])
def test_indexer_one_launch_plan(cap: int) -> None:
    eb = ix.one_block(cap)
    assert eb % ix.CH == 0  # whole pipeline chunks per block
    for ni, di in ((16, 16), (64, 128), (128, 256)):
        smem = ix.smem_bytes(ni, di, 2048, ix.ONE_STAGES)
        assert smem <= SMEM_MAX
    # 3 blocks per SM (228 KB) at the model's 64 heads x 128 dims
    assert 3 * (ix.smem_bytes(64, 128, 2048, ix.ONE_STAGES) + 1024) <= 228 * 1024


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("nchunk", [17, 18, 130, 4097])
def test_attention_splits(rows: int, nchunk: int) -> None:
    groups = 4  # 64 heads / 16 per block
    ns = at.splits(rows, groups, nchunk)
    per = math.ceil(nchunk / ns)
    assert 1 <= ns <= nchunk
    assert (ns - 1) * per < nchunk  # every split has a chunk
    if ns == nchunk:  # one chunk per block: those blocks hold no O buffer
        assert rows * groups * nchunk <= 2 * at.TARGET_BLOCKS


@pytest.mark.parametrize("rows", range(1, 9))
@pytest.mark.parametrize("d", [32, 64, 128, 512])
def test_attention_dsplit_slices(rows: int, d: int) -> None:
    ds = at.dsplit_slices(rows, 4, d)
    assert ds & (ds - 1) == 0 and d % ds == 0
    assert (d // ds) % 16 == 0 and (d // ds >= 32 or ds == 1)  # whole 16-column mma tiles
    assert rows * 4 * ds >= at.TARGET_DSPLIT or ds == 1 or d // ds == 32  # as many blocks as the slices allow
    assert at.dsplit_smem(d) <= at.SMEM_MAX


def test_attention_shared_memory() -> None:
    for d in (64, 128, 512):
        assert at.smem_bytes(d) <= SMEM_MAX
        assert at.smem_bytes(d, one=True) < at.smem_bytes(d)
        assert at.dsplit_smem(d) <= SMEM_MAX
        assert at.wide_smem(d) <= SMEM_MAX
    assert 2 * at.smem_bytes(512, one=True) <= 228 * 1024  # two one-chunk blocks per multiprocessor
    assert 2 * (at.wide_smem(512, 32) + 1024) <= 228 * 1024  # two 32-head wide blocks per multiprocessor


@pytest.mark.parametrize("setting", [64, 32])
def test_wide_heads(setting: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(at, "WIDE_HG", setting)
    assert at.wide_heads(64, 512) == setting  # the model's 64 heads x 512
    assert at.wide_heads(64, 128) == 64  # 32 heads need D a multiple of 256 (128 dims per warp in O)
    assert at.wide_heads(96, 512) == (32 if setting == 32 else 64)
