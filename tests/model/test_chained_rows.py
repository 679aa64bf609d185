"""A chained step: a slot's consecutive positions as rows of ONE decode step (MTP's row-batched verify, a short
prompt's tokens; docs/mtp.md), on the plain twins.

The reference is the same tokens fed one position a step (`DeepseekV4.decode`): every row's logits and, after
each step, the slot's whole state (window ring, compressor rows, page entries, indexer keys) must be the same,
across the sliding window's wrap (W = 8), CSA (4) and HCA (128) window ends, chains of 1..8 rows, and chains of
several requests side by side with single rows, in an order unrelated to the slots."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve import kernels
from dsv4_serve.kernels.rows import rounds
from dsv4_serve.kernels.upload import upload
from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model

CAP, PAGE = 300, 4


@pytest.fixture(scope="module")
def tiny():
    model, args, _ = tiny_model(seed=0)
    toks = np.random.default_rng(5).integers(2, args.vocab_size, (4, CAP)).tolist()
    return model, args, toks


def state(pools: StatePools, h) -> dict[str, np.ndarray]:
    """The slot's per-slot arrays and every page entry its tables hold."""
    mx.synchronize()  # in-place writes (CUDA) done before the host reads
    out = {n: np.array(a[h.slot]) for n, a in pools.slot_arrays().items()}
    for r in pools.ratios:
        for n, a in pools.read_entries(r, h.tables[r], len(h.tables[r]) * PAGE).items():
            out[n] = np.array(a)
    return out


def chained_step(model, pools, work) -> list[np.ndarray]:
    """work: (handle, first position, tokens) a request -> each request's logits [len, vocab] from ONE step."""
    handles, positions, ids = [], [], []
    for h, first, toks in work:
        handles += [h] * len(toks)
        positions += range(first, first + len(toks))
        ids += toks
    batch = model.make_batch(pools, handles, positions)
    assert batch.chained == (len({h.slot for h in handles}) < len(handles))
    logits = model.step(batch, upload(ids), pools)
    mx.eval(logits, pools.arrays())
    lg, out = np.array(logits), []
    for _, _, toks in work:
        out.append(lg[: len(toks)])
        lg = lg[len(toks):]
    return out


def single_steps(model, pools, h, first, toks) -> np.ndarray:
    return np.stack([np.array(model.decode(pools, [h], [t], [first + i])[0]) for i, t in enumerate(toks)])


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray], what: str) -> None:
    for n in a:
        np.testing.assert_array_equal(a[n], b[n], err_msg=f"{what}: {n}")


def test_the_plain_twins_take_chains() -> None:
    assert kernels.chains_supported()  # the CPU suite runs the plain twins


@pytest.mark.parametrize("length", [2, 4, 8])
def test_a_chain_equals_its_single_steps(tiny, length: int) -> None:
    """One request: `length` positions a step against one position a step, over 0..~270 (the ring wraps, CSA
    and HCA windows end inside chains): logits and state bit for bit after every step."""
    model, args, toks = tiny
    pools = StatePools(args, max_slots=2, max_positions=CAP, page_size=PAGE)
    a, b = pools.alloc(CAP), pools.alloc(CAP)
    pos = 0
    sizes = [length, 1, length, 3] * 40
    for n in sizes:
        if pos + n > 270:
            break
        seq = toks[0][pos : pos + n]
        (got,) = chained_step(model, pools, [(a, pos, seq)])
        want = single_steps(model, pools, b, pos, seq)
        np.testing.assert_array_equal(got, want, err_msg=f"logits at {pos}..{pos + n - 1}")
        pos += n
        assert_same(state(pools, a), state(pools, b), f"state after {pos}")
    assert pos > 256  # past the second HCA window's end


def test_chains_beside_single_rows_are_each_request_alone(tiny) -> None:
    """Four requests in ragged states: chains of 3 and 4 rows and two single rows in one step (8 rows), the rows
    in an order unrelated to the slots, against each request fed alone a position a step."""
    model, args, toks = tiny
    pools = StatePools(args, max_slots=8, max_positions=CAP, page_size=PAGE)
    together = [pools.alloc(CAP) for _ in range(4)][::-1]
    alone = [pools.alloc(CAP) for _ in range(4)]
    pos = [0, 125, 3, 250]  # HCA's window end at 127 and 255 inside chains, CSA's everywhere
    for i in range(4):
        if pos[i]:
            for h in (together[i], alone[i]):
                model.prefill(pools, h, toks[i][: pos[i]], 0, logits=False)
    for lengths in ([3, 4, 1, 0], [1, 3, 0, 4], [4, 1, 3, 0], [0, 4, 1, 3], [2, 2, 2, 2]):
        order = [3, 0, 2, 1]
        work = [(together[i], pos[i], toks[i][pos[i] : pos[i] + lengths[i]]) for i in order if lengths[i]]
        got = chained_step(model, pools, work)
        for (h, first, seq), lg in zip(work, got, strict=True):
            i = together.index(h)
            want = single_steps(model, pools, alone[i], first, seq)
            np.testing.assert_array_equal(lg, want, err_msg=f"request {i} at {first}")
            pos[i] += len(seq)
        for i in range(4):
            assert_same(state(pools, together[i]), state(pools, alone[i]), f"request {i} at {pos[i]}")


def test_a_chain_must_be_consecutive_adjacent_rows(tiny) -> None:
    model, args, toks = tiny
    pools = StatePools(args, max_slots=2, max_positions=CAP, page_size=PAGE)
    a, b = pools.alloc(CAP), pools.alloc(CAP)
    for handles, positions, why in (([a, a], [0, 2], "consecutive"), ([a, b, a], [0, 0, 1], "not adjacent"),
                                    ([a, a], [1, 0], "consecutive")):  # fmt: skip
        batch = model.make_batch(pools, handles, positions)
        with pytest.raises(ValueError, match=why):
            model.step(batch, upload([5] * len(handles)), pools)


def test_a_fast_path_of_one_row_a_slot_gets_the_compressors_by_rounds(tiny, monkeypatch) -> None:
    """kernels/chained.py's dispatch, as a fast path sees it: the in-place compressors get the chained batch a launch a
    round (`chain_round`), each after the last's token, and the step still gives the single steps' bits; the
    rounds are counted."""
    from dsv4_serve.kernels import backend
    from dsv4_serve.kernels import compressor as kc

    model, args, toks = tiny
    calls: list[int] = []

    def strict(ref):
        """As the CUDA kernels: a chained batch only with its round named, whose rows alone are written."""
        def fn(batch, *a, chain_round=None, **kw):
            assert batch.chained == (chain_round is not None), "a fast path got a chained batch without its round"
            part = rounds(batch)[chain_round] if batch.chained else batch
            calls.append(part.size)
            return ref(part, *a, **kw)
        return fn

    fast = {"compressor_rows_inplace": strict(kc.compressor_rows_inplace_reference),
            "compressor_pair_rows_inplace": strict(kc.compressor_pair_rows_inplace_reference)}  # fmt: skip
    monkeypatch.setattr(backend, "pick", lambda op, ref: fast.get(op, ref))
    pools = StatePools(args, max_slots=2, max_positions=CAP, page_size=PAGE)
    a, b = pools.alloc(CAP), pools.alloc(CAP)
    pos = 0
    for n in (3, 4, 2, 4, 1, 4):
        seq = toks[1][pos : pos + n]
        calls.clear()
        (got,) = chained_step(model, pools, [(a, pos, seq)])
        assert calls == [1] * (n * sum(1 for r in args.compress_ratios if r))  # a round a launch, one row each
        np.testing.assert_array_equal(got, single_steps(model, pools, b, pos, seq))
        pos += n
        assert_same(state(pools, a), state(pools, b), f"state after {pos}")


@pytest.mark.gpu
@pytest.mark.parametrize("glue", [False, True], ids=["mlx_ring", "glue_ring"])
def test_on_cuda_a_chain_equals_its_single_steps(monkeypatch, glue: bool) -> None:
    """The CUDA path (DSV4_CHAINED_ROWS=1: the compressors a launch a round, the attention through its scratch
    ring, the ring written after it, in place with the glue kernels) against single steps on the same kernels,
    V4-Flash's shapes (4 layers, 16 experts, release precision), two requests side by side over CSA and HCA
    window ends: logits and state bit for bit. Every step has 8 rows (filler requests of their own slots make up
    the rest), as the CUDA weight products' sums depend on a launch's row count, not on the other rows."""
    from dsv4_serve.kernels.backend import cuda_available

    if not cuda_available():
        pytest.skip("needs an MLX CUDA GPU")
    from bench.step import flash_args, random_model
    from dsv4_serve.kernels.cuda import GRAPH_GLUE, set_graph_glue

    monkeypatch.setenv("DSV4_CHAINED_ROWS", "1")
    set_graph_glue(glue)
    try:
        args = flash_args(4, 16)
        model = random_model(args)
        cap, page = 640, 64
        pools = StatePools(args, max_slots=20, max_positions=cap, page_size=page)
        toks = np.random.default_rng(7).integers(2, args.vocab_size, (2, cap)).tolist()
        a = [pools.alloc(cap), pools.alloc(cap)]
        b = [pools.alloc(cap), pools.alloc(cap)]
        fill = {side: [[pools.alloc(cap), 0] for _ in range(7)] for side in ("chained", "single")}
        pos = [250, 123]
        for i in range(2):
            for h in (a[i], b[i]):
                model.prefill(pools, h, toks[i][: pos[i]], 0, logits=False)

        def padded(side: str, work: list, n: int) -> list:
            """`work` and filler rows (a token at each filler's next position) to 8 rows."""
            out = list(work)
            for f in fill[side][: 8 - n]:
                out.append((f[0], f[1], [3 + f[1] % 5]))
                f[1] += 1
            return out

        def state(h) -> dict[str, np.ndarray]:
            mx.synchronize()
            out = {n: np.array(x[h.slot].view(mx.uint16) if x.dtype == mx.bfloat16 else x[h.slot])
                   for n, x in pools.slot_arrays().items()}  # fmt: skip
            for r in pools.ratios:
                for n, x in pools.read_entries(r, h.tables[r], len(h.tables[r]) * page).items():
                    out[n] = np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x)
            return out

        for lengths in ([4, 4], [3, 1], [1, 4], [2, 3], [4, 2]):
            work = [(a[i], pos[i], toks[i][pos[i] : pos[i] + n]) for i, n in enumerate(lengths)]
            got = chained_step(model, pools, padded("chained", work, sum(lengths)))
            for i, n in enumerate(lengths):
                for j in range(n):
                    (want,) = chained_step(model, pools, padded("single", [(b[i], pos[i] + j, [toks[i][pos[i] + j]])],
                                                                1))[:1]  # fmt: skip
                    np.testing.assert_array_equal(got[i][j], want[0], err_msg=f"request {i} at {pos[i] + j}")
                pos[i] += n
            for i in range(2):
                assert_same(state(a[i]), state(b[i]), f"request {i} at {pos[i]}")
    finally:
        set_graph_glue(GRAPH_GLUE)
