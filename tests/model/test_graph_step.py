"""model/graph_step.py on a CUDA GPU (skipped elsewhere): the decode step replayed as one CUDA graph per row count
gives the MLX step's logits bit for bit, at ragged positions and contexts, for 1..3 rows, after its state pools moved
to new buffers (copied back into their home buffers, none captured again) and through the Engine
(service/engine/graphs.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels.graph.runtime import unavailable

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]


@pytest.fixture
def graphs_on():
    """The recorder in place of mx.fast.cuda_kernel and the glue kernels on, as `--decode-graphs on` sets them;
    restored after."""
    from dsv4_serve.kernels.cuda import GRAPH_GLUE, common, set_graph_glue
    from dsv4_serve.service.engine.graphs import prepare

    base, saved = mx.fast.cuda_kernel, (dict(common._kernels), dict(common._plans))
    rec = prepare("on")
    yield rec
    mx.fast.cuda_kernel = base
    common._kernels.clear()
    common._kernels.update(saved[0])
    common._plans.clear()
    common._plans.update(saved[1])
    set_graph_glue(GRAPH_GLUE)


STATE = ("window", "comp_kv", "comp_score", "idx_kv", "idx_score", "ckv", "ikeys")


def _copy(a: mx.array) -> mx.array:
    """A copy in a buffer of its own (bf16 through its bits: NumPy has no bfloat16)."""
    if a.dtype == mx.bfloat16:
        return mx.array(np.array(a.view(mx.uint16))).view(mx.bfloat16)
    return mx.array(np.array(a))


def _snapshot(pools) -> dict:
    return {n: {k: _copy(getattr(pools, n)[k]) for k in (range(len(getattr(pools, n))) if n == "window"
                                                         else list(getattr(pools, n)))} for n in STATE}  # fmt: skip


def _restore(pools, snap: dict) -> None:
    """The state as snapshotted, in new buffers (a step's writes are not idempotent: a compressor that emits
    consumes its partial window, so a second run of the same step on the state the first left gives another
    entry)."""
    for n, arrays in snap.items():
        for k, a in arrays.items():
            getattr(pools, n)[k] = _copy(a)
    mx.eval(pools.arrays())


def _model(layers: int = 4):
    from bench.step import flash_args, random_model

    return random_model(flash_args(layers, 16))


@pytest.mark.parametrize("dag", [False, True], ids=["chain", "dag"])
def test_replay_equals_the_mlx_step_bit_for_bit(graphs_on, tmp_path, dag: bool) -> None:
    from bench.step import fill_state
    from dsv4_serve.model.graph_record import pool_arrays
    from dsv4_serve.model.graph_step import GraphStep
    from dsv4_serve.model.state import StatePools

    model = _model()
    pools = StatePools(model.args, max_slots=4, max_positions=1024, page_size=64, dtype=model.dtype)
    handles = [pools.alloc(1024) for _ in range(3)]
    fill_state(pools, 700)
    g = GraphStep(model, pools, graphs_on, tmp_path, dag=dag)
    g.capture(handles)
    assert sorted(g.graphs) == [1, 2, 3], g.reasons
    pos = [517, 300, 655]
    tokens = [11, 22, 33]
    for step in range(4):  # row 2 starts at 655: its CSA compressor emits in the first step
        for n in (1, 3, 2):
            feeds = list(zip(handles[:n], tokens[:n], pos[:n], strict=True))
            batch = model.make_batch(pools, [h for h, _, _ in feeds], [p for _, _, p in feeds])
            snap = _snapshot(pools)
            want = model.step(batch, mx.array(tokens[:n], dtype=mx.int32), pools)
            mx.eval(want, pools.arrays())
            _restore(pools, snap)  # the replay starts from the state the MLX step started from
            g.touched()
            rows = list(batch.rows)
            got = g.replay(rows, tokens[:n])
            assert got is not None
            assert np.array_equal(np.array(got), np.array(want)), (step, n)
        tokens = [int(t) for t in np.argmax(np.array(got), axis=-1)] + tokens[2:]
        pos = [p + 1 for p in pos]
        if step == 2:  # every pool into a new buffer: the graphs must read what it holds
            fill_state(pools, 700)
            g.touched()
    # each moved pool copied back into its home buffer, the home array handed back; no graph captured again
    assert g.stats["pool_moves"] > 0 and g.stats["recaptures"] == 0
    now = pool_arrays(pools)
    assert all(now[label] is home for label, home in g.home.items())
    assert g.replay(list(model.make_batch(pools, handles[:1] * 1, [1]).rows) * 4, [1] * 4) is None  # no 4-row graph


def test_the_engine_decodes_through_its_graphs(graphs_on, tmp_path) -> None:
    from dsv4_serve.service.engine.engine import Engine

    eng = Engine(_model(), max_rows=2, max_model_len=512, decode_graphs="on", graph_cache_dir=tmp_path,
                 prefix_cache_bytes=0)  # fmt: skip
    eng.warmup()
    assert eng.graphs is not None and sorted(eng.graphs.graphs.graphs) == [1, 2]
    a, b = eng.admit(64), eng.admit(64)
    eng.prefill(a, list(range(5, 25)), 0)
    eng.prefill(b, list(range(40, 52)), 0)
    ta, tb = 7, 9
    for i in range(8):
        feeds = [(a, ta, 20 + i), (b, tb, 12 + i)]
        # the same step through MLX first, then the replay from the same state
        snap = _snapshot(eng.pools)
        want = eng.model.step(eng.model.make_batch(eng.pools, [a, b], [20 + i, 12 + i]),
                              mx.array([ta, tb], dtype=mx.int32), eng.pools)  # fmt: skip
        mx.eval(want, eng.pools.arrays())
        _restore(eng.pools, snap)
        eng.touched()
        got = np.array(eng.step(feeds))
        assert np.array_equal(got, np.array(want)), i
        ta, tb = (int(t) for t in np.argmax(got, axis=-1))
    s = eng.graphs.stats()
    assert s["graph_replays"] == 8 and not s["graph_fallbacks"], s


def test_a_restart_captures_from_stored_plans(graphs_on, tmp_path, monkeypatch) -> None:
    """The stored plans (DSV4_GRAPH_PLAN_CACHE, on by default): a second capture over the same cache directory
    loads every row count's plan instead of recording it (model/graph_plan_store.py), and its graphs replay MLX's
    step bit for bit."""
    from bench.step import fill_state
    from dsv4_serve.model.graph_step import GraphStep
    from dsv4_serve.model.state import StatePools

    monkeypatch.setenv("DSV4_GRAPH_PLAN_CACHE", "1")
    model = _model()
    pools = StatePools(model.args, max_slots=4, max_positions=1024, page_size=64, dtype=model.dtype)
    handles = [pools.alloc(1024) for _ in range(3)]
    fill_state(pools, 700)
    first = GraphStep(model, pools, graphs_on, tmp_path)
    first.capture(handles)
    assert sorted(first.graphs) == [1, 2, 3] and first.stats["plans_loaded"] == 0
    assert len(list((tmp_path / "plans").glob("*.json"))) == 3
    g = GraphStep(model, pools, graphs_on, tmp_path)
    g.capture(handles)
    assert sorted(g.graphs) == [1, 2, 3] and g.stats["plans_loaded"] == 3, g.reasons
    pos, tokens = [517, 300, 655], [11, 22, 33]
    batch = model.make_batch(pools, handles, pos)
    snap = _snapshot(pools)
    want = model.step(batch, mx.array(tokens, dtype=mx.int32), pools)
    mx.eval(want, pools.arrays())
    _restore(pools, snap)
    g.touched()
    got = g.replay(list(batch.rows), tokens)
    assert got is not None and np.array_equal(np.array(got), np.array(want))
