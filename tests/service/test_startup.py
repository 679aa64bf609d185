"""service/engine/startup.settle: the start-up heap frozen, the GIL switch interval, collections timed."""

import gc
import sys

import pytest

from service.engine import startup


@pytest.fixture
def restore():
    interval = sys.getswitchinterval()
    yield
    sys.setswitchinterval(interval)
    gc.unfreeze()
    startup._sink = None


def test_settle_freezes_times_collections_and_sets_the_interval(restore, monkeypatch):
    monkeypatch.setenv("DSV4_SWITCH_INTERVAL_MS", "0.5")
    host: dict[str, float] = {}
    startup.settle(host)
    assert gc.get_freeze_count() > 0
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    gc.collect()
    assert host["gc"] > 0.0
    startup.settle(host)  # a second engine in the process: one callback, not two
    assert gc.callbacks.count(startup._timed) == 1


def test_settle_can_leave_the_heap_alone(restore, monkeypatch):
    gc.unfreeze()
    monkeypatch.setenv("DSV4_GC_FREEZE", "0")
    startup.settle(None)
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("bad", ["0", "-1", "1000"])
def test_settle_rejects_a_bad_interval(restore, monkeypatch, bad):
    monkeypatch.setenv("DSV4_SWITCH_INTERVAL_MS", bad)
    with pytest.raises(ValueError, match="DSV4_SWITCH_INTERVAL_MS"):
        startup.settle(None)
