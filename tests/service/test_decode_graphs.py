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
