"""Start and stop the child processes of a local fleet (engines, agents, routers) on loopback.

Used by ``fairbatch-loadgen demo`` and by the integration tests, so both start the real console
scripts the same way. Every wait is bounded; :meth:`ProcessGroup.stop` ends everything it started
(SIGTERM, then SIGKILL after a grace period), also when the caller is interrupted.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class PortPicker:
    """Hands out loopback TCP ports for child servers, each port at most once, outside the OS's ephemeral range.

    Why not ``bind(("127.0.0.1", 0))`` and pass that number on: the port is free only until the socket
    is closed. Until the child binds it, any outbound connection on the machine may be given the same
    port as its local port, since the OS picks both from the ephemeral range
    (``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 on Linux). A test fleet opens thousands
    of client connections, so an agent then failed with "Address already in use" (CI, session 3).
    Ports below that range are never handed to outbound connections; each one picked is checked free
    with a bind and never handed out twice by this picker.

    Attributes:
        low, high: inclusive port range to pick from.
        rng: random source (seeded per process, so concurrent test processes spread out).
    """

    low: int = 20000
    high: int = 32767
    rng: random.Random = field(default_factory=random.Random)
    _given: set[int] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def pick(self, host: str = "127.0.0.1", tries: int = 200) -> int:
        """A port on ``host`` that binds now and that this picker has not handed out before.

        Raises:
            RuntimeError: if ``tries`` random ports were all taken or handed out.
        """
        with self._lock:
            for _ in range(tries):
                port = self.rng.randint(self.low, self.high)
                if port in self._given:
                    continue
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    try:
                        s.bind((host, port))
                    except OSError:
                        continue
                self._given.add(port)
                return port
        raise RuntimeError(f"no free TCP port in {self.low}-{self.high} on {host} after {tries} tries")


def ephemeral_port_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int] | None:
    """The OS's ephemeral (outbound) port range as ``(low, high)``, or None where it cannot be read."""
    try:
        low, high = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def _default_picker() -> PortPicker:
    span = ephemeral_port_range()
    # the 10,000 ports just below the ephemeral range, when they all lie above the privileged ports (< 1024)
    if span is not None and span[0] > 11024:
        return PortPicker(low=span[0] - 10000, high=span[0] - 1)
    return PortPicker()


_PICKER = _default_picker()


def free_port() -> int:
    """A TCP port on 127.0.0.1 for a child server: free now, below the ephemeral range, unique in this process.

    See :class:`PortPicker` for why the OS's own ``bind(0)`` choice is not used.
    """
    return _PICKER.pick()


def script(name: str) -> list[str]:
    """Command prefix for one of our console scripts, run with the current interpreter.

    ``script("fairbatch-agent")`` -> ``[sys.executable, "-m", "replica_agent.cli"]``, so it works in
    a venv that is not on PATH.
    """
    modules = {
        "fairbatch-router": "router.cli",
        "fairbatch-agent": "replica_agent.cli",
        "fairbatch-loadgen": "loadgen.cli",
    }
    return [sys.executable, "-m", modules[name]]


@dataclass
class Child:
    """One started process with its log file."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, n_chars: int = 4000) -> str:
        """Last ``n_chars`` characters of the process's combined stdout/stderr."""
        try:
            return self.log_path.read_text(errors="replace")[-n_chars:]
        except OSError:
            return ""


@dataclass
class ProcessGroup:
    """Children started together and stopped together.

    Attributes:
        log_dir: folder for one ``<name>.log`` per child.
    """

    log_dir: Path
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        """Start ``argv`` with stdout/stderr to ``log_dir/<name>.log``."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - closed when the child is stopped
        full_env = dict(os.environ)
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        if env:
            full_env.update(env)
        popen = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=full_env, start_new_session=True
        )
        log.close()
        child = Child(name, popen, log_path)
        self.children.append(child)
        return child

    def wait_http_ok(self, child: Child, url: str, timeout_s: float = 30.0) -> None:
        """Poll ``url`` until it answers 200.

        Raises:
            RuntimeError: if the child exits first or ``timeout_s`` passes; the message holds its log tail.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if child.popen.poll() is not None:
                raise RuntimeError(
                    f"{child.name} exited with code {child.popen.returncode} before {url} was ready:\n{child.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{child.name} not ready at {url} after {timeout_s:.0f} s:\n{child.log_tail()}")

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every child (its whole process group), SIGKILL those still alive after ``grace_s``."""
        for c in reversed(self.children):
            if c.popen.poll() is None:
                try:
                    os.killpg(c.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for c in self.children:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                c.popen.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(c.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                c.popen.wait(timeout=5)
        self.children.clear()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
