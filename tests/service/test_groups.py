"""The scheduler's n > 1 groups (admitted together, the followers wait for the leader's prompt, then fork) and
max_tokens = 0 (prompt logprobs only); driven with test_scheduler's admission ledger."""

from __future__ import annotations

from dsv4_serve.service.engine.request import FinishReason, PromptLogprob, Request, RequestStatus
from dsv4_serve.service.engine.scheduler import needs_sample
from tests.service.test_scheduler import Ledger, make, req


def group(rid: str, n: int, n_prompt: int = 5, **params) -> Request:
    rows = [req(f"{rid}-{j}", n_prompt, **params) for j in range(n)]
    rows[0].followers = rows[1:]
    return rows[0]


def test_group_admitted_together_or_not_at_all() -> None:
    s, led = make(Ledger(slots=3))
    s.add(req("a"))
    s.add(group("g", 3))
    s.plan()
    assert [r.request_id for r in s.running] == ["a"] and s.num_waiting == 1 and len(led.live) == 1
    assert led.released == [2, 3]  # the two rows that fitted were given back: all or none
    s.abort("a")
    plan = s.plan()
    assert [r.request_id for r in s.running] == ["g-0", "g-1", "g-2"]
    assert [r.request_id for r in plan] == ["g-0"]  # the followers wait for the fork


def test_fork_after_the_prompt_copies_and_joins_the_plan() -> None:
    s, _ = make()
    s.add(group("g", 3, n_prompt=5, prompt_logprobs=0))
    plan = s.plan()
    lead = plan[0]
    s.prefilled(lead, 2)
    assert s.fork(plan, lambda *a: None)[0] == plan  # prompt not fed yet: no fork
    ev = s.scored(lead, [PromptLogprob(-1.0, 1), PromptLogprob(-2.0, 3)])
    assert ev.prompt_logprobs[1].rank == 3
    s.prefilled(lead, 2)  # fed 4 of 5: the last goes through the step
    copies = []
    plan, events = s.fork(plan, lambda src, dst, n: copies.append((src, dst, n)))
    assert [r.request_id for r in plan] == ["g-0", "g-1", "g-2"] and all(r.fed == 4 for r in plan)
    assert copies == [(s.handles["g-0"], s.handles[f"g-{j}"], 4) for j in (1, 2)]
    assert [(e.request_id, len(e.prompt_logprobs)) for e in events] == [("g-1", 2), ("g-2", 2)]
    assert [f for f in (s.feeds(plan))] == [(s.handles[f"g-{j}"], 14, 4) for j in range(3)]
    assert all(needs_sample(r) for r in plan)
    events = s.on_step({f"g-{j}": (7 + j, None, ()) for j in range(3)})
    assert [(e.request_id, e.token_id) for e in events] == [("g-0", 7), ("g-1", 8), ("g-2", 9)]
    assert len(s.plan()) == 3  # independent rows now


def test_leader_abort_or_failure_ends_unforked_followers() -> None:
    s, led = make()
    s.add(group("g", 3))
    s.plan()
    events = s.abort_group("g-0")
    assert {e.request_id for e in events} == {"g-0", "g-1", "g-2"}
    assert all(e.finish_reason is FinishReason.ABORT for e in events) and not led.live and not s.has_work()
    s.add(group("h", 2))
    s.plan()
    events = s.fail(["h-0"], "boom")
    assert [(e.request_id, e.error) for e in events] == [("h-0", "boom"), ("h-1", "boom")] and not led.live
    s.add(group("w", 2))  # still waiting: aborting the leader drops the follower with it
    s.waiting[0].followers[0].status = RequestStatus.WAITING
    assert {e.request_id for e in s.abort_group("w-0")} == {"w-0", "w-1"} and not s.has_work()


def test_failed_copy_fails_the_group_only() -> None:
    s, led = make()
    s.add(req("other"))
    s.add(group("g", 2, n_prompt=1))

    def copy(*_):
        raise RuntimeError("no")

    plan, events = s.fork(s.plan(), copy)
    assert [r.request_id for r in plan] == ["other"]
    assert {e.request_id for e in events} == {"g-0", "g-1"} and all(e.error for e in events)
    assert len(led.live) == 1


def test_max_tokens_zero_ends_when_the_prompt_is_fed() -> None:
    s, led = make()
    s.add(req("z", 4, max_tokens=0, prompt_logprobs=0))
    s.add(req("one", 1, max_tokens=0, prompt_logprobs=0))
    plan = s.plan()
    s.prefilled(plan[0], 3)
    plan, events = s.finish_scored(plan)
    assert plan == [] and {(e.request_id, e.finish_reason) for e in events} == {
        ("z", FinishReason.LENGTH), ("one", FinishReason.LENGTH)}  # fmt: skip
    assert not led.live and s.on_step({}) == []
