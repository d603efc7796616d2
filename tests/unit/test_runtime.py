"""fairbatch_common.runtime.hold_grpc_aio: grpc.aio's poller thread outlives every loop once held.

Run in a child interpreter: the test session itself already holds the reference (tests/conftest.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import asyncio, sys, threading
import grpc
from fairbatch_common.runtime import hold_grpc_aio

if sys.argv[1] == "hold":
    hold_grpc_aio()

async def serve_once() -> None:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    await asyncio.wait_for(channel.channel_ready(), 10)
    await channel.close()
    await server.stop(None)

import time

def pollers() -> int:
    return sum("_poll_wrapper" in t.name for t in threading.enumerate())

for _ in range(2):  # two loops, as two tests or a restart would use
    asyncio.run(serve_once())
    if sys.argv[1] == "plain":  # the joined thread may take a moment to end on a loaded machine: up to 10 s
        deadline = time.monotonic() + 10.0
        while pollers() and time.monotonic() < deadline:
            time.sleep(0.05)
    print(pollers())
"""


def pollers_after_each_loop(mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return [int(line) for line in out.stdout.split()]


def test_without_the_hold_grpc_shuts_its_poller_down_after_each_loop() -> None:
    # the shutdown path (a join from a destructor) runs after every loop
    assert pollers_after_each_loop("plain") == [0, 0]


def test_held_grpc_keeps_one_poller_across_loops() -> None:
    # one poller thread, never joined, and the second loop is still served through it
    assert pollers_after_each_loop("hold") == [1, 1]


LOOP_SCRIPT = """
import asyncio
from fairbatch_common.runtime import run

async def loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__

print(run(loop_module()))
"""


def test_event_loop_knob() -> None:
    """uvloop by default; FAIRBATCH_EVENT_LOOP=asyncio gives the standard library's loop."""
    def loop_of(env: dict[str, str]) -> str:
        out = subprocess.run([sys.executable, "-c", LOOP_SCRIPT], capture_output=True, text=True, timeout=60,
                             env={**os.environ, **env}, check=True)
        return out.stdout.strip()

    assert loop_of({"FAIRBATCH_EVENT_LOOP": ""}).startswith("uvloop")
    assert loop_of({"FAIRBATCH_EVENT_LOOP": "asyncio"}).startswith("asyncio")
