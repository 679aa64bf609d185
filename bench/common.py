"""What the benchmark scripts share: the byte floor, CUPTI's GPU time a step, the provenance of a run, and the
`--plot` PNGs.

The byte floor is a plain copy's bandwidth, measured in the same run. On a CUDA device the copy is a
16-byte-per-thread kernel (`mx.fast.cuda_kernel`): MLX's own `x + 0` reads about half of it on the H200
(1.84 against 3.80 TB/s in one run), which would understate every `x floor` ratio. Elsewhere (the CPU in
CI) it is `x + 0`. Each timed eval carries MLX's eval cost (~50 us on the H200's host), so the copy is
2 GiB: that cost is then ~2% of it (512 MB read 2.97 TB/s where the since removed bench/kernels.py's 2 GiB read 3.54 in
the same run).

Provenance: the git commit where there is a current .git, and a digest of the sources. The device machine
gets a copy of the working tree whose `.git` can be stale, so `git rev-parse` there may name an older
commit; the digest (sha1 over kernels/, model/, service/, bench/ *.py and *.sh) identifies the code
itself: `python bench/common.py` prints it for this checkout, to match against a result's `source_digest`.

Plots need matplotlib: `pip install -e '.[bench]'`.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DIGEST_DIRS = ("kernels", "model", "service", "bench")

# ---- the byte floor -----------------------------------------------------------------------------
COPY = r"""
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n_shape[0]) reinterpret_cast<uint4*>(out)[i] = reinterpret_cast<const uint4*>(x)[i];
"""
_kernel: Any = None


def copy_kernel() -> Any:
    """The copy kernel (inputs `x`, `n`: its shape[0] is the number of 16-byte words to copy)."""
    import mlx.core as mx

    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="bench_copy16", input_names=["x", "n"], output_names=["out"], source=COPY)
    return _kernel


def on_cuda() -> bool:
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available() and mx.default_device().type == mx.gpu)


def copy_bandwidth(nbytes: int = 1 << 31, reps: int = 10) -> float:
    """Bytes per second (read + write) of a copy of `nbytes`, the median of `reps` evals."""
    import mlx.core as mx  # here, not at import: bench/serve.py needs no mlx

    words = nbytes // 16
    x = mx.random.randint(0, 1 << 30, (words * 4,), dtype=mx.int32)
    if on_cuda():
        n = mx.zeros((words,), mx.int32)
        k = copy_kernel()

        def run() -> mx.array:
            return k(inputs=[x, n], grid=(words, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape],
                     output_dtypes=[x.dtype])[0]  # fmt: skip

        mx.eval(x, n)
    else:

        def run() -> mx.array:
            return x + 0

        mx.eval(x)
    mx.eval(run())  # compile / warm
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(run())
        ts.append(time.perf_counter() - t)
    return 2 * x.nbytes / statistics.median(ts)


# ---- provenance ---------------------------------------------------------------------------------
# ---- the GPU time a step (CUPTI) -----------------------------------------------------------------
def gpu_profile(run, steps: int, out: Path | None, tag: str) -> dict:
    """CUPTI over `steps` steps: kernels a step, GPU busy us a step (union of activity), the kernels' own time a
    step (their sum: above busy where kernels overlap, as in MLX's graphs), the top kernels; the steps' GPU span
    (first kernel's start to last one's end) and its idle part, the longest idle gaps (what the GPU waited for)."""
    import mlx.core as mx
    from torch.profiler import ProfilerActivity, profile  # the device's python3; not a project dependency

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(steps)
        mx.synchronize()
    path = (out or Path("/tmp")) / f"trace_{tag}.json"
    prof.export_chrome_trace(str(path))
    trace = [e for e in json.loads(path.read_text()).get("traceEvents", []) if e.get("ph") == "X"]
    if out is None:
        path.unlink()
    return trace_stats(trace, steps)


def trace_stats(trace: list[dict], steps: int) -> dict:
    """`gpu_profile`'s figures from a Chrome trace's complete events ("X": ts, dur in us, cat, name)."""
    ev = [e for e in trace if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    # the host's CUDA API time (graph node adds, exec updates, launches): how much of `encode` is the driver's
    api: dict[str, float] = {}
    for e in trace:
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            api[e["name"]] = api.get(e["name"], 0.0) + e.get("dur", 0)
    by: dict[str, list[float]] = {}
    for e in ev:
        by.setdefault(e["name"][:70], []).append(e.get("dur", 0))
    busy, start, end, gaps = 0.0, None, -1.0, []
    for a, b, name in sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"][:40]) for e in ev):
        start = a if start is None else start
        if end >= 0 and a > end:  # the GPU idle from the last kernel's end to this one's start
            gaps.append((a - end, name))
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    top = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:40]
    span = end - start if start is not None else 0.0
    # idle inside the steps' span (first start to last end, less busy): the GPU waiting for the host where it is
    # large; the longest gaps name the kernel after each (what a host sync or a slow build held back)
    return {"kernels_per_step": len(ev) / steps, "gpu_busy_ms_per_step": busy / steps / 1e3,
            "gpu_span_ms_per_step": round(span / steps / 1e3, 3),
            "gpu_idle_ms_per_step": round((span - busy) / steps / 1e3, 3),
            "gaps_over_100us_per_step": round(sum(1 for g, _ in gaps if g > 100) / steps, 1),
            "longest_gaps_ms": [[n, round(g / 1e3, 3)] for g, n in sorted(gaps, reverse=True)[:8]],
            "kernel_ms_per_step": sum(e.get("dur", 0) for e in ev) / steps / 1e3,
            "kernel_kinds": len(by), "api_ms_per_step": round(sum(api.values()) / steps / 1e3, 3),
            "api_top": [[n, round(d / steps / 1e3, 3)] for n, d in sorted(api.items(), key=lambda kv: -kv[1])[:8]],
            "top": [[n, round(len(d) / steps, 1), round(sum(d) / steps / 1e3, 3)] for n, d in top]}  # fmt: skip


def source_digest() -> str:
    h = hashlib.sha1()
    for d in DIGEST_DIRS:
        for p in sorted((ROOT / d).rglob("*")):
            if p.suffix in (".py", ".sh") and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(ROOT)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def provenance() -> dict[str, str]:
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return {"git": git.stdout.strip() or "unknown", "source_digest": source_digest()}


# ---- --plot -------------------------------------------------------------------------------------
def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[bench]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _title(meta: dict[str, Any], what: str) -> str:
    bits = [meta.get("device", ""), meta.get("git", ""), str(meta.get("date", ""))[:10]]
    return f"{what}\n" + ", ".join(b for b in bits if b and b != "unknown")


def plot_serve(cells: Sequence[dict[str, Any]], meta: dict[str, Any], path: str | Path) -> Path:
    """bench/serve.py: output tokens/s and median TTFT / TPOT against concurrency."""
    plt = _pyplot()
    conc = [c["concurrency"] for c in cells]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(conc, [c["output_throughput"] for c in cells], "o-")
    a.set(xlabel="concurrency", ylabel="output tokens/s", xscale="log", title="throughput")
    for key, label in (("median_ttft_ms", "TTFT median"), ("median_tpot_ms", "TPOT median"),
                       ("p99_itl_ms", "ITL p99")):  # fmt: skip
        b.plot(conc, [c[key] for c in cells], "o-", label=label)
    b.set(xlabel="concurrency", ylabel="ms", xscale="log", yscale="log", title="latency")
    b.legend()
    for ax in (a, b):
        ax.set_xticks(conc, [str(c) for c in conc])
    fig.suptitle(_title(meta, f"bench/serve.py, {meta.get('model', '')}"))
    return _save(fig, plt, path)


def plot_step(results: Sequence[dict[str, Any]], meta: dict[str, Any], path: str | Path) -> Path:
    """bench/step.py: ms a step against rows, one line per (context, kernels) arm, and the bytes floor."""
    plt = _pyplot()
    contexts = sorted({r["context"] for r in results})
    fig, axes = plt.subplots(1, len(contexts), figsize=(5 * len(contexts), 4), squeeze=False)
    for ax, ctx in zip(axes[0], contexts, strict=True):
        rs = [r for r in results if r["context"] == ctx]
        for arm in dict.fromkeys(r["arm"] for r in rs):
            pts = sorted((r["rows"], r["ms_per_step"]) for r in rs if r["arm"] == arm)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=arm)
        floor = sorted({(r["rows"], r["floor_ms"]) for r in rs})
        ax.plot([p[0] for p in floor], [p[1] for p in floor], "k--", label="bytes floor")
        ax.set(xlabel="rows", ylabel="ms a step", title=f"context {ctx}", ylim=(0, None))
        ax.set_xticks([p[0] for p in floor])
        ax.legend()
    fig.suptitle(_title(meta, f"bench/step.py, {rs[0]['layers']} layers, {rs[0]['experts']} experts, mxfp8 + mxfp4"))
    return _save(fig, plt, path)


def _save(fig: Any, plt: Any, path: str | Path) -> Path:
    path = Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {path}")
    return path


if __name__ == "__main__":
    print(provenance())
