"""Session-wide test set-up.

grpc.aio keeps one completion-queue poller thread per process and shuts it down whenever the last
aio channel or server is freed, i.e. after every test here (pytest-asyncio gives each test its own
event loop). That shutdown joins the poller thread in a loop, from a destructor, and can wait forever
when the poller is blocked writing its wake-up byte to a socket that no loop reads any more
(grpc/grpc PR #40989; issue #22365: hold a reference from the main thread). CI once hung there for
the whole 120 s test timeout. Holding one reference for the session keeps a single poller thread
alive; every test's loop binds to it as before.
"""

from grpc.experimental import aio as _grpc_aio

_grpc_aio.init_grpc_aio()
