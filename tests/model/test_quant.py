"""FP8 / FP4 release formats: decoding bit for bit against an independent NumPy decoder written from the
spec (section 4), the MLX mxfp8/mxfp4 mapping, the encoder, and the quantized experts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.model.layers import Experts
from dsv4_serve.model.quant import (
    QuantizedExperts,
    dequant_fp4,
    dequant_fp8,
    encode_fp4,
    encode_fp8,
    fp4_to_mxfp4,
    fp8_to_mxfp8,
)


# ---- independent reference decoders: bit fields -> float64 -> float32 -------------------------------
def ref_e4m3(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.int64)
    s, e, m = b >> 7, (b >> 3) & 15, b & 7
    v = np.where(e == 0, m * 2.0**-9, (8 + m) * 2.0 ** (e - 10.0))
    v = np.where((e == 15) & (m == 7), np.nan, v)
    return np.where(s == 1, -v, v)


def ref_ue8m0(b: np.ndarray) -> np.ndarray:
    return np.where(b == 255, np.nan, 2.0 ** (b.astype(np.float64) - 127))


def ref_e2m1(nib: np.ndarray) -> np.ndarray:
    s, e, m = nib >> 3, (nib >> 1) & 3, nib & 1
    v = np.where(e == 0, m * 0.5, (2 + m) * 2.0 ** (e - 2.0))  # e2m1: bias 1, subnormal 0 / 0.5
    return np.where(s == 1, -v, v)


def ref_fp8(q: np.ndarray, sb: np.ndarray) -> np.ndarray:
    n, k = q.shape
    s = np.kron(ref_ue8m0(sb), np.ones((128, 128)))[:n, :k]
    with np.errstate(over="ignore"):
        return (ref_e4m3(q) * s).astype(np.float32)


def ref_fp4(packed: np.ndarray, sb: np.ndarray) -> np.ndarray:
    u = packed.view(np.uint8).astype(np.int64)
    codes = np.empty((u.shape[0], 2 * u.shape[1]), np.int64)
    codes[:, 0::2], codes[:, 1::2] = u & 15, u >> 4  # element 2j in the low nibble
    with np.errstate(over="ignore"):
        return (ref_e2m1(codes) * np.repeat(ref_ue8m0(sb), 32, axis=1)).astype(np.float32)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32)))


def test_reference_decoders_match_the_spec_tables() -> None:
    assert ref_e2m1(np.arange(8)).tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert ref_e4m3(np.array([0x7E, 0x08, 0x01, 0x38, 0xB8])).tolist() == [448, 2.0**-6, 2.0**-9, 1, -1]


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


def _scales(rng: np.random.Generator, shape: tuple[int, int]) -> np.ndarray:
    sb = rng.integers(0, 255, shape).astype(np.uint8)  # 0..254: 255 is NaN, rejected by the loader
    flat = sb.reshape(-1)
    flat[:6] = [0, 1, 254, 253, 127, 126]  # both extremes of UE8M0, overflow to inf included
    return sb


def test_fp8_dequant_bit_exact(rng) -> None:
    q = rng.integers(0, 256, (300, 260)).astype(np.uint8)
    q.reshape(-1)[:256] = np.arange(256)  # every e4m3 code, both signs, NaN and subnormals
    sb = _scales(rng, (3, 3))
    want = ref_fp8(q, sb)
    got = np.array(dequant_fp8(mx.array(q), mx.array(sb)))
    assert same_bits(got, want)
    assert np.isinf(want).any() and (np.abs(want[want != 0]) < 2.0**-126).any()  # extremes really hit


def test_fp4_dequant_bit_exact(rng) -> None:
    packed = rng.integers(-128, 128, (64, 96)).astype(np.int8)
    packed.reshape(-1)[:256] = np.arange(256).astype(np.uint8).view(np.int8)  # every nibble pair
    sb = _scales(rng, (64, 6))
    want = ref_fp4(packed, sb)
    assert same_bits(np.array(dequant_fp4(mx.array(packed), mx.array(sb))), want)


@pytest.mark.parametrize("lo,hi", [(100, 150), (0, 255)])
def test_mlx_mxfp_mapping_bit_exact(rng, lo: int, hi: int) -> None:
    q = rng.integers(0, 256, (256, 384)).astype(np.uint8)
    q[(q & 0x7F) == 0x7F] = 0  # MLX has no NaN handling to compare; NaN codes are tested above
    sb8 = rng.integers(lo, hi, (2, 3)).astype(np.uint8)
    w, s = fp8_to_mxfp8(mx.array(q), mx.array(sb8))
    got = mx.dequantize(w, s, None, group_size=32, bits=8, mode="mxfp8", dtype=mx.float32)
    assert same_bits(np.array(got), ref_fp8(q, sb8))
    packed = rng.integers(-128, 128, (64, 96)).astype(np.int8)
    sb4 = rng.integers(lo, hi, (64, 6)).astype(np.uint8)
    w, s = fp4_to_mxfp4(mx.array(packed), mx.array(sb4))
    got = mx.dequantize(w, s, None, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
    assert same_bits(np.array(got), ref_fp4(packed, sb4))


def test_encoders_round_trip_and_bound_the_error(rng) -> None:
    w = (rng.standard_normal((200, 256)) * rng.uniform(1e-3, 10, (200, 1))).astype(np.float32)
    q, sb = encode_fp8(w)
    assert q.shape == w.shape and sb.shape == (2, 2)
    d = ref_fp8(q, sb)
    assert np.all(np.abs(d - w) <= np.abs(w) / 16 + np.kron(ref_ue8m0(sb), np.ones((128, 128)))[:200] * 2.0**-10)
    assert np.array_equal(ref_fp8(*encode_fp8(d)), d)  # representable values encode exactly
    p, sb4 = encode_fp4(w)
    assert p.shape == (200, 128) and p.dtype == np.int8 and sb4.shape == (200, 8)
    d4 = ref_fp4(p, sb4)
    assert np.all(np.abs(d4 - w) <= np.repeat(ref_ue8m0(sb4), 32, axis=1) * 1.0)  # spacing 2 between 4 and 6
    assert np.array_equal(ref_fp4(*encode_fp4(d4)), d4)


def test_quantized_experts_match_dequantized(rng) -> None:
    from dsv4_serve.model.config import ModelArgs

    args = ModelArgs.tiny()
    e, inter, h = args.n_routed_experts, args.moe_intermediate_size, args.hidden_size
    ref, qw = Experts(args), {}
    for name, (o, i) in {"w1": (inter, h), "w2": (h, inter), "w3": (inter, h)}.items():
        enc = [encode_fp4(rng.standard_normal((o, i)).astype(np.float32) / np.sqrt(i)) for _ in range(e)]
        setattr(ref, name, mx.stack([dequant_fp4(mx.array(p), mx.array(s)) for p, s in enc]))
        w, s = zip(*(fp4_to_mxfp4(mx.array(p), mx.array(s)) for p, s in enc), strict=True)
        qw[name], qw[f"{name}_scales"] = mx.stack(w), mx.stack(s)
    qe = QuantizedExperts(qw, args.swiglu_limit)
    x = mx.array(rng.standard_normal((5, h)).astype(np.float32))
    idx = mx.array(np.argsort(rng.random((5, e)), axis=1)[:, :2].astype(np.int32))
    wts = mx.array(rng.random((5, 2)).astype(np.float32))
    np.testing.assert_allclose(np.array(qe(x, idx, wts)), np.array(ref(x, idx, wts)), atol=1e-5, rtol=1e-5)
