"""Several requests' chunks in one prefill forward (model/prefill.py `prefill_batch`) against
token-by-token decoding (fp32, tiny model).

The reference is each prompt fed one token at a time through the decode step, alone, then 32 greedy
steps. The batched prefill feeds all three prompts together, every forward holding a chunk of each
request still prefilling (different lengths, positions, slots, block tables), then the three decode
greedily as one batch: last-token logits within 1e-4, every request's state as decoding leaves it,
and the same 32 greedy ids. The prompts cross the CSA windows and HCA's first 128-token window.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsv4_serve.model.state import StatePools
from dsv4_serve.model.tiny import tiny_model
from tests.model.test_prefill import assert_same_state

PAGE, LENS, GEN = 8, (300, 77, 141), 32


@pytest.fixture(scope="module")
def tiny():
    model, args, _ = tiny_model(seed=0)
    return model, args


def pools_for(args) -> StatePools:
    return StatePools(args, max_slots=4, max_positions=max(LENS) + GEN + 8, page_size=PAGE)


def slot_state(pools: StatePools, h, args, n_pos: int) -> dict[str, np.ndarray]:
    """Everything the request owns after n_pos positions: its slot's rows, its pages' first entries."""
    out = {f"window{i}": np.array(w[h.slot]) for i, w in enumerate(pools.window)}
    for name in ("comp_kv", "comp_score", "idx_kv", "idx_score"):
        out |= {f"{name}{layer}": np.array(arr[h.slot]) for layer, arr in getattr(pools, name).items()}
    for name in ("ckv", "ikeys"):
        for layer, arr in getattr(pools, name).items():
            r = args.compress_ratios[layer]
            if n_pos // r:
                out[f"{name}{layer}"] = np.concatenate([np.array(arr[p]) for p in h.tables[r]])[: n_pos // r]
    return out


@pytest.fixture(scope="module")
def serial(tiny):
    """Each prompt fed token by token alone, then GEN greedy steps: (prompts, pools, handles, the logits
    after each prompt, the greedy ids, the state after each prompt)."""
    model, args = tiny
    rng = np.random.default_rng(21)
    prompts = [[int(t) for t in rng.integers(0, args.vocab_size, n)] for n in LENS]
    pools = pools_for(args)
    handles = [pools.alloc(max(LENS) + GEN + 8) for _ in prompts]
    lasts, ids, states = [], [], []
    for p, h in zip(prompts, handles, strict=True):
        for i, t in enumerate(p):
            last = np.array(model.decode(pools, [h], [t], [i])[0])
        lasts.append(last)
        states.append(slot_state(pools, h, args, len(p)))
        out, nxt = [], int(np.argmax(last))
        for k in range(GEN):
            out.append(nxt)
            nxt = int(np.argmax(np.array(model.decode(pools, [h], [nxt], [len(p) + k])[0])))
        ids.append(out)
    return prompts, lasts, ids, states


def oldest_first(prompts, fed, budget):
    """The scheduler's rule: each request in turn takes what it still needs, up to what is left."""
    work = []
    for j, p in enumerate(prompts):
        n = min(budget, len(p) - fed[j])
        if n > 0:
            work.append((j, n))
            budget -= n
    return work


@pytest.mark.parametrize("chunk", [1, 7, 64, 256, "budget"])
def test_batched_prefill_leaves_the_state_of_decoding(tiny, serial, chunk) -> None:
    """`chunk` tokens of every unfinished request per forward, or ("budget") 100 tokens per forward
    handed out oldest first, as the scheduler does: uneven chunks, requests joining and leaving."""
    model, args = tiny
    prompts, ref_last, ref_ids, ref_state = serial
    pools = pools_for(args)
    other = pools.alloc(16)  # a neighbour in slot 0 whose state must not move
    model.decode(pools, [other], [11], [0])
    before = slot_state(pools, other, args, 1)
    handles = [pools.alloc(max(LENS) + GEN + 8) for _ in prompts]
    fed, last, forwards = [0] * len(prompts), [None] * len(prompts), 0
    while any(f < len(p) for f, p in zip(fed, prompts, strict=True)):
        if chunk == "budget":
            plan = oldest_first(prompts, fed, 100)
        else:
            plan = [(j, min(chunk, len(p) - fed[j])) for j, p in enumerate(prompts) if fed[j] < len(p)]
        work = [(handles[j], prompts[j][fed[j] : fed[j] + n], fed[j]) for j, n in plan]
        out = model.prefill_batch(pools, work)
        forwards += 1
        for (j, n), lg in zip(plan, out, strict=True):
            fed[j] += n
            last[j] = np.array(lg)
    assert chunk != "budget" or forwards == -(-sum(LENS) // 100)
    for j in range(len(prompts)):
        assert np.max(np.abs(last[j] - ref_last[j])) <= 1e-4, j
        assert_same_state(slot_state(pools, handles[j], args, LENS[j]), ref_state[j])
    after = slot_state(pools, other, args, 1)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    nxt = [int(np.argmax(x)) for x in last]
    got = [[] for _ in prompts]
    for k in range(GEN):  # the three continue greedily as one decode batch
        for j, t in enumerate(nxt):
            got[j].append(t)
        out = model.decode(pools, handles, nxt, [len(p) + k for p in prompts])
        nxt = [int(np.argmax(np.array(out[j]))) for j in range(len(prompts))]
    assert got == ref_ids


def test_one_forward_equals_separate_forwards(tiny) -> None:
    """The rows of a batched forward are those of each request's own forward (no mixing across requests),
    down to the logits, at unaligned starts after some decode steps."""
    model, args = tiny
    rng = np.random.default_rng(3)
    seqs = [[int(t) for t in rng.integers(0, args.vocab_size, n)] for n in (90, 40)]
    starts = (5, 3)
    outs = []
    for batched in (True, False):
        pools = pools_for(args)
        hs = [pools.alloc(128) for _ in seqs]
        for h, s, st in zip(hs, seqs, starts, strict=True):
            for i in range(st):
                model.decode(pools, [h], [s[i]], [i])
        work = [(h, s[st:], st) for h, s, st in zip(hs, seqs, starts, strict=True)]
        res = model.prefill_batch(pools, work) if batched else [model.prefill_batch(pools, [w])[0] for w in work]
        outs.append([np.array(x) for x in res])
    for a, b in zip(*outs, strict=True):
        assert np.max(np.abs(a - b)) <= 1e-5


def test_prefill_batch_rejects_bad_work(tiny) -> None:
    model, args = tiny
    pools = StatePools(args, max_slots=2, max_positions=32, page_size=PAGE)
    a, b = pools.alloc(16), pools.alloc(16)
    with pytest.raises(ValueError, match="work must not be empty"):
        model.prefill_batch(pools, [])
    with pytest.raises(ValueError, match="token_ids must not be empty"):
        model.prefill_batch(pools, [(a, [1], 0), (b, [], 0)])
    with pytest.raises(ValueError, match="outside the request's capacity 16"):
        model.prefill_batch(pools, [(a, [1], 0), (b, [1] * 10, 10)])
    with pytest.raises(ValueError, match="slot .* twice"):
        model.prefill_batch(pools, [(a, [1, 2], 0), (a, [3], 2)])


@pytest.mark.parametrize("chunk", [7, "budget"])
def test_state_rows_written_by_write_rows_leave_the_same_state(tiny, serial, chunk, monkeypatch) -> None:
    """DSV4_PREFILL_STATE_INPLACE: the rings' and the compressors' slot rows go through `write_rows` (in place on
    CUDA; here its twin, MLX's scatter over the flat rows): the row ids it is given leave every request's state as
    decoding does and the neighbour's untouched (the test above, with it on)."""
    from dsv4_serve.model import prefill_compress

    monkeypatch.setattr(prefill_compress, "STATE_INPLACE", True)
    test_batched_prefill_leaves_the_state_of_decoding(tiny, serial, chunk)



@pytest.mark.parametrize("requests", [1, 3])
def test_a_short_prompt_s_indexer_keys_are_written_though_its_forward_reads_none(tiny, monkeypatch, requests):
    """On CUDA `write_rows` writes a pool in place and only its token (the copy of `carry` its readers take) makes
    it run: a write whose token nothing evaluates never happens. A short prompt's CSA queries keep every entry
    they see (`every_visible`), so its forward reads no indexer key, and the keys' writes must still be evaluated.
    Here the indexer keys' write is made token-driven as on CUDA (the pool returned as it was, the rows written only
    when the token is committed or made a dependency of what the forward evaluates), and the keys after the forward
    must be decoding's. Before the fix they were never written (on an H100: every CSA layer's keys zero after a
    300-token prompt in chunks of 100 and 200, 2026-12-07)."""
    import mlx.core as mx

    from dsv4_serve.model import prefill_compress

    model, args = tiny
    real_write, real_commit = prefill_compress.write_rows, prefill_compress.commit
    held: dict[int, tuple] = {}  # id(token) -> the write it runs

    def write(pool, rows, values, carry=None):  # noqa: ANN001, ANN202 - write_rows' signature
        if carry is None or pool.shape[2] != args.index_head_dim:  # not the keys: as the CPU writes
            return real_write(pool, rows, values, carry)
        token = carry + 0  # a new array, as the CUDA kernel's output
        held[id(token)] = (pool, rows, values, token)
        return pool, token

    def run(token) -> None:  # noqa: ANN001 - the write `token` stands for, into its pool (the same Python array)
        if token is not None and id(token) in held:
            target, rows, values, _ = held.pop(id(token))
            a, b, d = target.shape
            flat = target.reshape(a * b, d)
            flat[rows] = values
            target[...] = flat.reshape(a, b, d)  # its value replaced, its identity kept: "in place"

    def commit(pool, token):  # noqa: ANN001, ANN202 - queued now
        run(token)
        return real_commit(pool, token)

    def depends(inputs, dependencies):  # noqa: ANN001, ANN202 - a reader that evaluates with the graph
        for d in dependencies:
            run(d)
        return real_depends(inputs, dependencies)

    def queue(*xs):  # noqa: ANN002, ANN202 - a token queued (the last layer's writes: nothing reads its output)
        for a in xs:
            for x in a if isinstance(a, list) else [a]:
                run(x)
        return real_queue(*xs)

    real_depends, real_queue = mx.depends, mx.async_eval
    monkeypatch.setattr(prefill_compress, "write_rows", write)
    monkeypatch.setattr(prefill_compress, "commit", commit)
    monkeypatch.setattr(mx, "depends", depends)
    monkeypatch.setattr(mx, "async_eval", queue)
    rng = np.random.default_rng(5)
    n = 4 * args.index_topk  # the longest prompt whose queries all keep every entry
    prompts = [[int(t) for t in rng.integers(0, args.vocab_size, n)] for _ in range(requests)]
    pools, ref = pools_for(args), pools_for(args)
    handles, refs = [pools.alloc(64) for _ in prompts], [ref.alloc(64) for _ in prompts]
    model.prefill_batch(pools, [(h, p, 0) for h, p in zip(handles, prompts, strict=True)], logits=False)
    mx.eval(pools.arrays())
    assert not held  # every keys' write ran
    for p, h in zip(prompts, refs, strict=True):
        for i, t in enumerate(p):
            model.decode(ref, [h], [t], [i])
    keys = [k for k in slot_state(ref, refs[0], args, n) if k.startswith("ikeys")]
    assert keys  # the tiny model's CSA layers emitted keys
    for h, r in zip(handles, refs, strict=True):
        got, want = slot_state(pools, h, args, n), slot_state(ref, r, args, n)
        for k in keys:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)


@pytest.mark.parametrize("logits", [True, False])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("lens", [(16,), (16, 16, 9), (40,), (40, 23)])
def test_every_in_place_write_of_a_forward_is_evaluated(tiny, monkeypatch, lens, inplace, logits) -> None:
    """The mechanical form of the check above, for every `write_rows` of a forward: on CUDA a write runs only when
    its token is evaluated, so each token must be committed or reachable from what the forward evaluates (its
    outputs and the pools). Here every token carries a marker op (ErfInv, which nothing else in a forward uses),
    nothing is evaluated while the forward is built (EVAL_EVERY 0, commits kept as roots), and the graph of the
    outputs, the pools and the committed tokens must hold every marker: short contexts (picks made on the host)
    and scored ones, 1 and 3 requests, with the slot rows written in place or not, with the head or without it (the
    engine's forwards: nothing reads the last layer's output, and on CUDA its window rings were never written while
    their tokens hung on it, 2026-12-07)."""
    import io

    import mlx.core as mx

    from dsv4_serve.model import prefill, prefill_compress

    model, args = tiny
    real_write = prefill_compress.write_rows
    tokens: list[mx.array] = []
    roots: list[mx.array] = []

    def write(pool, rows, values, carry=None):  # noqa: ANN001, ANN202 - write_rows' signature
        new_pool, _ = real_write(pool, rows, values, carry)
        base = carry if carry is not None else mx.zeros((1,), mx.int32)
        token = base + mx.erfinv(mx.zeros(base.shape)).astype(mx.int32)  # the values of `carry`, marked
        tokens.append(token)
        return new_pool, token

    def commit(pool, token):  # noqa: ANN001, ANN202 - kept as a root, not evaluated now
        if token is not None:
            roots.append(token)
        return pool

    for mod in (prefill_compress, prefill):
        monkeypatch.setattr(mod, "write_rows", write)
    monkeypatch.setattr(prefill_compress, "commit", commit)  # (prefill.py commits none: its tokens are dependencies)
    monkeypatch.setattr(mx, "async_eval", lambda *xs: roots.extend(x for a in xs for x in (a if isinstance(a, list)
                                                                                         else [a])))  # the same
    monkeypatch.setattr(prefill, "EVAL_EVERY", 0)
    monkeypatch.setattr(prefill_compress, "STATE_INPLACE", inplace)
    rng = np.random.default_rng(9)
    prompts = [[int(t) for t in rng.integers(0, args.vocab_size, n)] for n in lens]
    pools = pools_for(args)
    handles = [pools.alloc(64) for _ in prompts]
    out = prefill.prefill_batch(model, pools, [(h, p, 0) for h, p in zip(handles, prompts, strict=True)],
                                logits=logits)  # lazy
    assert tokens  # the forward wrote through write_rows
    dot = io.StringIO()
    mx.export_to_dot(dot, *(out or []), *pools.arrays(), *roots)
    assert dot.getvalue().count('"ErfInv"') == len(tokens), "a write whose token nothing evaluates"
