"""compressor_rows_inplace on CUDA: one launch, the state and the new entries written in place.

One block per batch row writes the token's row into its slot of `kv_state` / `score_state`, and when
the row's window completes pools it (per-feature softmax over the window, the CSA overlap), RMSNorms
and RoPEs the entry, writes it into its page of `pool`, and rolls the CSA window. All three arrays
are the kernel's *inputs*, written through their buffers (MLX does not see it): no scatter, no copy
of a slot pool, and the pools no longer depend on MLX donating their buffers (a step queued ahead of
the previous one's read-back keeps those referenced until the GPU is done with them). The kernel's
one output is a 1-element token; the arrays' readers take it (`after=`), which gives their CUDA-graph
nodes an edge from this one. The arithmetic is kernels/cuda/compressor.py's (f32, as the reference).
The three arrays must be row-contiguous (StatePools' are): MLX copies any other input for the kernel,
and the writes would land in the copy.
"""

from __future__ import annotations

import mlx.core as mx

from dsv4_serve.kernels.compressor import check_workspace, compressor_rows_inplace_reference, workspace_words
from dsv4_serve.kernels.cuda import common
from dsv4_serve.kernels.cuda.common import f32_params, i32_dummy, kernel, plan_cached
from dsv4_serve.kernels.cuda.compressor import key_and_check, norm_rope, template
from dsv4_serve.kernels.rows import RowBatch, check_after, checked, rounds

NT = 512  # threads per row block (registers: at most 128 per thread)
INPUTS = ("slots", "positions", "q_rows", "table", "kv", "score", "ape", "norm",
          "kv_state", "score_state", "pool", "rcos", "rsin", "fparams", "after")  # fmt: skip

# NSPLIT blocks of NT threads per row, each pooling D / NSPLIT features (FS) of the window, so that a long
# window (HCA: 128 rows x 512 features, 512 KB of f32 state per row) streams through many multiprocessors
# with many loads in flight. In a block, thread t owns features 4q..4q+3 (q = t % QD, float4 loads) of the
# rows j = g, g + G, ... (g = t / QD, G groups). Per feature: the max over the window (each group's, then
# across groups in shared memory), then the sum of exp and the exp-weighted sum (the reference's two passes,
# as mx.softmax(precise=True); only the summation order differs). The token's own row comes from the inputs
# (kv, score + ape), so the pool does not wait for the state write. With NSPLIT > 1 the output (the token)
# is also the scratch: the pooled features [B][D] (f32 bits) and a ticket per row (zeroed by MLX's
# init_value); the row's last block to finish (ticket after a fence) gathers the D features and does the
# RMSNorm, the RoPE, the entry write and the CSA roll. H200, 8 rows, ratio 128, D 512, per call (ncu):
# 75 us with one block of 256 threads (a thread per feature), 26 us with one block of 512 (float4 x groups).
# One block is a chain of dependent memory round trips (ncu, cold caches: ~13 us at 1 or 8 rows, ratio 4),
# so every read is issued before the writes it would otherwise wait behind: 8 rows, ratio 4, D 512 13.1 ->
# 7.3 us; ratio 128 14.7 -> 9.5 us (medians; H200, 2026-11-30, e960770).
ROW = (
    r"""
// One row's (or, NSPLIT > 1, one feature slice's) compressor step: block `blk` of the row blocks; table
// width tw; a split row's pooled features and its ticket in feat / tickets (SCRATCH). A device function so
// that compressor_pair.py's kernel runs two of them (the CSA main and indexer compressors) in one launch.
template <typename T, typename N, int M, int D, int HALF, int PAGE, int NT, int NSPLIT, int ROUND>
__device__ __forceinline__ void dsv4_compress_row(
    const unsigned int blk, const int tw, const int* slots, const int* positions, const int* q_rows,
    const int* table, const float* kv, const float* score, const float* ape, const N* norm, const float* kv_state,
    const float* score_state, const T* pool, const float* rcos, const float* rsin, const float* fparams,
    int* token, float* feat, int* tickets) {
  constexpr int COFF = (M == 4) ? 2 : 1;
  constexpr int C = COFF * D;
  constexpr int R = COFF * M;
  constexpr int RC = R * C;
  constexpr int FS = D / NSPLIT;
  constexpr int QD = FS / 4;
  constexpr int G = (NT / QD < R) ? NT / QD : R;
  constexpr int CW = C / NSPLIT, PW = (CW + NT - 1) / NT;  // this block's state-write columns per thread
  constexpr int JN = (R + G - 1) / G;  // window rows per thread
  constexpr bool HOLD = JN <= 4;  // the rows' score / kv kept in registers (the model's: JN 1, 2, 4)
  __shared__ float xs[D];
  __shared__ float nsm[D];  // the RMSNorm weights (f32)
  __shared__ float csm[2 * HALF];  // the row's RoPE cos, sin
  __shared__ float red[32];
  __shared__ __align__(16) float mg[G * FS];
  __shared__ __align__(16) float sg[G * FS];
  __shared__ __align__(16) float ag[G * FS];
  __shared__ int last;
  const int b = blk / NSPLIT, k = blk % NSPLIT, tid = threadIdx.x, nt = blockDim.x;
  if (blk == 0 && tid == 0 && (NSPLIT == 1 || (void*)feat != (void*)token)) token[0] = 0;
  const int slot = slots[b], p = positions[b], qr = q_rows[b];
  if (ROUND >= 0) {  // a chained batch, a launch a round: the rows that are their slot's ROUND-th (adjacent) row
    int rank = 0;
    while (rank < (int)b && slots[b - rank - 1] == slot) ++rank;
    if (rank != ROUND) return;
  }
  const int pm = p % M;
  const bool emit = pm == M - 1;
  const int newrow = (COFF - 1) * M + pm;
  const float* kvq = kv + (size_t)qr * C;
  const float* scq = score + (size_t)qr * C;
  const float* apr = ape + (size_t)pm * C;
  float* kst = const_cast<float*>(kv_state) + (size_t)slot * RC;
  float* sst = const_cast<float*>(score_state) + (size_t)slot * RC;
  const int q = tid % QD, g = tid / QD;
  const int f0 = k * FS + 4 * q;
  const bool own = g < G;
  auto score4 = [&](int j) -> float4 {
    const int col = ((COFF == 2 && j >= M) ? D : 0) + f0;
    if (j == newrow) {
      const float4 s = *reinterpret_cast<const float4*>(scq + col), a = *reinterpret_cast<const float4*>(apr + col);
      return make_float4(s.x + a.x, s.y + a.y, s.z + a.z, s.w + a.w);
    }
    return *reinterpret_cast<const float4*>(sst + j * C + col);
  };
  auto kv4 = [&](int j) -> float4 {
    const int col = ((COFF == 2 && j >= M) ? D : 0) + f0;
    return *reinterpret_cast<const float4*>((j == newrow ? kvq : kst + j * C) + col);
  };
  // Every read up to the pool is issued before the first write: the compiler must assume that the state
  // writes alias the inputs, so a read after one waits for it (a round trip each). The pool's rows other
  // than newrow are not written here, and newrow comes from the inputs. (H200, ncu: the block took ~13 us,
  // mostly such round trips one after another.)
  float wk[PW], ws[PW];
#pragma unroll
  for (int i = 0; i < PW; ++i) {
    const int c = k * CW + tid + i * NT;
    if (tid + i * NT < CW) { wk[i] = kvq[c]; ws[i] = scq[c] + apr[c]; }
  }
  const float eps = fparams[0];
  float4 sv[JN], vv[JN];
  if (HOLD && emit && own) {
#pragma unroll
    for (int u = 0; u < JN; ++u)
      if (g + u * G < R) { sv[u] = score4(g + u * G); vv[u] = kv4(g + u * G); }
  }
  constexpr int PN = (D + NT - 1) / NT;
  float nr[PN], cs[2];
  if (emit) {
#pragma unroll
    for (int i = 0; i < PN; ++i) if (tid + i * NT < D) nr[i] = dsv4_f(norm[tid + i * NT]);
    if (tid < HALF) { cs[0] = rcos[(size_t)qr * HALF + tid]; cs[1] = rsin[(size_t)qr * HALF + tid]; }
#pragma unroll
    for (int i = 0; i < PN; ++i) if (tid + i * NT < D) nsm[tid + i * NT] = nr[i];
    if (tid < HALF) { csm[tid] = cs[0]; csm[HALF + tid] = cs[1]; }
  }
#pragma unroll
  for (int i = 0; i < PW; ++i) {
    const int c = k * CW + tid + i * NT;
    if (tid + i * NT < CW) { kst[newrow * C + c] = wk[i]; sst[newrow * C + c] = ws[i]; }
  }
  if (!emit) return;
  const int w = p / M;
  T* ent = const_cast<T*>(pool) + ((size_t)table[b * tw + w / PAGE] * PAGE + w % PAGE) * D;  // entry w's place
  float4 m4 = make_float4(-INFINITY, -INFINITY, -INFINITY, -INFINITY);
  if (own) {
#pragma unroll
    for (int u = 0; u < JN; ++u) {
      if (g + u * G >= R) break;
      const float4 s = HOLD ? sv[u] : score4(g + u * G);
      m4.x = fmaxf(m4.x, s.x); m4.y = fmaxf(m4.y, s.y); m4.z = fmaxf(m4.z, s.z); m4.w = fmaxf(m4.w, s.w);
    }
    *reinterpret_cast<float4*>(mg + g * FS + 4 * q) = m4;
  }
  __syncthreads();
  if (own) {
#pragma unroll
    for (int h = 0; h < G; ++h) {
      const float4 o = *reinterpret_cast<const float4*>(mg + h * FS + 4 * q);
      m4.x = fmaxf(m4.x, o.x); m4.y = fmaxf(m4.y, o.y); m4.z = fmaxf(m4.z, o.z); m4.w = fmaxf(m4.w, o.w);
    }
    float4 s4 = make_float4(0.f, 0.f, 0.f, 0.f), a4 = s4;
#pragma unroll
    for (int u = 0; u < JN; ++u) {
      if (g + u * G >= R) break;
      const float4 s = HOLD ? sv[u] : score4(g + u * G), v = HOLD ? vv[u] : kv4(g + u * G);
      float e;
      e = expf(s.x - m4.x); s4.x += e; a4.x += e * v.x;
      e = expf(s.y - m4.y); s4.y += e; a4.y += e * v.y;
      e = expf(s.z - m4.z); s4.z += e; a4.z += e * v.z;
      e = expf(s.w - m4.w); s4.w += e; a4.w += e * v.w;
    }
    *reinterpret_cast<float4*>(sg + g * FS + 4 * q) = s4;
    *reinterpret_cast<float4*>(ag + g * FS + 4 * q) = a4;
  }
  __syncthreads();
  float* xg = feat + (size_t)b * D;  // NSPLIT > 1: the row's D pooled features ([B][D])
  for (int i = tid; i < FS; i += nt) {
    float sum = 0.f, acc = 0.f;
#pragma unroll
    for (int h = 0; h < G; ++h) { sum += sg[h * FS + i]; acc += ag[h * FS + i]; }
    const float x = dsv4_f(dsv4_t<T>(acc / sum));
    if (NSPLIT == 1) xs[i] = x;
    else xg[k * FS + i] = x;
  }
  if (NSPLIT > 1) {
    __threadfence();
    __syncthreads();
    if (tid == 0) last = atomicAdd(tickets + b, 1) == NSPLIT - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int f = tid; f < D; f += nt) xs[f] = __ldcg(xg + f);
    if (tid == 0) tickets[b] = 0;  // every block of the row took its ticket: zero for a workspace's next launch
  }
  __syncthreads();
  float ssq = 0.f;
  for (int f = tid; f < D; f += nt) ssq += xs[f] * xs[f];
"""
    # the weights and the RoPE row from shared memory (read with the state write's reads)
    + norm_rope("nsm[f]", "csm[i]", "csm[HALF + i]", "eps")
    + r"""  if (COFF == 2) {  // CSA: the window just pooled becomes "previous" (rows M..2M-1 stay, stale); reads first
    constexpr int RN = (M * C + NT - 1) / NT;
    float rk[RN], rs[RN];
#pragma unroll
    for (int i = 0; i < RN; ++i) {
      const int e = tid + i * NT;
      if (e < M * C) { rk[i] = kst[M * C + e]; rs[i] = sst[M * C + e]; }
    }
#pragma unroll
    for (int i = 0; i < RN; ++i) {
      const int e = tid + i * NT;
      if (e < M * C) { kst[e] = rk[i]; sst[e] = rs[i]; }
    }
  }
}
"""
)


# Where a split row's features and tickets go: the token output (zeroed by init_value; [B][D] features, then
# B tickets) or the caller's `workspace` (features at its start, tickets at its end: a later launch with
# fewer rows finds its tickets where no features were written, and each last block re-zeroes its ticket).
SCRATCH = {
    "token": "reinterpret_cast<float*>(token), token + (size_t)slots_shape[0] * D",
    "workspace": "reinterpret_cast<float*>(const_cast<unsigned int*>(workspace)), "
    "reinterpret_cast<int*>(const_cast<unsigned int*>(workspace)) + workspace_shape[0] - slots_shape[0]",
}


def call(suffix: str = "", blk: str = "blockIdx.x", d: str = "D", n: str = "N", scratch: str = "token") -> str:
    """A `dsv4_compress_row` call on the inputs named with `suffix` (compressor_pair: "2")."""
    a = [f"{x}{suffix}" for x in ("kv", "score", "ape", "norm", "kv_state", "score_state", "pool")]
    return (f"  dsv4_compress_row<T, {n}, M, {d}, HALF, PAGE, NT, NSPLIT, ROUND>({blk}, table_shape[1], "
            f"slots, positions, q_rows, table, {', '.join(a)}, rcos, rsin, fparams, token, {SCRATCH[scratch]});\n")


SOURCE, SOURCE_WS = call(), call(scratch="workspace")


def nsplit(ratio: int, head_dim: int) -> int:
    """Blocks per row: 8 for long windows (ratio >= 64) when the features split into float4 slices, else 1
    (a CSA window is 8 rows: one block pools it, with no ticket and no zeroed scratch)."""
    return 8 if ratio >= 64 and head_dim % 32 == 0 else 1


class Plan:
    """Launch parameters of one (batch shape, argument shapes) combination, computed once."""

    __slots__ = ("compiled", "fast", "fparams", "grid", "init", "kernel", "out_shape", "template", "ws")

    def __init__(self, b: int, pool: mx.array, norm: mx.array, ratio: int, head_dim: int, half: int, page: int,
                 eps: float, workspace: bool = False, chain_round: int = -1) -> None:  # fmt: skip
        self.fast = head_dim % 4 == 0 and head_dim <= 4 * NT and half <= NT  # float4 split; else the reference
        if not self.fast:
            return
        ns = nsplit(ratio, head_dim)
        self.ws = workspace and ns > 1  # split rows' features and tickets in the caller's workspace: no fill
        self.fparams = f32_params(eps)
        ins, src = (INPUTS + ("workspace",), SOURCE_WS) if self.ws else (INPUTS, SOURCE)
        self.kernel = kernel("compressor_inplace_ws" if self.ws else "compressor_inplace", ins, ("token",), src,
                             header=ROW)  # fmt: skip
        tail = [("NT", NT), ("NSPLIT", ns), ("ROUND", chain_round)]
        self.template = template(pool.dtype, norm.dtype, ratio, head_dim, half, page, False) + tail
        self.grid = (b * ns * NT, 1, 1)
        # the token; split rows: also the pooled features and the tickets (zeroed). 4 ints, not 1: MLX puts
        # outputs of <= 8 bytes in managed memory (kernels/upload.py), where the token's write crosses the host link
        self.out_shape, self.init = ((4,), None) if ns == 1 or self.ws else ((b * head_dim + b,), 0)
        self.compiled = mx.compile(self.launch)

    def launch(self, *inputs: mx.array) -> mx.array:
        return self.kernel(inputs=list(inputs), template=self.template, grid=self.grid, threadgroup=(NT, 1, 1),
                           output_shapes=[self.out_shape], output_dtypes=[mx.int32],
                           init_value=self.init)[0]  # fmt: skip


def compressor_rows_inplace_cuda(
    batch: RowBatch,
    kv: mx.array,
    score: mx.array,
    ape: mx.array,
    norm: mx.array,
    kv_state: mx.array,
    score_state: mx.array,
    pool: mx.array,
    *,
    ratio: int,
    head_dim: int,
    eps: float,
    cos: mx.array,
    sin: mx.array,
    after: mx.array | None = None,
    workspace: mx.array | None = None,
    chain_round: int | None = None,
) -> tuple[mx.array, mx.array, mx.array, mx.array | None]:
    """`chain_round` j (a chained batch, kernels/chained.py): only the rows that are their slot's j-th, one launch
    of the whole batch a round (the rows' ranks read from the slots: a launch list that fits every chain pattern)."""
    check_after("compressor_rows", after)
    chains = chain_round is not None
    key, check_args = key_and_check("compressor_rows_inplace", batch, kv, score, ape, norm, kv_state, score_state,
                                    pool, ratio=ratio, head_dim=head_dim, eps=eps, cos=cos, sin=sin,
                                    chains=chains)  # fmt: skip
    ws = workspace is not None
    if ws and not isinstance(workspace, mx.array):
        check_workspace(workspace, workspace_words(batch.size, head_dim))  # raises, naming it
    key += ((workspace.shape, workspace.dtype) if ws else (False,)) + (chain_round,)

    def check() -> None:  # the workspace first, as before; once per batch and key (its shape and dtype are in it)
        if ws:
            check_workspace(workspace, workspace_words(batch.size, head_dim))
        check_args()

    def make() -> Plan:
        pk = key + (batch.size, batch.page_size, batch.tables[ratio].shape)
        return plan_cached(pk, lambda: Plan(batch.size, pool, norm, ratio, head_dim, cos.shape[1], batch.page_size,
                                            eps, ws, -1 if chain_round is None else chain_round))  # fmt: skip

    plan: Plan = checked(batch, key, check, make)
    if not plan.fast:
        if chains:  # the twin takes the round's rows alone
            batch = rounds(batch)[chain_round]
        return compressor_rows_inplace_reference(batch, kv, score, ape, norm, kv_state, score_state, pool, ratio=ratio,
                                                 head_dim=head_dim, eps=eps, cos=cos, sin=sin, after=after,
                                                 workspace=workspace)  # fmt: skip
    run = plan.compiled if common.COMPILE else plan.launch
    token = run(batch.slots, batch.positions, batch.q_rows, batch.tables[ratio], kv, score, ape, norm, kv_state,
                score_state, pool, cos, sin, plan.fparams, i32_dummy((1,)) if after is None else after,
                *([workspace] if plan.ws else []))  # fmt: skip
    return kv_state, score_state, pool, token
