"""A checkpoint load logs its progress (shards and bytes done, GB/s, ETA) and a closing line with the bytes read,
which must be every tensor byte the shards' headers declare."""

from __future__ import annotations

import json
import logging
import re
import struct
from pathlib import Path

import pytest

import dsv4_serve.model.load_progress as load_progress
from dsv4_serve.model.checkpoint import write_checkpoint
from dsv4_serve.model.loader import load_model
from dsv4_serve.model.tiny import tiny_model


def header_bytes(path: Path) -> int:
    """Tensor bytes of one safetensors file, from its header's data offsets."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


def test_load_logs_progress_per_shard(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                      monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    model, args, tok = tiny_model(seed=0)
    write_checkpoint(model, args, tmp_path, dtype="release", shards=3, tokenizer=tok)
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) == 3
    total_mb = sum(header_bytes(p) for p in shards) / 1e6
    monkeypatch.setattr(load_progress, "EVERY_S", 0.0)  # a line at every tensor
    with caplog.at_level(logging.INFO, logger="dsv4.loader"):
        load_model(tmp_path)
    lines = [r.getMessage() for r in caplog.records if r.name == "dsv4.loader"]
    steps = [re.fullmatch(r"loading: (\d)/3 shards, ([\d.]+) MB of ([\d.]+) MB, [\d.]+ GB/s, ETA (\d+ s|\?)", m)
             for m in lines if m.startswith("loading:")]  # fmt: skip
    assert len(steps) > 10 and all(steps), lines[:3]
    done = [int(m.group(1)) for m in steps]
    assert done == sorted(done) and done[0] == 0 and done[-1] == 2  # the third completes with the last tensor
    assert float(steps[-1].group(3)) == pytest.approx(total_mb, abs=0.06)
    final = [m for m in lines if m.startswith("loaded ")]
    assert len(final) == 1
    got = re.fullmatch(r"loaded ([\d.]+) MB from 3 shards in [\d.]+ s \([\d.]+ GB/s\)", final[0])
    assert got and float(got.group(1)) == pytest.approx(total_mb, abs=0.06)
