"""Session-wide test set-up.

pytest-asyncio gives each test its own event loop, so without a held reference grpc.aio would shut
its poller thread down after every test that used gRPC, through the join that can hang (CI once
waited there for the whole 120 s test timeout); see :func:`replica_agent.runtime.hold_grpc_aio`.
"""

from replica_agent.runtime import hold_grpc_aio

hold_grpc_aio()
