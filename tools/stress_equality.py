"""The engine's equality checks, over and over in one long process (issue 57): a wrong greedy token that shows
only after other work ran in the process (stale compiled traces, a shared cache, a donated buffer) shows here.

Each iteration runs one check, in an order shuffled by `--seed`, on the tiny model: the engine's work on an
engine thread of its own (as `service/engine/worker.py` runs it), the references on the main thread. Between
iterations models are made and dropped (seeds 0-2; the live set changes), segments reset as a warm-up's end
does, pools and engines dropped, and the garbage collector forced.

- plain: the plain Engine's greedy tokens == token-by-token `model.decode` of the same prompt
- batched: a request's tokens batched with 3 others == alone
- prefix: a prefix-cache hit + the rest's prefill == one cold prefill (logits within 1e-5)
- spec: speculative (k = 1..3) greedy tokens == the plain Engine's
- state: a cached state exported, opened and installed in other pools (another page size) then prefilled ==
  the never-exported entry's logits (within 1e-5)

    python tools/stress_equality.py --iterations 1000 --seed 1     # every failure printed; exit 1 if any

tests/model/test_stress_equality.py runs a few iterations (`slow`); docs/engine.md#process-global-state says
what was found.
"""

from __future__ import annotations

import argparse
import gc
import queue
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from dsv4_serve.model.state import StatePools  # noqa: E402
from dsv4_serve.model.tiny import tiny_model  # noqa: E402
from dsv4_serve.service.engine.engine import Engine  # noqa: E402
from dsv4_serve.service.engine.prefix_cache import PrefixCache  # noqa: E402
from dsv4_serve.service.engine.request import Request, SamplingParams  # noqa: E402
from dsv4_serve.service.engine.sampler import sample_lazy  # noqa: E402
from dsv4_serve.service.engine.scheduler import Scheduler  # noqa: E402
from dsv4_serve.service.engine.state_format import open_state, seal  # noqa: E402
from dsv4_serve.service.engine.state_io import export_entry, install, layout  # noqa: E402
from dsv4_serve.service.engine.stepping import iterate  # noqa: E402

CHECKS = ("plain", "batched", "prefix", "spec", "state")
TOL = 1e-5
SECRET = b"0123456789abcdef0123456789abcdef"
NS = ("stress", "")


class EngineThread:
    """One long-lived thread that runs the engine's work, as the server's engine thread does."""

    def __init__(self) -> None:
        self.jobs: queue.Queue[Callable[[], Any] | None] = queue.Queue()
        self.results: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="stress-engine", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            try:
                self.results.put((True, job()))
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                self.results.put((False, e))

    def call(self, fn: Callable[[], Any]) -> Any:
        self.jobs.put(fn)
        ok, value = self.results.get()
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        """Not called at the end: a thread that ran MLX and ends frees its compile cache in a C++ thread-local
        destructor, which takes the GIL for the traces' Python parts; racing the interpreter's exit, the process
        aborts (rc 134, "terminate called without an active exception", before and after issue 57's fix). Left
        blocked, the daemon thread ends with the process instead."""
        self.jobs.put(None)
        self.thread.join()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def drive(engine: Engine, reqs: list[tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """Every request through the real scheduler and iterations -> request id -> its tokens."""
    sched = Scheduler(engine, max_rows=8, max_queue=64, eos_token_id=engine.eos_token_id,
                      max_model_len=engine.max_model_len)  # fmt: skip
    for i, (p, params) in enumerate(reqs):
        sched.add(Request(f"r{i}", list(p), params))
    out: dict[str, list[int]] = {}
    while sched.has_work():
        it, _, _ = iterate(engine, sched, sample_lazy, 2048, lambda: None)
        for e in it.events:
            if e.token_id is not None:
                out.setdefault(e.request_id, []).append(e.token_id)
    return out


def by_token(model, args, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    pools = StatePools(args, max_slots=1, max_positions=64, page_size=4, dtype=model.dtype)
    h = pools.alloc(len(prompt) + n)
    out: list[int] = []
    feed = list(prompt)
    for i in range(len(prompt) + n - 1):
        logits = model.decode(pools, [h], [feed[i]], [i])
        if i >= len(prompt) - 1:
            out.append(int(mx.argmax(logits[0]).item()))
            feed.append(out[-1])
    return out[:n]


def cold(model, args, tokens: list[int], page: int = 8) -> np.ndarray:  # noqa: ANN001
    pools = StatePools(args, max_slots=1, max_positions=64, page_size=page)
    return np.array(model.prefill(pools, pools.alloc(64), tokens, 0, chunk=len(tokens)))


class Stress:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.engine = EngineThread()
        self.models: dict[int, tuple[Any, Any]] = {}
        self.counts: Counter[str] = Counter()
        self.failures: list[str] = []

    def model(self) -> tuple[int, Any, Any]:
        s = self.rng.randrange(3)
        if s not in self.models:
            model, args, _ = tiny_model(seed=s)
            self.models[s] = (model, args)
        return (s, *self.models[s])

    def churn(self) -> None:
        """Drop a model, reset one's segments (as a warm-up's end does), force the collector."""
        r = self.rng.random()
        if r < 0.3 and self.models:
            self.models.pop(self.rng.choice(list(self.models)))
        elif r < 0.5 and self.models:
            self.models[self.rng.choice(list(self.models))][0].reset_compiled()
        gc.collect()

    def prompt(self, args, lo: int = 3, hi: int = 31) -> list[int]:  # noqa: ANN001
        n = self.rng.randrange(lo, hi)
        return [self.rng.randrange(2, args.vocab_size) for _ in range(n)]

    def run(self, check: str) -> str | None:
        """None if the check holds, else what differed."""
        s, model, args = self.model()
        eng = lambda **kw: Engine(model, max_rows=8, max_model_len=64, page_size=4, **kw)  # noqa: E731
        p = self.prompt(args)
        if check == "plain":
            got = self.engine.call(lambda: drive(eng(), [(p, greedy(4))])["r0"])
            want = by_token(model, args, p, 4)
        elif check == "batched":
            others = [(self.prompt(args), greedy(self.rng.randrange(2, 6))) for _ in range(3)]
            got = self.engine.call(lambda: drive(eng(), [(p, greedy(4)), *others])["r0"])
            want = self.engine.call(lambda: drive(eng(), [(p, greedy(4))])["r0"])
        elif check == "spec":
            k = self.rng.randrange(1, 4)
            got = self.engine.call(lambda: drive(eng(speculative=k), [(p, greedy(5))])["r0"])
            want = drive(eng(), [(p, greedy(5))])["r0"]
        elif check == "prefix":
            p = self.prompt(args, 10, 40)
            cut = self.rng.randrange(2, len(p) - 1)
            want_l = cold(model, args, p)
            got_l = self.engine.call(lambda: self._hit(model, args, p, cut))
            return self._close(check, s, p, got_l, want_l)
        else:
            p = self.prompt(args, 10, 40)
            cut = self.rng.randrange(2, len(p) - 1)
            want_l = self._hit(model, args, p, cut)
            got_l = self.engine.call(lambda: self._moved(model, args, p, cut))
            return self._close(check, s, p, got_l, want_l)
        return None if got == want else f"{check} seed={s} prompt={p}: {got} != {want}"

    def _close(self, check: str, s: int, p: list[int], got: np.ndarray, want: np.ndarray) -> str | None:
        d = float(np.max(np.abs(got - want)))
        return None if d <= TOL else f"{check} seed={s} prompt={p}: logits differ by {d:.3g}"

    def _hit(self, model, args, p: list[int], cut: int) -> np.ndarray:  # noqa: ANN001
        pools = StatePools(args, max_slots=2, max_positions=64, page_size=8)
        cache = PrefixCache(pools, 1 << 30, interval=0)
        src = pools.alloc(64)
        model.prefill(pools, src, p[:cut], 0, chunk=cut, logits=False)
        cache.store(src, p[:cut])
        pools.free(src)
        h = cache.adopt(pools.alloc(64), cache.lookup(p[:cut]))
        return np.array(model.prefill(pools, h, p[cut:], cut, chunk=len(p)))

    def _moved(self, model, args, p: list[int], cut: int) -> np.ndarray:  # noqa: ANN001
        pools = StatePools(args, max_slots=1, max_positions=64, page_size=8)
        cache = PrefixCache(pools, 1 << 30, interval=0)
        h = pools.alloc(64)
        model.prefill(pools, h, p[:cut], 0, chunk=cut, logits=False)
        entry = cache.store(h, p[:cut], ns=NS)
        lay = lambda c: layout(SimpleNamespace(prefix_cache=c, model=model, vocab_size=args.vocab_size,  # noqa: E731
                                               max_model_len=64))  # fmt: skip
        data = seal(SECRET, *export_entry(cache, entry, lay(cache)))
        other = StatePools(args, max_slots=2, max_positions=64, page_size=16)
        there = PrefixCache(other, 1 << 30, interval=0)
        install(there, open_state(data, SECRET, lay(there), NS[0]))
        h2 = there.adopt(other.alloc(64), there.lookup(p, ns=NS))
        return np.array(model.prefill(other, h2, p[cut:], cut, chunk=len(p)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=1000, help="checks in all (shuffled, each about as often)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    st = Stress(a.seed)
    order = [CHECKS[i % len(CHECKS)] for i in range(a.iterations)]
    st.rng.shuffle(order)
    t0 = time.perf_counter()
    for i, check in enumerate(order):
        bad = st.run(check)
        st.counts[check] += 1
        if bad:
            st.failures.append(f"iteration {i}: {bad}")
            print(f"FAIL iteration {i}: {bad}", flush=True)
        st.churn()
        if (i + 1) % 50 == 0:
            print(f"{i + 1} iterations, {len(st.failures)} failures, {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"checks: {dict(st.counts)}; failures: {len(st.failures)}; {time.perf_counter() - t0:.0f} s")
    return 1 if st.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
