"""The V4-Flash and V4-Pro configs build a weightless skeleton and report the published parameter counts."""

from __future__ import annotations

import mlx.core as mx

from dsv4_serve.model.config import ModelArgs
from dsv4_serve.model.skeleton import flash_args, parameter_counts, pro_args


def test_flash_counts_without_allocating() -> None:
    before = mx.get_active_memory()
    c = parameter_counts(flash_args())
    assert mx.get_active_memory() - before < 64 << 20  # lazy: 284B parameters, no bytes
    assert abs(c["total"] / 284e9 - 1) < 0.01
    # "13B active" is a rounded figure: we count 13.27B (routed 6 of 256, shared, attention, head).
    assert abs(c["active"] / 13e9 - 1) < 0.03


def test_pro_counts() -> None:
    c = parameter_counts(pro_args())
    assert abs(c["active"] / 49e9 - 1) < 0.01
    # "1.6T" is rounded: 1.573T without the MTP block.
    assert abs(c["total"] / 1.6e12 - 1) < 0.02


def test_flash_config_from_release_json() -> None:
    """The release config.json spelling (44 compress_ratios incl. the MTP entry) gives the same model."""
    cfg = flash_args().to_config_json()
    assert len(cfg["compress_ratios"]) == 44
    assert ModelArgs.from_dict(cfg).compress_ratios == flash_args().compress_ratios
