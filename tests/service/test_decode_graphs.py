"""service/engine/graphs.py off a GPU: which mode runs graphs where, and the engine it leaves (the replay itself:
tests/model/test_graph_step.py, gpu)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from dsv4_serve.service.engine.graphs import prepare

pytestmark = pytest.mark.skipif(mx.cuda.is_available(), reason="a CUDA GPU: graphs can run here")


def test_auto_and_off_keep_the_mlx_step_and_on_names_why_not() -> None:
    assert prepare("off") is None
    assert prepare("auto") is None
    with pytest.raises(ValueError, match="^--decode-graphs on: MLX's default device is not a CUDA GPU$"):
        prepare("on")
    with pytest.raises(ValueError, match="mode must be one of"):
        prepare("sometimes")


def test_an_engine_under_auto_steps_through_mlx_with_nothing_counted() -> None:
    from dsv4_serve.model.tiny import tiny_model
    from dsv4_serve.service.engine.engine import Engine

    model, _, _ = tiny_model(seed=0)
    eng = Engine(model, max_rows=2, max_model_len=64, decode_graphs="auto")
    assert eng.graphs is None and eng.pipeline_decode
    h = eng.admit(4)
    logits = eng.step([(h, 3, 0)])
    assert logits.shape == (1, model.args.vocab_size)


class _Graphs:
    """The engine's DecodeGraphs as far as prefill_advance uses it (a replay left running, its settle): the order of
    the calls. The replay itself needs a GPU (tests/model/test_graph_step.py)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def touched(self, settle: bool = True) -> None:
        self.calls.append("touched" if settle else "touched, not settled")

    def settle(self) -> float:
        self.calls.append("settle")
        return 0.0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prefill_slice_settles_the_replay_before_it_is_evaluated(overlap: bool, monkeypatch) -> None:
    """DSV4_GRAPH_OVERLAP: the slice is built before the replay in flight is settled (the settle comes with its first
    evaluation: model/prefill.py Forward's before_eval); off, the replay ends before the slice is built."""
    from dsv4_serve.model import prefill
    from dsv4_serve.model.tiny import tiny_model
    from dsv4_serve.service.engine.engine import Engine

    model, _, _ = tiny_model(seed=0)
    eng = Engine(model, max_rows=2, max_model_len=64)
    calls: list[str] = []
    real = mx.async_eval
    monkeypatch.setattr(prefill.mx, "async_eval", lambda *a: (calls.append("eval"), real(*a))[1])
    h = eng.admit(40)
    eng.graphs, eng.graph_overlap = _Graphs(calls), overlap  # type: ignore[assignment]
    assert not eng.prefill_batch([(h, list(range(3, 33)), 0)], slice_seconds=0.0)  # one layer
    want = ["touched, not settled", "settle", "eval"] if overlap else ["settle", "touched", "eval"]
    assert calls[:3] == want
