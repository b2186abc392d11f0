"""A rank killed mid-stream: in-flight requests fail UNAVAILABLE within 5 s, the scheduler
reports NOT_SERVING, and serves again once the supervisor has restarted the group; a rank
killed while idle turns the scheduler NOT_SERVING too."""

from __future__ import annotations

import asyncio
import time

import grpc

from pagedserve_client import Client
from services.common.grpc_utils import health_status
from tests.parallel.conftest import stream_in_background, wait_for


def test_killed_rank_fails_requests_then_group_restarts(tp2_stack):
    stack = tp2_stack
    restarts = stack.supervisor.restarts
    health = lambda: asyncio.run(health_status(stack.scheduler_address, 1.0))  # noqa: E731
    t, errors = stream_in_background(stack.address)
    stack.supervisor.procs[1].kill()  # not the driver: only its acknowledgement goes missing
    killed_at = time.monotonic()
    t.join(10)
    assert errors and errors[0][0] == grpc.StatusCode.UNAVAILABLE
    assert errors[0][1] - killed_at < 5, "in-flight request not failed within 5 s"
    wait_for(lambda: health() == "NOT_SERVING", 5, "scheduler NOT_SERVING")

    wait_for(lambda: health() == "SERVING", 60, "scheduler serving again")
    assert stack.supervisor.restarts == restarts + 1
    with Client(stack.address) as c:
        r = c.generate(prompt_token_ids=[5, 6, 7], max_tokens=4, ignore_eos=True)
    assert r.usage.completion_tokens == 4

    # Now the driver, while idle: the scheduler notices without a request.
    stack.supervisor.procs[0].kill()
    wait_for(lambda: health() == "NOT_SERVING", 5, "scheduler NOT_SERVING (idle)")
    wait_for(lambda: health() == "SERVING", 60, "scheduler serving again")
    assert stack.supervisor.restarts == restarts + 2
