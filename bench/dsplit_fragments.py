"""Offline check of the mma dsplit's fragment address math (no GPU): a numpy emulation of ldmatrix.x4
(and .trans) and mma.m16n8k16 per lane, driven by the kernel's lane address formulas (transcribed from
attention_dsplit_src.DSPLIT). S = Q K^T and every D slice of P V are compared with numpy. Pure Python,
slow (~1 min at D 512).

    python bench/dsplit_fragments.py [D DS]     (default 512 4; the model's cases: 512 with 1, 4, 16; 64 with 2)
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import numpy as np

HG, CK = 16, 64
Regs = list[list[tuple[float, float]]]  # [lane][register] -> the register's two 16-bit halves


def ldsm4(buf: np.ndarray, addr: Callable[[int], tuple[int, int]], trans: bool = False) -> Regs:
    """ldmatrix.x4: lanes 8i..8i+7 give the rows of matrix i; lane l receives row l / 4, columns
    2 (l % 4), +1 of each matrix (of its transpose with .trans)."""
    rows = [addr(lane) for lane in range(32)]
    out: Regs = [[(0.0, 0.0)] * 4 for _ in range(32)]
    for i in range(4):
        mat = np.array([buf[r, c : c + 8] for r, c in rows[8 * i : 8 * i + 8]])
        if trans:
            mat = mat.T
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            out[lane][i] = (mat[g, 2 * t], mat[g, 2 * t + 1])
    return out


def mma(acc: list[list[float]], a: Regs, b: Regs, hi: bool) -> None:
    """acc += A (16 x 16, registers a) x B (16 x 8: registers b[.][0], b[.][1], or 2, 3 when `hi`)."""
    am, bm = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        am[g, 2 * t : 2 * t + 2], am[g + 8, 2 * t : 2 * t + 2] = a[lane][0], a[lane][1]
        am[g, 2 * t + 8 : 2 * t + 10], am[g + 8, 2 * t + 8 : 2 * t + 10] = a[lane][2], a[lane][3]
        bm[2 * t : 2 * t + 2, g], bm[2 * t + 8 : 2 * t + 10, g] = b[lane][2 * hi], b[lane][2 * hi + 1]
    c = am @ bm
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for r in range(4):
            acc[lane][r] += c[g + 8 * (r >> 1), 2 * t + (r & 1)]


def tile(out: np.ndarray, acc: list[list[float]], col: int) -> None:
    """An accumulator n8 tile to out[16, .] at column col (rows gr, gr + 8; columns c2, c2 + 1)."""
    for lane in range(32):
        gr, c2 = lane >> 2, (lane & 3) * 2
        out[gr, col + c2 : col + c2 + 2] = acc[lane][0:2]
        out[gr + 8, col + c2 : col + c2 + 2] = acc[lane][2:4]


def arow(lane: int) -> int:
    return (lane & 7) + ((lane >> 3) & 1) * 8


def main() -> None:
    d, ds_n = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (512, 4)
    dsl, ldk, ldp = d // ds_n, d + 8, CK + 8
    rng = np.random.default_rng(0)
    q, k, p = rng.standard_normal((HG, d)), rng.standard_normal((CK, d)), rng.standard_normal((HG, CK))
    qs, ks_buf, ps = np.zeros((HG, ldk)), np.zeros((CK, ldk)), np.zeros((HG, ldp))
    qs[:, :d], ks_buf[:, :d], ps[:, :CK] = q, k, p
    s = np.zeros((2, HG, CK))  # QK: warp (16 keys kt, half of D) -> Ss[half]
    for warp in range(8):
        kt, half = warp & 3, warp >> 2
        acc = [[[0.0] * 4 for _ in range(32)] for _ in range(2)]
        for ks in range(half * (d // 32), (half + 1) * (d // 32)):
            a = ldsm4(qs, lambda lane, ks=ks: (arow(lane), (lane >> 4) * 8 + ks * 16))
            bk = ldsm4(ks_buf, lambda lane, ks=ks, kt=kt: (kt * 16 + (lane >> 4) * 8 + (lane & 7),
                                                             ((lane >> 3) & 1) * 8 + ks * 16))  # fmt: skip
            mma(acc[0], a, bk, False)
            mma(acc[1], a, bk, True)
        for j in range(2):
            tile(s[half], acc[j], kt * 16 + j * 8)
    print(f"D {d}: QK max error {np.abs(s.sum(0) - q @ k.T).max():.2e}")
    nt16 = dsl // 16
    pa = [ldsm4(ps, lambda lane, ks=ks: (arow(lane), ks * 16 + (lane >> 4) * 8)) for ks in range(CK // 16)]
    for ds in range(ds_n):  # PV: warp w, 16-column tiles w, w + 8, ..
        o = np.full((HG, dsl), np.nan)
        for nt in range(nt16):
            oacc = [[[0.0] * 4 for _ in range(32)] for _ in range(2)]
            for ks in range(CK // 16):
                bv = ldsm4(ks_buf, lambda lane, ks=ks, nt=nt, ds=ds: (ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7),
                                                                       (lane >> 4) * 8 + ds * dsl + nt * 16),
                           trans=True)  # fmt: skip
                mma(oacc[0], pa[ks], bv, False)
                mma(oacc[1], pa[ks], bv, True)
            for j in range(2):
                tile(o, oacc[j], nt * 16 + j * 8)
        err = np.abs(o - p @ k[:, ds * dsl : (ds + 1) * dsl]).max()
        print(f"D {d}, slice {ds} of {ds_n}: PV max error {err:.2e}")


if __name__ == "__main__":
    main()
