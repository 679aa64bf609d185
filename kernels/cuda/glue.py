"""The step's other glue on CUDA (DSV4_GRAPH_GLUE=1): one launch each where the reference ran MLX ops.

- router_hash: a warp a row; lane j < k takes expert tid2eid[token][j], its sqrt(softplus(l)) as MLX computes
  logaddexp(l, 0) (kernels/cuda/router.py's expression), the k scores summed in order, w = s / (sum + 1e-20) *
  route_scale as the reference divides and scales. Ids exact; weights equal up to the order of MLX's k-sum.
- index_weights_rows: a warp a (row, head): the f32 dot x . W_h, rounded to x's dtype (nn.Linear's output),
  then f32 * scale. MLX's GEMV sums in another order: at most one ulp of x's dtype before the scale.
- embed_streams: a thread an element: table[token] copied to each of the nc streams. Exact.
- hc_head_rows: a block a row: the RMS of the nc * H values as rms_norm's kernel (kernels/cuda/norms.py INV_RMS),
  the nc dots (f32, threads strided, the warps' sums in order), sigmoid(dot * scale + base) + hc_eps, then
  out = sum_j pre_j * h_j in f32, j in order, each product rounded before its add (as MLX's multiply then
  sum), one rounding to h's dtype. The dots and the sigmoid are not MLX's (a GEMM's order, its sigmoid):
  pre within ~1e-6 relative, out within one ulp of h's dtype.
Fast path: f32 logits / fn / scale / base, 16-bit x and weights of one dtype (index weights), float tables and
h, int32 token ids, nc <= MAX_NC; else the reference.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from dsv4_serve.kernels.cuda.common import MAX_GRID_Y, f32_params, kernel, plan_cached
from dsv4_serve.kernels.cuda.norms import INV_RMS
from dsv4_serve.kernels.glue import (
    check_embed_streams,
    check_hc_head_rows,
    check_index_weights_rows,
    check_router_hash,
    embed_streams_reference,
    hc_head_rows_reference,
    index_weights_rows_reference,
    router_hash_reference,
)

THREADS = 256
MAX_NC = 8
_FLOATS = (mx.float32, mx.bfloat16, mx.float16)

ROUTER_HASH = r"""
  const int r = blockIdx.x, lane = threadIdx.x & 31;
  const int E = logits_shape[1];
  const int tok = token_ids[r];
  float s = 0.f;
  unsigned int e = 0u;
  if (lane < K) {
    e = (unsigned int)tid2eid[(size_t)tok * K + lane];
    const float l = e < (unsigned int)E ? logits[(size_t)r * E + e] : 0.f;
    const float hi = fmaxf(l, 0.f), lo = fminf(l, 0.f);
    s = sqrtf(hi + log1pf(expf(lo - hi)));
  }
  float sum = 0.f;
  for (int j = 0; j < K; ++j) sum += __shfl_sync(0xffffffffu, s, j);
  if (lane < K) {
    idx[(size_t)r * K + lane] = e;
    w[(size_t)r * K + lane] = s / (sum + 1e-20f) * fparams[0];
  }
"""

INDEX_WEIGHTS = r"""
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int hd = blockIdx.x * (blockDim.x >> 5) + warp, b = blockIdx.y;
  const int H = x_shape[1], NH = weight_shape[0];
  if (hd >= NH) return;
  const T* xr = x + (size_t)b * H;
  const T* wr = weight + (size_t)hd * H;
  float acc = 0.f;
  for (int i = lane; i < H; i += 32) acc += dsv4_f(xr[i]) * dsv4_f(wr[i]);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) out[(size_t)b * NH + hd] = dsv4_f(dsv4_t<T>(acc)) * fparams[0];
"""

EMBED = r"""
  const int H = table_shape[1];
  const int i = blockIdx.x * blockDim.x + threadIdx.x, j = blockIdx.y, b = blockIdx.z;
  if (i >= H) return;
  out[((size_t)b * NC + j) * H + i] = table[(size_t)token_ids[b] * H + i];
"""

HC_HEAD = r"""
  __shared__ float red[32];
  __shared__ float dots[NC][32];
  __shared__ float pre[NC];
  const int b = blockIdx.x, tid = threadIdx.x;
  const int H = h_shape[2], D = NC * H;
  const T* xr = h + (size_t)b * D;
  float inv;
@INV_RMS@
  float acc[NC];
#pragma unroll
  for (int j = 0; j < NC; ++j) acc[j] = 0.f;
  for (int i = tid; i < D; i += blockDim.x) {
    const float f = dsv4_f(xr[i]) * inv;  // the norm's f32 output
#pragma unroll
    for (int j = 0; j < NC; ++j) acc[j] += f * fn[(size_t)j * D + i];
  }
#pragma unroll
  for (int j = 0; j < NC; ++j) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
    if ((tid & 31) == 0) dots[j][tid >> 5] = acc[j];
  }
  __syncthreads();
  if (tid < NC) {
    float t = 0.f;
    for (int k = 0; k < (int)(blockDim.x >> 5); ++k) t += dots[tid][k];
    const float z = __fadd_rn(__fmul_rn(t, scale[0]), base[tid]);
    pre[tid] = 1.f / (1.f + expf(-z)) + fparams[1];
  }
  __syncthreads();
  T* orow = out + (size_t)b * H;
  for (int i = tid; i < H; i += blockDim.x) {
    float v = 0.f;
#pragma unroll
    for (int j = 0; j < NC; ++j) v = __fadd_rn(v, __fmul_rn(pre[j], dsv4_f(xr[(size_t)j * H + i])));
    orow[i] = dsv4_t<T>(v);
  }
""".replace("@INV_RMS@", INV_RMS.strip("\n"))


def _key(op: str, *parts: Any) -> tuple[Any, ...]:
    """A plan's key: arrays by shape and dtype, scalars by value (anything else by identity: its plan's check
    raises)."""
    return (op, *((p.shape, p.dtype) if isinstance(p, mx.array)
                  else (type(p), p if isinstance(p, (int, float, type(None))) else id(p)) for p in parts))  # fmt: skip


def router_hash_cuda(logits: mx.array, tid2eid: mx.array, token_ids: mx.array, *, route_scale: float
                     ) -> tuple[mx.array, mx.array]:  # fmt: skip
    def make() -> Any:
        check_router_hash(logits, tid2eid, token_ids, route_scale)
        if token_ids.dtype != mx.int32 or tid2eid.shape[1] > 32 or logits.shape[0] == 0:
            return None
        k = tid2eid.shape[1]
        return (kernel("router_hash", ("logits", "tid2eid", "token_ids", "fparams"), ("idx", "w"), ROUTER_HASH),
                [("K", k)], [(logits.shape[0], k)] * 2, f32_params(route_scale))  # fmt: skip

    plan = plan_cached(_key("router_hash", logits, tid2eid, token_ids, route_scale), make)
    if plan is None:
        return router_hash_reference(logits, tid2eid, token_ids, route_scale=route_scale)
    kern, tmpl, shapes, fparams = plan
    idx, w = kern(inputs=[logits, tid2eid, token_ids, fparams], template=tmpl, grid=(logits.shape[0] * 32, 1, 1),
                  threadgroup=(32, 1, 1), output_shapes=shapes, output_dtypes=[mx.uint32, mx.float32])  # fmt: skip
    return idx, w


def index_weights_rows_cuda(x: mx.array, weight: mx.array, *, scale: float) -> mx.array:
    def make() -> Any:
        check_index_weights_rows(x, weight, scale)
        if x.dtype not in (mx.bfloat16, mx.float16) or weight.dtype != x.dtype or not 0 < x.shape[0] <= MAX_GRID_Y:
            return None
        warps = THREADS // 32
        return (kernel("index_weights", ("x", "weight", "fparams"), ("out",), INDEX_WEIGHTS), [("T", x.dtype)],
                (-(-weight.shape[0] // warps) * THREADS, x.shape[0], 1), f32_params(scale))  # fmt: skip

    plan = plan_cached(_key("index_weights", x, weight, scale), make)
    if plan is None:
        return index_weights_rows_reference(x, weight, scale=scale)
    kern, tmpl, grid, fparams = plan
    return kern(inputs=[x, weight, fparams], template=tmpl, grid=grid, threadgroup=(THREADS, 1, 1),
                output_shapes=[(x.shape[0], weight.shape[0])], output_dtypes=[mx.float32])[0]  # fmt: skip


def embed_streams_cuda(table: mx.array, token_ids: mx.array, nc: int) -> mx.array:
    def make() -> Any:
        check_embed_streams(table, token_ids, nc)
        b, h = token_ids.shape[0], table.shape[1]
        if token_ids.dtype != mx.int32 or not 0 < b <= MAX_GRID_Y or nc > MAX_GRID_Y or h == 0:
            return None
        return (kernel("embed_streams", ("table", "token_ids"), ("out",), EMBED), [("T", table.dtype), ("NC", nc)],
                (-(-h // THREADS) * THREADS, nc, b), (b, nc, h))  # fmt: skip

    plan = plan_cached(_key("embed_streams", table, token_ids, nc), make)
    if plan is None:
        return embed_streams_reference(table, token_ids, nc)
    kern, tmpl, grid, shape = plan
    return kern(inputs=[table, token_ids], template=tmpl, grid=grid, threadgroup=(THREADS, 1, 1),
                output_shapes=[shape], output_dtypes=[table.dtype])[0]  # fmt: skip


def hc_head_rows_cuda(h: mx.array, fn: mx.array, scale: mx.array, base: mx.array, *, norm_eps: float,
                      hc_eps: float) -> mx.array:  # fmt: skip
    def make() -> Any:
        check_hc_head_rows(h, fn, scale, base)
        b, nc, hid = h.shape
        if (nc > MAX_NC or not 0 < b <= MAX_GRID_Y or hid == 0
                or any(a.dtype != mx.float32 for a in (fn, scale, base))):  # fmt: skip
            return None
        return (kernel("hc_head", ("h", "fn", "scale", "base", "fparams"), ("out",), HC_HEAD),
                [("T", h.dtype), ("NC", nc)], f32_params(norm_eps, hc_eps))  # fmt: skip

    plan = plan_cached(_key("hc_head", h, fn, scale, base, norm_eps, hc_eps), make)
    if plan is None:
        return hc_head_rows_reference(h, fn, scale, base, norm_eps=norm_eps, hc_eps=hc_eps)
    kern, tmpl, fparams = plan
    return kern(inputs=[h, fn, scale, base, fparams], template=tmpl, grid=(h.shape[0] * THREADS, 1, 1),
                threadgroup=(THREADS, 1, 1), output_shapes=[(h.shape[0], h.shape[2])],
                output_dtypes=[h.dtype])[0]  # fmt: skip
