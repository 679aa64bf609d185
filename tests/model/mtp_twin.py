"""A float64 NumPy twin of DeepSeek-V4's MTP block, written from the reference's math (DeepSeek's
inference/model.py `MTPBlock(Block)`, with the Block / Attention / MoE / HyperHead math of
../shared/docs/deepseek_v4.md sections 2.2-2.9), one row and one position at a time.

It reads the checkpoint itself (its own safetensors header parser and FP8 / FP4 + UE8M0 decoding) and never
calls the project's model code: config.json + the release-named tensors in, draft logits out.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8,
       "U8": np.uint8, "I8": np.int8, "I32": np.int32, "I64": np.int64}  # fmt: skip
_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def read_safetensors(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (stored dtype, raw array) of one safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, h in header.items():
        lo, hi = h["data_offsets"]
        a = np.frombuffer(raw[8 + n + lo : 8 + n + hi], dtype=_NP[h["dtype"]]).reshape(h["shape"])
        out[name] = (h["dtype"], a)
    return out


def _e4m3(b: np.ndarray) -> np.ndarray:
    b = b.astype(np.int64)
    e, m = (b >> 3) & 0xF, (b & 0x7).astype(np.float64)
    mag = np.where(e == 0, m / 8 * 2.0**-6, (1 + m / 8) * 2.0 ** (e - 7))
    return np.where(b & 0x80, -mag, mag)


def _fp4(packed: np.ndarray) -> np.ndarray:
    b = packed.view(np.uint8).astype(np.int64)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(b.shape[0], -1)  # element 2j: the low nibble
    return np.where(codes & 0x8, -1.0, 1.0) * _E2M1[codes & 0x7]


def _decoded(tensors: dict[str, tuple[str, np.ndarray]], name: str) -> np.ndarray:
    dt, a = tensors[name]
    if dt == "BF16":
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    if dt in ("F8_E4M3", "I8"):
        scale = 2.0 ** (tensors[name.removesuffix(".weight") + ".scale"][1].astype(np.float64) - 127)
        if dt == "I8":  # FP4 e2m1, one UE8M0 scale per 32 values of a row
            return _fp4(a) * np.repeat(scale, 32, axis=1)
        n, k = a.shape  # FP8 e4m3, one scale per 128 x 128 block
        return _e4m3(a) * np.repeat(np.repeat(scale, 128, axis=0), 128, axis=1)[:n, :k]
    return a.astype(np.float64)


def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


class MTPTwin:
    """The MTP block of a checkpoint; `step(row, streams, token, p)` -> draft logits [vocab] (f64)."""

    def __init__(self, ckpt: Path):
        cfg = json.loads((ckpt / "config.json").read_text())
        tensors: dict[str, tuple[str, np.ndarray]] = {}
        for f in sorted(ckpt.glob("*.safetensors")):
            tensors.update(read_safetensors(f))
        self.c = cfg
        n = cfg["num_hidden_layers"]
        assert cfg["num_nextn_predict_layers"] == 1 and cfg["compress_ratios"][n] == 0  # sliding-only MTP layer
        assert n >= cfg["num_hash_layers"]  # so its MoE routes by score
        keep = [k for k in tensors if k.startswith("mtp.0.") and not k.endswith(".scale")]
        self.w = {k.removeprefix("mtp.0."): _decoded(tensors, k) for k in keep}
        self.embed, self.head = _decoded(tensors, "embed.weight"), _decoded(tensors, "head.weight")
        e = cfg["n_routed_experts"]
        for p in ("w1", "w2", "w3"):
            self.w[f"ffn.experts.{p}"] = np.stack([self.w.pop(f"ffn.experts.{i}.{p}.weight") for i in range(e)])
        self.rings: dict[int, dict[int, np.ndarray]] = {}  # row -> position -> window kv
        self.out: dict[int, np.ndarray] = {}  # row -> the block's output streams [nc, H] of its last step

    # ---- pieces (spec section 2) --------------------------------------------------------------------
    def _hc_pre(self, h: np.ndarray, unit: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c, nc = self.c, self.c["hc_mult"]
        fn, base, scale = (self.w[f"hc_{unit}_{k}"] for k in ("fn", "base", "scale"))
        f = h.reshape(-1)
        m = fn @ f / np.sqrt(np.mean(f * f) + c["rms_norm_eps"])
        pre = _sigmoid(m[:nc] * scale[0] + base[:nc]) + c["hc_eps"]
        post = 2 * _sigmoid(m[nc : 2 * nc] * scale[1] + base[nc : 2 * nc])
        z = (m[2 * nc :] * scale[2] + base[2 * nc :]).reshape(nc, nc)
        comb = np.exp(z - z.max(axis=1, keepdims=True))
        comb = comb / comb.sum(axis=1, keepdims=True) + c["hc_eps"]  # softmax over k, row j = input stream
        comb = comb / (comb.sum(axis=0, keepdims=True) + c["hc_eps"])  # a column normalisation first
        for _ in range(c["hc_sinkhorn_iters"] - 1):
            comb = comb / (comb.sum(axis=1, keepdims=True) + c["hc_eps"])
            comb = comb / (comb.sum(axis=0, keepdims=True) + c["hc_eps"])
        return (pre[:, None] * h).sum(axis=0), post, comb

    @staticmethod
    def _hc_post(y: np.ndarray, h: np.ndarray, post: np.ndarray, comb: np.ndarray) -> np.ndarray:
        return post[:, None] * y[None, :] + comb.T @ h  # h'[k] = post[k] y + sum_j C[j, k] h[j]

    def _rope(self, x: np.ndarray, p: int, sign: float = 1.0) -> np.ndarray:
        """Interleaved on the last qk_rope_head_dim dims, rope_theta without YaRN (a sliding layer)."""
        rd, d = self.c["qk_rope_head_dim"], x.shape[-1]
        ang = sign * p * self.c["rope_theta"] ** (-np.arange(0, rd, 2) / rd)
        out = x.copy()
        a, b = x[..., d - rd :: 2], x[..., d - rd + 1 :: 2]
        out[..., d - rd :: 2] = a * np.cos(ang) - b * np.sin(ang)
        out[..., d - rd + 1 :: 2] = a * np.sin(ang) + b * np.cos(ang)
        return out

    def _attention(self, x: np.ndarray, p: int, ring: dict[int, np.ndarray]) -> np.ndarray:
        c, w, eps = self.c, self.w, self.c["rms_norm_eps"]
        nh, d, win = c["num_attention_heads"], c["head_dim"], c["sliding_window"]
        qr = _rms(w["attn.wq_a.weight"] @ x, eps) * w["attn.q_norm.weight"]
        q = self._rope(_rms((w["attn.wq_b.weight"] @ qr).reshape(nh, d), eps), p)  # per-head RMS, no weight
        ring[p] = self._rope(_rms(w["attn.wkv.weight"] @ x, eps) * w["attn.kv_norm.weight"], p)
        for old in [j for j in ring if j <= p - win]:
            del ring[old]
        keys = np.stack([ring[j] for j in range(max(0, p - win + 1), p + 1)])  # the current token is one of W
        s, sink = q @ keys.T / np.sqrt(d), w["attn.attn_sink"]
        mu = np.maximum(s.max(axis=1), sink)
        e = np.exp(s - mu[:, None])
        o = (e @ keys) / (e.sum(axis=1) + np.exp(sink - mu))[:, None]  # V = K; the sink: denominator only
        o = self._rope(o, p, -1.0)  # de-rotation at -p
        g, r = c["o_groups"], c["o_lora_rank"]
        z = np.einsum("gri,gi->gr", w["attn.wo_a.weight"].reshape(g, r, -1), o.reshape(g, -1))
        return w["attn.wo_b.weight"] @ z.reshape(-1)

    def _moe(self, x: np.ndarray) -> np.ndarray:
        c, w, lim = self.c, self.w, self.c["swiglu_limit"]
        s = np.sqrt(np.log1p(np.exp(w["ffn.gate.weight"] @ x)))
        idx = np.argsort(-(s + w["ffn.gate.bias"]), kind="stable")[: c["num_experts_per_tok"]]  # bias: selects
        wts = s[idx] / s[idx].sum() * c["routed_scaling_factor"]
        y = np.zeros_like(x)
        for e, wt in zip(idx, wts, strict=True):
            g = np.minimum(w["ffn.experts.w1"][e] @ x, lim)
            u = np.clip(w["ffn.experts.w3"][e] @ x, -lim, lim)
            y += wt * (w["ffn.experts.w2"][e] @ (g * _sigmoid(g) * u))
        g, u = w["ffn.shared_experts.w1.weight"] @ x, w["ffn.shared_experts.w3.weight"] @ x  # unclamped (REF)
        return y + w["ffn.shared_experts.w2.weight"] @ (g * _sigmoid(g) * u)

    # ---- the block ----------------------------------------------------------------------------------
    def step(self, row: int, streams: np.ndarray, token: int, p: int) -> np.ndarray:
        """streams [nc, H]: the main model's after its last layer at position p; token: t_{p+1}."""
        w, eps = self.w, self.c["rms_norm_eps"]
        e = _rms(self.embed[token], eps) * w["enorm.weight"]
        h = _rms(streams, eps) * w["hnorm.weight"] @ w["h_proj.weight"].T + w["e_proj.weight"] @ e
        x, post, comb = self._hc_pre(h, "attn")
        h = self._hc_post(self._attention(_rms(x, eps) * w["attn_norm.weight"], p, self.rings.setdefault(row, {})),
                          h, post, comb)  # fmt: skip
        x, post, comb = self._hc_pre(h, "ffn")
        h = self._hc_post(self._moe(_rms(x, eps) * w["ffn_norm.weight"]), h, post, comb)
        self.out[row] = h  # a chained draft's streams (k > 1: the next position's input with this draft)
        f = h.reshape(-1)
        m = w["hc_head_fn"] @ f / np.sqrt(np.mean(f * f) + eps)
        pre = _sigmoid(m * w["hc_head_scale"] + w["hc_head_base"]) + self.c["hc_eps"]  # HyperHead: no Sinkhorn
        return self.head @ (_rms((pre[:, None] * h).sum(axis=0), eps) * w["norm.weight"])
