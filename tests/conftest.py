"""Session-wide test set-up.

pytest-asyncio gives each test its own event loop, so without a held reference grpc.aio would shut
its poller thread down after every test that used gRPC, through a join that can hang (grpc/grpc PR
#40989); see :func:`fairbatch_common.runtime.hold_grpc_aio`. One poller for the session also keeps the
thread stacks that pytest-timeout prints on a hang free of that shutdown.
"""

from fairbatch_common.runtime import hold_grpc_aio

hold_grpc_aio()
