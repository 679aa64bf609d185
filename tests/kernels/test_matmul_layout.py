"""A NumPy model of kernels/cuda/matmul_src.py's per-lane layout, run on the CPU: the 16 bytes a lane loads a
row a chunk, the bit moves that decode e4m3 / e2m1 into bf16 (times the e8m0 scale with the exponent
shortfall folded in), the `prmt` permutation of the x fragment, and mma.sync m16n8k16's fragment places.
Their product must be x @ dequantize(W).T: a wrong mapping in the design shows here without a GPU (the
kernel itself is checked against the references by tests/kernels/test_cuda_matmul.py on the GPU)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

CK = {0: 32, 1: 64, 2: 128}  # k values a chunk (64 bytes a row) by weight format: bf16, e4m3, e2m1


def bf16(bits: int) -> float:
    return float(np.array([bits << 16], np.uint32).view(np.float32)[0])


def to_bf16(v: float) -> int:
    u = int(np.array([v], np.float32).view(np.uint32)[0])
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16


def halves(word: int) -> tuple[float, float]:
    return bf16(word & 0xFFFF), bf16(word >> 16)


def prmt(x: int, y: int, sel: int) -> int:
    """CUDA's __byte_perm: result byte i is byte (sel >> 4i) & 7 of y:x."""
    src = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 0xF] << (8 * i) for i in range(4))


def hmul2(word: int, f: float) -> int:
    lo, hi = halves(word)
    return to_bf16(lo * f) | (to_bf16(hi * f) << 16)


def a_pairs(wf: int, words: list[int], st: int, scale: int) -> tuple[int, int]:
    """A row's two bf16x2 words of mma step `st` (logical k c2, c2+1 and c2+8, c2+9) from the lane's 4 words."""
    if wf == 0:
        return words[2 * st], words[2 * st + 1]
    if wf == 1:  # bytes (0, 2) and (1, 3) of word st
        q = words[st]
        q8 = (q << 8) & 0xFFFFFFFF
        lo, hi = (q8 & 0x80008000) | ((q8 & 0x7F007F00) >> 4), (q & 0x80008000) | ((q & 0x7F007F00) >> 4)
    else:  # nibbles (i, i + 4) of word st / 2, i = 2 (st % 2) and + 1
        q = words[st >> 1] >> (8 * (st & 1))
        lo, hi = [(((v << 6) & 0x01C001C0) | ((v << 12) & 0x80008000)) & 0xFFFFFFFF for v in (q, q >> 4)]
    f = 2.0 ** (scale - (7 if wf == 1 else 1))
    return hmul2(lo, f), hmul2(hi, f)


def b_pairs(wf: int, x: list[int], st: int) -> tuple[int, int]:
    """The x fragment's two bf16x2 words of step `st` from the lane's x words (same k order as a_pairs)."""
    if wf == 0:
        return x[2 * st], x[2 * st + 1]
    if wf == 1:
        return prmt(x[2 * st], x[2 * st + 1], 0x5410), prmt(x[2 * st], x[2 * st + 1], 0x7632)
    q, r = st >> 1, st & 1
    return prmt(x[4 * q + r], x[4 * q + 2 + r], 0x5410), prmt(x[4 * q + r], x[4 * q + 2 + r], 0x7632)


def words_at(row_bytes: np.ndarray, off: int) -> list[int]:
    return [int.from_bytes(row_bytes[off + 4 * i : off + 4 * i + 4].tobytes(), "little") for i in range(4)]


@pytest.mark.parametrize("wf", [0, 1, 2])
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_lane_layout_gives_the_dequantized_product(wf: int, rows: int) -> None:
    rng = np.random.default_rng(wf * 10 + rows)
    n, k, ck = 16, 2 * CK[wf], CK[wf]
    w = mx.array((rng.normal(size=(n, k)) * 0.05).astype(np.float32))
    xb = mx.array(rng.normal(size=(rows, k)).astype(np.float32)).astype(mx.bfloat16)
    xbits = np.array(xb.view(mx.uint16))
    if wf == 0:
        wq = w.astype(mx.bfloat16)
        wbytes, wd, sc = np.array(wq.view(mx.uint16)).view(np.uint8).reshape(n, -1), wq.astype(mx.float32), None
    else:
        bits = 8 if wf == 1 else 4
        q, s = mx.quantize(w, group_size=32, bits=bits, mode=f"mxfp{bits}")[:2]
        wd = mx.dequantize(q, s, group_size=32, bits=bits, mode=f"mxfp{bits}").astype(mx.float32)
        wbytes, sc = np.array(q).view(np.uint8).reshape(n, -1), np.array(s)
    want = np.array(xb.astype(mx.float32)) @ np.array(wd).T
    got = np.zeros((8, n))
    for c in range(k // ck):
        am = np.zeros((ck // 16, 16, 16))  # per mma step: A [m rows, k]
        bm = np.zeros((ck // 16, 16, 8))  # B [k, n]
        for lane in range(32):
            g, cq = lane >> 2, lane & 3
            c2, v0 = 2 * cq, c * ck + cq * (ck // 4)
            xw = xbits[g] if g < rows else np.zeros(k, np.uint16)
            xwords = [int(xw[v0 + 2 * i]) | (int(xw[v0 + 2 * i + 1]) << 16) for i in range(ck // 8)]
            for st in range(ck // 16):
                for h in range(2):  # rows g and g + 8
                    words = words_at(wbytes[g + 8 * h], c * 64 + cq * 16)
                    scale = int(sc[g + 8 * h, v0 // 32]) if wf else 0
                    lo, hi = a_pairs(wf, words, st, scale)
                    am[st, g + 8 * h, c2 : c2 + 2] = halves(lo)
                    am[st, g + 8 * h, c2 + 8 : c2 + 10] = halves(hi)
                b0, b1 = b_pairs(wf, xwords, st)
                bm[st, c2 : c2 + 2, g] = halves(b0)
                bm[st, c2 + 8 : c2 + 10, g] = halves(b1)
        got += np.einsum("smk,skn->nm", am, bm)
    assert not got[rows:].any()
    np.testing.assert_allclose(got[:rows], want, rtol=0, atol=1e-5 * np.abs(want).max())


def _fake_kernel(*_: object, **__: object):
    """kernels.cuda.common.kernel's stand-in on the CPU: the launch returns its output buffer filled 0, 1, 2, ..."""

    def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        n = int(np.prod(output_shapes[0]))
        return [mx.arange(n).astype(output_dtypes[0]).reshape(output_shapes[0])]

    return launch


def _nodes(*arrays: mx.array) -> set[str]:
    import re
    import tempfile
    from pathlib import Path

    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        return set(re.findall(r'label ="?([A-Za-z]+)', Path(f.name).read_text()))


def test_the_two_product_forms_hand_out_views_of_their_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    """PAIR 2 writes [2, B, N], CAT [B, N1] then [B, N2] into one buffer: the products handed out are its
    pieces in that order, as slices (an integer index would be one more kernel each: a Gather in MLX)."""
    from dsv4_serve.kernels.cuda import common
    from dsv4_serve.kernels.cuda import matmul as cm

    monkeypatch.setattr(cm, "kernel", _fake_kernel)
    monkeypatch.setattr(common, "_plans", {})
    b, k = 3, 64
    x = mx.zeros((b, k), mx.bfloat16)
    kv, score = cm.f32_linear_pair_rows_cuda(x, mx.zeros((32, k), mx.bfloat16), mx.zeros((32, k), mx.bfloat16))
    w1, s1 = mx.zeros((48, k // 4), mx.uint32), mx.zeros((48, k // 32), mx.uint8)
    w2, s2 = mx.zeros((32, k // 4), mx.uint32), mx.zeros((32, k // 32), mx.uint8)
    qa, kva = cm.qlinear_cat_rows_cuda(x, w1, s1, w2, s2)
    assert not _nodes(kv, score, qa, kva) & {"Gather", "Copy"}  # before anything is evaluated (and detached)
    buf = np.arange(2 * b * 32, dtype=np.float32)
    assert np.array_equal(np.array(kv), buf[: b * 32].reshape(b, 32))
    assert np.array_equal(np.array(score), buf[b * 32 :].reshape(b, 32))
    buf = np.arange(b * 80, dtype=np.float32)
    assert np.array_equal(np.array(qa.astype(mx.float32)), buf[: b * 48].reshape(b, 48))
    assert np.array_equal(np.array(kva.astype(mx.float32)), buf[b * 48 :].reshape(b, 32))
