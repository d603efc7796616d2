"""The agent's drain, carried out (issue 29 item 3): the I/O shell around replica_agent/policy/drain.py.

:class:`Drainer` runs one drain per process: :meth:`Drainer.start` (SIGTERM, SIGINT, ``POST /drain``)
tells the agent to stop taking work (:meth:`~replica_agent.agent.Agent.start_drain`: its budget stream
says ``draining`` at once), then follows :func:`~replica_agent.policy.drain.drain_step` on the loop's
wall clock: wait for the requests in flight, up to the grace period; hand the rest over
(``hand_over``: the proxy ends each open stream with the hand-over event and answers each open
non-stream request 503, replica_agent/proxy.py ``Proxy.hand_over``); :attr:`Drainer.done` is set when
nothing is in flight any more (or the hand-over bound passed), and the CLI then exits 0.

HTTP (replica_agent/proxy.py): ``POST /drain`` starts it (the agent token required when one is set,
as for generation requests; ``?wait=1`` answers when the drain is done, for a preStop hook that must
block), ``GET /drain`` reports the state (open, like ``/health``): ``{"state": "serving" | "draining"
| "drained", "in_flight": n}``. ``fairbatch-agent drain`` is the client (replica_agent/cli.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from replica_agent.agent import Agent
from replica_agent.policy.drain import drain_step

log = logging.getLogger(__name__)


class Drainer:
    """One drain of an agent (module docstring).

    Args:
        agent: the agent (its :attr:`~replica_agent.agent.Agent.tracker` counts the requests in flight).
        hand_over: ends every open request at once (the proxy's ``hand_over``; returns how many).
        grace_s: wall seconds in-flight requests may run on before they are handed over (>= 0).
        handover_s: wall seconds after the hand-over before the drain ends anyway (>= 0).
    """

    def __init__(self, agent: Agent, hand_over: Callable[[], int], grace_s: float, handover_s: float = 5.0) -> None:
        if grace_s < 0 or handover_s < 0:
            raise ValueError("grace_s and handover_s must be >= 0")
        self._agent = agent
        self._hand_over = hand_over
        self.grace_s = grace_s
        self.handover_s = handover_s
        self.done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def state(self) -> str:
        """``serving`` (not told to drain), ``draining``, or ``drained`` (done: the process exits)."""
        if self.done.is_set():
            return "drained"
        return "draining" if self._task is not None else "serving"

    def in_flight(self) -> int:
        """Generation requests the agent is relaying now."""
        return len(self._agent.tracker)

    def start(self) -> bool:
        """Begin the drain (idempotent); True when this call began it. Call inside the running loop."""
        if self._task is not None:
            return False
        self._agent.start_drain()
        self._task = asyncio.get_running_loop().create_task(self._run(), name="drain")
        return True

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time() * 1000.0
        handed: float | None = None
        try:
            while True:
                now = loop.time() * 1000.0
                step = drain_step(started, now, self.in_flight(), self.grace_s * 1000.0, handed,
                                  self.handover_s * 1000.0)  # fmt: skip
                if step.action == "exit":
                    break
                if step.action == "hand_over":
                    handed = now
                    n = self._hand_over()
                    log.warning("drain: grace period (%g s) over; handed %d open request(s) over", self.grace_s, n)
                await asyncio.sleep(step.wait_ms / 1000.0)
            left = self.in_flight()
            if left:
                log.warning("drain: %d request(s) still open %g s after the hand-over; exiting", left, self.handover_s)
            else:
                log.info("drain complete: nothing in flight")
        finally:
            self.done.set()
