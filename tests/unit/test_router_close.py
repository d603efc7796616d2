"""Router.close() stops the dispatcher even when a wake-up races the cancellation.

A release or budget update wakes the dispatcher while the router shuts down: before
fairbatch_common.aio.wait_event, the dispatcher's asyncio.wait_for swallowed the cancellation on
Python 3.11 and close() waited for it forever (seen as a 120 s teardown hang in CI).
"""

from __future__ import annotations

import asyncio

from fairbatch_common.clock import Clock
from router.auth import hash_api_key
from router.config import RouterConfig
from router.server import Router


async def test_close_after_a_wake_in_the_same_iteration() -> None:
    config = RouterConfig.model_validate({
        "slo_classes": {"interactive": {"ttft_ms": 500, "tpot_ms": 50, "max_queue_ms": 1000}},
        "tenants": {"acme": {"weight": 1, "slo_class": "interactive"}},
        "api_keys": {hash_api_key("k"): "acme"},
        "replicas": [{"id": "r0", "http_url": "http://127.0.0.1:1", "grpc_target": "127.0.0.1:1"}],
    })  # fmt: skip
    router = Router(config, Clock(1.0), "test-router")
    for _ in range(5):  # the race every time: wake, then close() cancels in the same loop iteration
        await router.start()
        for _ in range(3):
            await asyncio.sleep(0)  # the dispatcher is parked, waiting for a wake-up
        dispatcher = router._dispatch_task  # noqa: SLF001 - the task under test
        assert dispatcher is not None and not dispatcher.done()
        router.dispatcher.wake()
        closing = asyncio.ensure_future(router.close())
        done, _ = await asyncio.wait([closing], timeout=2.0)  # asyncio.wait: no cancellation of close()
        assert done, "Router.close() did not return: the dispatcher kept running after its cancellation"
        assert dispatcher.cancelled()
