"""A slot's rows (model/state_copy.py `_write_slot`): its reset on allocation, a copy from another slot (n > 1), a
cached prefix's slot state loaded. The values against NumPy's, both ways:
- with DSV4_PREFILL_STATE_INPLACE=0 (MLX's scatter into a renewed array, kernels/pool_rows.py `renewed`): the reset
  makes every per-slot array a new one and leaves the old one (a graph server's home) as it was, so the graphs see
  each write and copy it home; the forward's own scatters the same way (the last test);
- with the slot rows in place (`SLOT_ROWS_INPLACE`, the default, as prefill's forward writes them): through
  `write_slots` (every per-slot array in one launch), a stand-in for CUDA's in-place write (the pool's value
  replaced, its Python array kept) and, on a GPU, CUDA's own (kernels/cuda/pool_rows.py): no per-slot array may
  become a new array, or the graphs copy it home before the next replay (a 5.6 ms refresh after each admitted
  request, H100, 2026-12-07)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from dsv4_serve.kernels import backend, pool_rows
from dsv4_serve.model import state_copy
from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model


def in_place(pool, rows, values, carry=None):  # noqa: ANN001, ANN201 - write_rows' signature, as CUDA's writes
    a, b, d = pool.shape
    flat = pool.reshape(a * b, d)
    flat[rows] = values
    pool[...] = flat.reshape(a, b, d)  # its value replaced, its identity kept
    return pool, mx.array([1], mx.int32)  # a token, as the CUDA kernel's


def in_place_slots(pools, slot, values):  # noqa: ANN001, ANN201 - write_slots' signature, as CUDA's one launch
    pool_rows.check_write_slots(pools, slot, values)
    for p, v in zip(pools, values, strict=True):
        b = p.shape[1]
        in_place(p, mx.arange(slot * b, (slot + 1) * b, dtype=mx.int32), v)
    return list(pools), mx.array([slot], mx.int32)


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not backend.cuda_available(),
                                                                         reason="needs an MLX CUDA GPU")])


@pytest.mark.parametrize("slots", [False, True], ids=["write_rows", "write_slots"])
@pytest.mark.parametrize("arm", ["scatter", "stand-in", CUDA])
def test_a_slot_s_reset_copy_and_load_write_its_rows_only(monkeypatch, arm, slots: bool) -> None:
    inplace = arm != "scatter"
    monkeypatch.setattr(pool_rows, "SLOT_ROWS_INPLACE", inplace)
    monkeypatch.setattr(pool_rows, "WRITE_SLOTS", slots)
    if arm == "stand-in":
        monkeypatch.setattr(state_copy, "write_rows", in_place)
        monkeypatch.setattr(state_copy, "write_slots", in_place_slots)
    _, args, _ = tiny_model()
    pools = StatePools(args, max_slots=3, max_positions=128, page_size=16, dtype=mx.float32)
    rng = np.random.default_rng(3)
    start = {name: rng.standard_normal(a.shape).astype(np.float32) for name, a in pools.slot_arrays().items()}
    for name, c, k in pools._slot_fields():  # every slot holds a predecessor's values
        c[k] = mx.array(start[name])
    homes = dict(pools.slot_arrays())
    want = {name: v.copy() for name, v in start.items()}

    a = pools.alloc(64)  # slot 0 reset: scores -inf, values and rings 0
    renewed = [name for name, x in pools.slot_arrays().items() if x is not homes[name]]
    assert renewed == ([] if inplace else list(homes)), renewed[:5]
    if not inplace:  # the scatter went to the new arrays: the old ones (a graph server's homes) keep their values
        for name, x in homes.items():
            np.testing.assert_array_equal(np.array(x), start[name], err_msg=name)
    homes = dict(pools.slot_arrays())
    for name, v in want.items():
        v[a.slot] = -np.inf if "score" in name else 0.0
    b = pools.alloc(64)
    for name, v in want.items():
        v[b.slot] = -np.inf if "score" in name else 0.0
    for name, c, k in pools._slot_fields():  # a writes its slot (as a prefill would), then b takes a copy
        c[k][a.slot] = mx.array(rng.standard_normal(c[k].shape[1:]).astype(np.float32))  # the same array
        want[name][a.slot] = np.array(c[k][a.slot])
    pools.copy_slot(a, b, 0)
    for v in want.values():
        v[b.slot] = v[a.slot]
    loaded = {name: rng.standard_normal(v.shape[1:]).astype(np.float32) for name, v in want.items()}
    pools.load_slot(a.slot, {name: mx.array(x) for name, x in loaded.items()})
    for name, x in loaded.items():
        want[name][a.slot] = x

    mx.synchronize()  # a host read of an array written in place waits for the array's own event only, not the kernel's
    got = pools.slot_arrays()
    for name, v in want.items():
        np.testing.assert_array_equal(np.array(got[name]), v, err_msg=name)  # slot 2 (never written) as it was
    if inplace:
        moved = [name for name, x in got.items() if x is not homes[name]]
        assert not moved, f"per-slot arrays made new by a slot write: {moved[:5]}"


def test_a_forward_s_scatters_make_new_arrays_and_leave_the_pools_own(monkeypatch) -> None:
    """The default forward (slot rows by MLX's scatter) writes each per-slot array it touches into a new array and
    leaves the array the pools held (a graph server's home, handed back at a replay) as it was: so the graphs'
    identity test sees every such write, and none rests on MLX donating the home's buffer. Before, the scatter went
    into the pools' own array (same array, new value): a later forward of a prompt after a replay wrote into the
    home array itself."""
    from dsv4_serve.model import prefill, prefill_compress

    monkeypatch.setattr(prefill_compress, "STATE_INPLACE", False)
    model, args, _ = tiny_model(seed=0)
    pools = StatePools(args, max_slots=2, max_positions=256, page_size=16, dtype=mx.float32)
    h = pools.alloc(200)
    mx.eval(pools.arrays())
    homes = dict(pools.slot_arrays())
    kept = {name: np.array(x) for name, x in homes.items()}
    prompt = [int(t) for t in np.random.default_rng(4).integers(3, args.vocab_size, 150)]
    mx.eval(prefill.prefill_batch(model, pools, [(h, prompt, 0)]), pools.arrays())
    after = pools.slot_arrays()
    written = [n for n, x in after.items() if not np.array_equal(np.array(x), kept[n], equal_nan=True)]
    assert any(n.startswith("window") for n in written) and any(n.startswith("comp_kv") for n in written), written
    for n in written:
        assert after[n] is not homes[n], n
    for n, x in homes.items():
        np.testing.assert_array_equal(np.array(x), kept[n], err_msg=n)


@pytest.mark.parametrize("op", ["reset", "copy", "load"])
@pytest.mark.parametrize("arm", ["stand-in", CUDA])
def test_each_slot_write_through_write_slots_alone_leaves_the_other_slots(monkeypatch, arm, op: str) -> None:
    """write_slots (DSV4_WRITE_SLOTS=1) for one kind of write at a time, into slot 1 of 3 (a copy from slot 0): the
    written slot holds its values and slots 0 and 2 keep theirs, every per-slot array. On the H100 (2026-12-08)
    the sequence above failed with write_slots (a slot no write named changed): this says which write does it."""
    monkeypatch.setattr(pool_rows, "SLOT_ROWS_INPLACE", True)
    monkeypatch.setattr(pool_rows, "WRITE_SLOTS", True)
    if arm == "stand-in":
        monkeypatch.setattr(state_copy, "write_slots", in_place_slots)
    _, args, _ = tiny_model()
    pools = StatePools(args, max_slots=3, max_positions=128, page_size=16, dtype=mx.float32)
    rng = np.random.default_rng(4)
    want = {name: rng.standard_normal(a.shape).astype(np.float32) for name, a in pools.slot_arrays().items()}
    for name, c, k in pools._slot_fields():
        c[k] = mx.array(want[name])
    mx.eval(pools.arrays())
    handles = [pools.alloc(64) for _ in range(2)] if op == "copy" else []
    if op == "reset":
        pools._reset_slot(1)
        for name, v in want.items():
            v[1] = -np.inf if "score" in name else 0.0
    elif op == "copy":
        for name, v in want.items():  # the allocations reset slots 0 and 1 (through write_slots too)
            v[0] = v[1] = -np.inf if "score" in name else 0.0
        for name, c, k in pools._slot_fields():
            c[k][0] = mx.array(rng.standard_normal(c[k].shape[1:]).astype(np.float32))
            want[name][0] = np.array(c[k][0])
        pools.copy_slot(handles[0], handles[1], 0)
        for v in want.values():
            v[1] = v[0]
    else:
        loaded = {name: rng.standard_normal(v.shape[1:]).astype(np.float32) for name, v in want.items()}
        pools.load_slot(1, {name: mx.array(x) for name, x in loaded.items()})
        for name, x in loaded.items():
            want[name][1] = x
    mx.synchronize()  # (as above: the in-place kernels done before the host reads the arrays)
    got = pools.slot_arrays()
    for name, v in want.items():
        for s in range(3):
            np.testing.assert_array_equal(np.array(got[name][s]), v[s], err_msg=f"{name} slot {s}")
