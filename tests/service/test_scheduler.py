"""Scheduler: pure logic, driven with a tiny admission ledger (slots + a token budget)."""

from __future__ import annotations

import pytest

from dsv4_serve.service.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from dsv4_serve.service.engine.scheduler import QueueFull, Scheduler, needs_sample

EOS = 2


class Ledger:
    """Admission by slots and a positions budget; records every admit/release."""

    def __init__(self, slots: int = 8, tokens: int = 10_000) -> None:
        self.slots, self.tokens = slots, tokens
        self.live: dict[int, int] = {}
        self.next = 0
        self.released: list[int] = []

    def can_admit(self, n: int) -> bool:
        return len(self.live) < self.slots and sum(self.live.values()) + n <= self.tokens

    def admit(self, n: int) -> int:
        if not self.can_admit(n):
            raise RuntimeError("no room")
        self.next += 1
        self.live[self.next] = n
        return self.next

    def release(self, h: int) -> None:
        assert h in self.live, f"double release of {h}"
        del self.live[h]
        self.released.append(h)


def make(ledger: Ledger | None = None, **kw) -> tuple[Scheduler, Ledger]:
    led = ledger or Ledger()
    kw.setdefault("max_rows", 8)
    kw.setdefault("max_queue", 16)
    kw.setdefault("max_model_len", 1000)
    return Scheduler(led, eos_token_id=EOS, **kw), led


def req(rid: str, n_prompt: int = 3, **params) -> Request:
    return Request(rid, list(range(10, 10 + n_prompt)), SamplingParams(**params))


def run_step(s: Scheduler, tokens: dict[str, int] | None = None, default: int = 7):
    """One step: every row that needs a token gets tokens.get(id, default)."""
    plan = s.plan()
    feeds = s.feeds(plan)
    tokens = tokens or {}
    sampled = {r.request_id: (tokens.get(r.request_id, default), None, ()) for r in plan if needs_sample(r)}
    return plan, feeds, s.on_step(sampled)


def test_token_serial_prefill_then_decode_feeds_and_positions() -> None:
    s, _ = make()
    r = req("a", n_prompt=3, max_tokens=3)
    s.add(r)
    seen = []
    for _ in range(5):
        plan, feeds, events = run_step(s, default=50 + len(seen))
        seen.append((feeds[0][1], feeds[0][2], [e.token_id for e in events]))
    # Prompt tokens 10, 11, 12 at positions 0..2; the first sample comes with the last prompt token.
    assert seen[:3] == [(10, 0, []), (11, 1, []), (12, 2, [52])]
    assert seen[3][:2] == (52, 3) and seen[4][:2] == (53, 4)
    assert r.output_ids == [52, 53, 54] and r.status is RequestStatus.FINISHED


def test_admission_fifo_and_max_rows_cap() -> None:
    s, led = make(max_rows=2)
    for i in range(4):
        s.add(req(f"r{i}", max_tokens=5))
    plan = s.plan()
    assert [r.request_id for r in plan] == ["r0", "r1"] and s.num_waiting == 2
    s.on_step({})
    assert s.abort("r0") is not None
    assert [r.request_id for r in s.plan()] == ["r1", "r2"]
    assert led.released == [1]


def test_head_is_not_skipped_when_it_does_not_fit() -> None:
    s, led = make(Ledger(tokens=30))
    s.add(req("big", n_prompt=5, max_tokens=20))  # 25 positions
    s.add(req("huge", n_prompt=5, max_tokens=20))  # doesn't fit beside big
    s.add(req("small", n_prompt=1, max_tokens=1))  # would fit, but must not jump the queue
    assert [r.request_id for r in s.plan()] == ["big"]
    assert [r.request_id for r in s.waiting] == ["huge", "small"]
    s.on_step({})
    s.abort("big")
    assert [r.request_id for r in s.plan()] == ["huge", "small"]


def test_queue_full() -> None:
    s, _ = make(max_queue=2)
    s.add(req("a"))
    s.add(req("b"))
    with pytest.raises(QueueFull):
        s.add(req("c"))
    s.plan()  # both admitted: room again
    s.add(req("c"))
    with pytest.raises(ValueError, match="in flight"):
        s.add(req("a"))


def test_max_prefill_rows_keeps_decode_rows_flowing() -> None:
    s, _ = make(max_prefill_rows=1)
    s.add(req("d", n_prompt=1, max_tokens=50))
    run_step(s)  # d's only prompt token: it decodes from now on
    s.add(req("p1", n_prompt=4))
    s.add(req("p2", n_prompt=4))
    plan, _, _ = run_step(s)
    assert [r.request_id for r in plan] == ["d", "p1"]
    with pytest.raises(ValueError):
        make(max_prefill_rows=0)


def test_eos_stops_without_emitting_token_and_releases_once() -> None:
    s, led = make()
    s.add(req("a", n_prompt=1, max_tokens=10))
    _, _, ev = run_step(s, default=5)
    assert [(e.token_id, e.finish_reason) for e in ev] == [(5, None)]
    _, _, ev = run_step(s, default=EOS)
    assert [(e.token_id, e.finish_reason) for e in ev] == [(None, FinishReason.STOP)]
    assert led.released == [1] and not s.has_work()
    assert s.abort("a") is None  # already finished: no second release
    assert led.released == [1]


def test_min_tokens_and_ignore_eos() -> None:
    s, _ = make()
    s.add(req("m", n_prompt=1, max_tokens=10, min_tokens=2))
    s.add(req("i", n_prompt=1, max_tokens=3, ignore_eos=True))
    _, _, ev = run_step(s, default=EOS)
    assert [(e.request_id, e.token_id) for e in ev] == [("m", EOS), ("i", EOS)]
    _, _, ev = run_step(s, default=EOS)
    assert [(e.request_id, e.token_id) for e in ev] == [("m", EOS), ("i", EOS)]
    _, _, ev = run_step(s, default=EOS)  # m has 2 tokens now: EOS stops it; i runs into max_tokens
    assert [(e.request_id, e.token_id, e.finish_reason) for e in ev] == [
        ("m", None, FinishReason.STOP),
        ("i", EOS, None),
        ("i", None, FinishReason.LENGTH),
    ]


def test_stop_token_ids() -> None:
    s, _ = make()
    s.add(req("a", n_prompt=1, max_tokens=10, stop_token_ids=(99, 98)))
    run_step(s, default=5)
    _, _, ev = run_step(s, default=98)
    assert ev[-1].finish_reason is FinishReason.STOP and ev[-1].token_id is None


def test_max_tokens_emits_last_token_then_length() -> None:
    s, led = make()
    s.add(req("a", n_prompt=2, max_tokens=2))
    events = []
    for _ in range(3):
        events += run_step(s)[2]
    assert [(e.token_id, e.finish_reason) for e in events] == [
        (7, None),
        (7, None),
        (None, FinishReason.LENGTH),
    ]
    assert led.released == [1]


def test_context_limit_finishes_with_length() -> None:
    s, _ = make(max_model_len=5)
    s.add(req("a", n_prompt=3, max_tokens=100))
    events = []
    while s.has_work():
        events += run_step(s)[2]
    assert [e.token_id for e in events] == [7, 7, None]
    assert events[-1].finish_reason is FinishReason.LENGTH


def test_abort_waiting_and_running_frees_at_once() -> None:
    s, led = make(max_rows=1)
    s.add(req("run", max_tokens=5))
    s.add(req("wait", max_tokens=5))
    s.plan()
    s.on_step({})
    ev = s.abort("wait")
    assert ev is not None and ev.finish_reason is FinishReason.ABORT
    assert led.released == []  # it never held state
    assert s.abort("run").finish_reason is FinishReason.ABORT
    assert led.released == [1] and not led.live and not s.has_work()
    assert s.abort("nope") is None


def test_abort_between_plan_and_on_step_skips_the_row() -> None:
    s, led = make()
    s.add(req("a", n_prompt=1))
    plan = s.plan()
    s.abort("a")
    assert s.on_step({"a": (5, None, ())}) == [] and led.released == [1]
    assert plan[0].output_ids == []


def test_fail_emits_error_and_releases() -> None:
    s, led = make()
    s.add(req("a"))
    s.add(req("b"))
    s.plan()
    ev = s.fail(["a"], "boom")
    assert [(e.request_id, e.error) for e in ev] == [("a", "boom")]
    assert led.released == [1]
    _, _, _ = run_step(s)
    assert [r.request_id for r in s.running] == ["b"]


def test_prefill_work_budget_oldest_first_leaves_the_last_prompt_token() -> None:
    s, _ = make()
    a, b, c = req("a", n_prompt=10), req("b", n_prompt=6), req("c", n_prompt=1)
    for r in (a, b, c):
        s.add(r)
    plan = s.plan()
    work = s.prefill_work(plan, budget=12)
    # a gets its 9 non-last tokens, b the 3 left in the budget, c (a 1-token prompt) nothing
    assert [(r.request_id, toks, start) for r, _, toks, start in work] == [
        ("a", a.prompt_ids[:9], 0), ("b", b.prompt_ids[:3], 0),
    ]  # fmt: skip
    assert [h for _, h, _, _ in work] == [s.handles["a"], s.handles["b"]]
    for r, _, toks, _ in work:
        s.prefilled(r, len(toks))
    # the step then feeds a's last prompt token (sampled) and b's next prompt token (not sampled)
    feeds = s.feeds(plan)
    assert [(tok, pos) for _, tok, pos in feeds] == [(a.prompt_ids[9], 9), (b.prompt_ids[3], 3), (c.prompt_ids[0], 0)]
    assert [needs_sample(r) for r in plan] == [True, False, True]
    s.on_step({"a": (7, None, ()), "c": (7, None, ())})
    assert (a.fed, b.fed, c.fed) == (10, 4, 1) and a.output_ids == [7] and c.output_ids == [7]
    # next step: b's one remaining non-last token, a and c are decoding
    plan = s.plan()
    assert [(r.request_id, toks, start) for r, _, toks, start in s.prefill_work(plan, budget=100)] == [
        ("b", [b.prompt_ids[4]], 4),
    ]  # fmt: skip


class PipelinedEngine:
    """What can_pipeline reads of an engine: whether it can take device tokens."""

    pipeline_decode = True


def test_can_pipeline_only_while_nobody_waiting_could_be_admitted() -> None:
    from dsv4_serve.service.engine.stepping import can_pipeline

    sched, _ = make(max_rows=2)
    reqs = [Request(f"r{i}", [5, 6], SamplingParams(max_tokens=4)) for i in range(3)]
    sched.add(reqs[0])
    plan = sched.plan()
    sched.prefilled(reqs[0], 1)  # the prompt but its last token: this step samples r0's first token
    assert not can_pipeline(PipelinedEngine(), sched, plan)  # which goes out before another step is built
    reqs[0].output_ids.append(7)
    assert can_pipeline(PipelinedEngine(), sched, plan)  # one decoding row, nobody waiting
    sched.add(reqs[1])
    assert not can_pipeline(PipelinedEngine(), sched, plan)  # a free row: r1 must join next step
    plan = sched.plan()
    sched.add(reqs[2])
    assert not can_pipeline(PipelinedEngine(), sched, plan)  # r1 is still prefilling: it samples nothing
    sched.prefilled(reqs[1], 1)
    assert not can_pipeline(PipelinedEngine(), sched, plan)  # r1's first token
    reqs[1].output_ids.append(7)
    assert len(plan) == 2 and sched.num_waiting == 1
    assert can_pipeline(PipelinedEngine(), sched, plan)  # rows full: r2 waits for a row either way
    reqs[0].output_ids += [7, 7]  # r0's next token reaches max_tokens and frees a row for r2
    assert not can_pipeline(PipelinedEngine(), sched, plan)
    assert not can_pipeline(object(), sched, plan[1:])  # an engine without device-token steps


class SnapshotLedger(Ledger):
    """A ledger with the prefix cache's optional hooks: pieces end at multiples of 8, retire records."""

    snapshot_interval = 8
    prefix_enabled = True

    def __init__(self) -> None:
        super().__init__()
        self.retired: list[tuple[int, list[int], str]] = []

    def retire(self, h: int, tokens: list[int], request_id: str, namespace: tuple[str, str]) -> None:
        self.retired.append((h, list(tokens), request_id))
        self.release(h)


def test_prefill_pieces_end_at_the_snapshot_interval_and_finish_retires_the_fed_tokens() -> None:
    led = SnapshotLedger()
    s, _ = make(led)
    a, b = req("a", n_prompt=21, max_tokens=2, ignore_eos=True), req("b", n_prompt=4, max_tokens=1)
    s.add(a)
    s.add(b)
    plan = s.plan()
    assert a.cached == 0 and b.cached == 0
    work = [(r.request_id, start, len(toks)) for r, _, toks, start in s.prefill_work(plan, budget=19)]
    # 19 tokens: a's piece ends at 16 (its last multiple of 8 short of its prompt's end), b takes the other 3
    assert work == [("a", 0, 16), ("b", 0, 3)]
    for r, _, toks, _ in s.prefill_work(plan, budget=100):
        s.prefilled(r, len(toks))
    s.feeds(plan)
    s.on_step({"a": (40, None, ()), "b": (EOS, None, ())})  # b stops on EOS, a samples its first token
    assert led.retired == [(2, [10, 11, 12, 13], "b")]  # b fed its prompt; the EOS was not fed
    run_step(s, default=41)  # a's second token: max_tokens
    assert led.retired[-1] == (1, list(range(10, 31)) + [40], "a")  # its prompt + the first token


def test_a_stop_fed_by_a_step_queued_ahead_is_part_of_the_retired_state() -> None:
    led = SnapshotLedger()
    s, _ = make(led)
    a = req("a", n_prompt=3, max_tokens=5)
    s.add(a)
    run_step(s, default=3)  # token serial: prompt 10 at 0
    run_step(s, default=3)
    run_step(s, default=30)  # the last prompt token: samples 30
    plan = s.plan()
    s.feeds(plan)
    s.on_step({"a": (EOS, None, ())}, ahead=frozenset({"a"}))  # a step queued ahead already fed the EOS
    assert led.retired == [(1, [10, 11, 12, 30, EOS], "a")]


def test_prompts_sharing_a_prefix_compute_it_once() -> None:
    """Three prompts arrive together: b shares a's first 21 tokens, c none. a's piece is cut at 16 (the shared
    part's last snapshot boundary: the snapshot b adopts next step), b waits a step, c goes whole."""
    s, _ = make(SnapshotLedger())
    a = Request("a", list(range(10, 40)), SamplingParams())
    b = Request("b", list(range(10, 31)) + [99, 98, 97, 96, 95], SamplingParams())
    c = Request("c", list(range(200, 230)), SamplingParams())
    for r in (a, b, c):
        s.add(r)
    plan = s.plan()
    work = [(r.request_id, start, len(toks)) for r, _, toks, start in s.prefill_work(plan, budget=100)]
    assert work == [("a", 0, 16), ("c", 0, 29)]
    a.fed = b.fed = 16  # a prefilled 16, b adopted its snapshot
    work = [(r.request_id, start, len(toks)) for r, _, toks, start in s.prefill_work([a, b], budget=100)]
    assert work == [("a", 16, 13), ("b", 16, 9)]  # from 16 on they share 5 tokens: < 8, no cut


class ChatLedger(SnapshotLedger):
    snapshot_token = 2  # the first user turn's marker


def test_a_system_prompt_gets_its_own_snapshot() -> None:
    """A prompt whose first user turn starts at SYSTEM_SNAPSHOT_MIN or later: its first piece ends right before it
    (the engine snapshots that state); a later prompt with the same system prompt, arriving together, waits for
    that snapshot. A shorter system prompt, or none, goes as usual."""
    from dsv4_serve.service.engine.prompt_plan import SYSTEM_SNAPSHOT_MIN

    n = SYSTEM_SNAPSHOT_MIN + 3
    system = [5 + i % 90 for i in range(n)]
    s, _ = make(ChatLedger(), max_model_len=4 * n)
    a = Request("a", system + [2, 40, 41, 42], SamplingParams())
    b = Request("b", system + [2, 50, 51], SamplingParams())
    c = Request("c", [300 + i % 50 for i in range(60)] + [2] + system, SamplingParams())  # its turn at 60: whole
    for r in (a, b, c):
        s.add(r)
    work = [(r.request_id, start, len(toks)) for r, _, toks, start in s.prefill_work(s.plan(), budget=4 * n)]
    assert work == [("a", 0, n), ("c", 0, n + 60)]  # b shares a's piece whole: it waits for its snapshot
