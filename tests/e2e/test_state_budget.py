"""A small --max-state-gib: requests beyond the budget wait for pages instead of failing, lose no tokens,
and a request that could never fit gets a 400 with the numbers."""

from __future__ import annotations

import concurrent.futures as cf

import httpx

from tests.e2e.conftest import MODEL
from tests.e2e.test_api import metric

# Tiny model, fp32, page 64: 8 rows' fixed state is 393,216 B and one 320-position request's pages 57,344 B,
# so 0.00048 GiB (515,396 B) buys the pages of 2 max-length requests = 4 CSA pages: 4 short requests at once.
BUDGET_GIB = "0.00048"


def complete(url: str, prompt: list[int], n: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_budget_queues_instead_of_failing(start_server) -> None:
    srv = start_server("--max-state-gib", BUDGET_GIB, "--max-model-len", "320")
    budget = metric(srv, "dsv4_state_bytes_budget")
    assert 0 < budget <= float(BUDGET_GIB) * 2**30
    prompts = [[5 + i, 9, 13 + 2 * i, 200, 7] for i in range(8)]
    alone = [complete(srv.url, p, 24)["choices"][0]["text"] for p in prompts[:2]]
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: complete(srv.url, p, 24), prompts))
    for out in outs:
        assert out["usage"]["completion_tokens"] == 24
        assert out["choices"][0]["finish_reason"] == "length"
    assert [o["choices"][0]["text"] for o in outs[:2]] == alone
    # Never more than 4 rows in a step: the pages, not the 8 rows, bounded the batch.
    five_plus = metric(srv, "dsv4_decode_rows_per_step_count") - metric(
        srv, "dsv4_decode_rows_per_step_bucket", '{le="4.0"}'
    )
    assert five_plus == 0
    assert metric(srv, "dsv4_state_bytes_in_use") == 0


def test_never_fits_is_a_400(start_server) -> None:
    srv = start_server("--max-state-gib", BUDGET_GIB, "--max-model-len", "320")
    body = {"model": MODEL, "prompt": list(range(2, 300)), "max_tokens": 100}
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert "320" in err["message"] and "398" in err["message"]
    # n rows share a prompt but each holds its own pages: 2 rows of 300 positions fit the 4 CSA pages, 3 never do.
    body = {"model": MODEL, "prompt": list(range(2, 290)), "max_tokens": 10, "temperature": 0}
    assert httpx.post(f"{srv.url}/v1/completions", json={**body, "n": 2}, timeout=60).status_code == 200
    r = httpx.post(f"{srv.url}/v1/completions", json={**body, "n": 3}, timeout=30)
    assert r.status_code == 400 and "n = 3" in r.json()["error"]["message"], r.text
