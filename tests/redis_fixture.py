"""A private redis-server for the test session (``pytest.mark.redis`` tests).

Import the fixtures into a conftest or a test module::

    from tests.redis_fixture import redis_server  # noqa: F401

``redis_server`` starts ``redis-server --port N --save '' --appendonly no`` on a free loopback port
once per session and yields a :class:`RedisServer` that can also be stopped and restarted on the
same port (to test a Redis outage); ``redis_auth_server`` is another one started with
``--requirepass``. Tests using them are skipped, loudly, when no ``redis-server`` binary exists
(install: ``apt-get update && apt-get install -y redis-server``).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from loadgen.procs import free_port


@dataclass
class RedisServer:
    """One redis-server child process on 127.0.0.1:``port``."""

    binary: str
    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = field(default=None)
    password: str | None = None  # started with --requirepass when set

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start (or restart) the server and wait until it accepts connections."""
        if self.proc is not None and self.proc.poll() is None:
            return
        log = open(self.workdir / f"redis-{self.port}.log", "ab")  # noqa: SIM115 - lives with the child
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), *(["--requirepass", self.password] if self.password else [])],
            stdout=log, stderr=subprocess.STDOUT,
        )
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; see {log.name}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    if self._command(s, b"PING").startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("redis-server did not answer PING in time")

    def stop(self) -> None:
        """Kill the server (an outage: no clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def flush(self) -> None:
        """Delete every key (between tests)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as s:
            self._command(s, b"FLUSHALL")

    def _command(self, s: socket.socket, command: bytes) -> bytes:
        """Send ``command`` (after ``AUTH`` when the server has a password) and return its reply."""
        if self.password:
            s.sendall(b"AUTH " + self.password.encode() + b"\r\n")
            if not s.recv(16).startswith(b"+OK"):
                raise RuntimeError("redis-server refused the test password")
        s.sendall(command + b"\r\n")
        return s.recv(16)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A running private redis-server (skipped with the reason when the binary is missing)."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip(
            "redis-server NOT INSTALLED: the Redis ledger tests did not run "
            "(apt-get update && apt-get install -y redis-server)"
        )
    server = RedisServer(binary, free_port(), tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A second private redis-server started with ``--requirepass`` (its ``password``), for the
    authenticated ledger; skipped like :func:`redis_server` without the binary."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server NOT INSTALLED: the Redis password tests did not run "
                    "(apt-get update && apt-get install -y redis-server)")
    server = RedisServer(binary, free_port(), tmp_path_factory.mktemp("redis-auth"),
                         password="test-requirepass-5e1f0c2b9a")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_clean(redis_server: RedisServer) -> RedisServer:
    """The session server, running and empty."""
    redis_server.start()
    redis_server.flush()
    return redis_server
