"""DSV4_ENGINE_PROFILE: the serving loop's cProfile file and the slow iterations' lines (engine_profile.py)."""

from __future__ import annotations

import pstats
from types import SimpleNamespace

from dsv4_serve.service.engine.engine_profile import EngineProfile


def _engine(replays: int, layers: int) -> SimpleNamespace:
    graphs = SimpleNamespace(graphs=SimpleNamespace(stats={"replays": replays, "refresh_ms": 2.5 * replays}))
    return SimpleNamespace(graphs=graphs, prefill_layers=layers, prefill_rows_layers=32 * layers)


def test_unset_does_nothing(monkeypatch):
    monkeypatch.delenv("DSV4_ENGINE_PROFILE", raising=False)
    p = EngineProfile.start()
    assert p.prof is None
    assert p.iteration({"loop": 5.0}, _engine(1, 1)) is None
    p.stop()


def test_slow_iterations_logged_with_their_counters_and_the_profile_written(monkeypatch, tmp_path):
    monkeypatch.setenv("DSV4_ENGINE_PROFILE", str(tmp_path / "prof"))
    p = EngineProfile.start()
    assert p.iteration({"prefill": 0.001, "loop": 0.002}, _engine(3, 2)) is None  # fast: not logged
    line = p.iteration({"prefill": 0.07, "loop": 0.08}, _engine(4, 5))
    assert line is not None
    assert "prefill 70.0" in line and "loop 80.0" in line
    assert "replays +1" in line and "refresh_ms +2.5" in line and "prefill_layers +3" in line
    assert "prefill_rows_layers +96" in line
    import mlx.core as mx

    held = mx.ones((1 << 24,), mx.float32)  # 64 MB MLX holds while the line is made
    mx.eval(held)
    mem = p.iteration({"prefill": 0.07, "loop": 0.08}, _engine(4, 5)).split("| GB ")[1]
    active = float(mem.split("active ")[1].split()[0])
    assert active >= 0.06 and "cache " in mem and "peak " in mem  # MLX's memory then, in GB
    assert p.iteration(None, _engine(9, 9)) is None  # an idle pass: nothing to say
    sum(i * i for i in range(1000))
    p.stop()
    stats = pstats.Stats(str(tmp_path / "prof" / "engine.pstats"))
    assert any(fn[2] == "iteration" for fn in stats.stats)  # the profiled thread's calls are in it


def test_a_prefill_s_host_ms_split_into_build_eval_and_snapshot() -> None:
    """A real engine (the tiny model) serving one prompt: its prefill's host ms, built / evaluated / snapshotted
    for the prefix cache, counted where the slow lines read them."""
    import asyncio

    from dsv4_serve.model.tiny import tiny_model
    from dsv4_serve.service.engine.engine import Engine
    from dsv4_serve.service.engine.request import SamplingParams
    from dsv4_serve.service.engine.worker import EngineWorker

    engine = Engine(tiny_model(seed=0)[0], max_rows=2, max_model_len=256, page_size=16, prefix_cache_bytes=16 << 20)
    w = EngineWorker(lambda: (engine, None))
    w.start()

    async def main() -> None:
        assert await w.wait_ready(60), w.start_error
        try:
            params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            assert [e async for e in await w.submit(list(range(2, 40)), params)]
        finally:
            await w.drain(0)

    asyncio.run(main())
    split = {k: v for k, v in EngineProfile(None).counters(engine).items() if k.endswith("_ms")}
    assert set(split) == {"prefill_build_ms", "prefill_eval_ms", "prefill_snapshot_ms", "prefill_admit_ms"}
    assert split["prefill_build_ms"] > 0 and split["prefill_snapshot_ms"] > 0 and split["prefill_eval_ms"] >= 0
    assert split["prefill_admit_ms"] > 0
