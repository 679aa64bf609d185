"""connections.py's pieces without a server: the connection cap from the open-file limit, and the accept loop's
EMFILE line rate-limited (the server under `ulimit -n 1024` is tests/e2e/test_hostile_tenant.py)."""

from __future__ import annotations

import asyncio
import errno
import logging
import resource

import pytest

from dsv4_serve.service.api.connections import fd_connection_cap, quiet_accept_errors


@pytest.fixture
def nofile_1024():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"the hard open-file limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_cap_leaves_a_quarter_of_the_descriptors(nofile_1024) -> None:
    assert fd_connection_cap(None) == 1024 - 256
    assert fd_connection_cap(100) == 100
    with pytest.raises(ValueError, match="--max-connections 769 .* at most 768"):
        fd_connection_cap(769)


def test_emfile_on_accept_is_one_line_per_ten_seconds(caplog) -> None:
    loop = asyncio.new_event_loop()
    try:
        seen: list[str] = []
        loop.set_exception_handler(lambda _, ctx: seen.append(ctx["message"]))
        quiet_accept_errors(loop)
        emfile = {"message": "socket.accept() out of system resource", "exception": OSError(errno.EMFILE, "Too many")}
        with caplog.at_level(logging.ERROR, logger="dsv4.api"):
            for _ in range(10_000):
                loop.call_exception_handler(emfile)
            loop.call_exception_handler({"message": "something else"})
        lines = [r for r in caplog.records if "cannot accept connections" in r.getMessage()]
        assert len(lines) == 1 and "Too many" in lines[0].getMessage()
        assert seen == ["something else"]  # anything else still reaches the handler that was there
    finally:
        loop.close()
