"""Per-request state on this replica, fed by the proxy's events (PURE: time passed in as ``now_ms``).

Lifecycle (docs/architecture.md "Agent"): ``prefill`` (arrived, no token yet; counts in PAB's
in-flight reservation with its prompt tokens) -> ``decode`` (first token seen; counts in the decode
reservation with its next-token deadline) -> removed at finish or abort. Deadlines follow the
latency envelope of FairBatching (arXiv 2510.14392; docs/design.md section 2) (:mod:`replica_agent.policy.envelope`):
``deadline(j) = arrival + ttft + j * tpot``.

Tokens out are counted per content-bearing chunk; the engine's final ``usage`` corrects the prompt
and completion counts (:meth:`Tracker.on_usage`).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from replica_agent.policy.engine_state import next_token_deadline
from replica_agent.policy.envelope import Envelope
from replica_agent.policy.pab import DecodeState, PendingPrefill


class Phase(enum.Enum):
    """Where a tracked request is."""

    PREFILL = "prefill"
    DECODE = "decode"


class TrackerFull(Exception):
    """Raised by :meth:`Tracker.on_arrival` when ``max_requests`` requests are tracked."""


@dataclass(slots=True)
class TrackedRequest:
    """One request on this replica.

    Attributes:
        request_id: tracker key (unique among tracked requests).
        slo_class: SLO class name.
        envelope: arrival, TTFT and TPOT targets (ms).
        prompt_tokens: prompt length (tokens; estimate until ``usage`` corrects it).
        max_tokens: requested output tokens, None when unknown.
        lease_id: the lease it consumed, "" when none.
        phase: prefill or decode.
        tokens_out: output tokens seen so far.
        computed_tokens: prompt tokens already in the KV cache (0 in proxy mode until decode).
        first_token_ms, last_token_ms: token times (ms), None before the first token.
        tracked_ms: when it reached the engine (ms; :meth:`Tracker.on_arrival`'s ``now_ms``).
    """

    request_id: str
    slo_class: str
    envelope: Envelope
    prompt_tokens: int
    max_tokens: int | None = None
    lease_id: str = ""
    phase: Phase = Phase.PREFILL
    tokens_out: int = 0
    computed_tokens: int = 0
    first_token_ms: float | None = None
    last_token_ms: float | None = None
    tracked_ms: float = 0.0
    # the DecodeState :meth:`Tracker.decodes` built from this request's fields, None when any of them
    # changed since (the tracker's events clear it: they are the only writers of a tracked request)
    decode_state: DecodeState | None = field(default=None, init=False, repr=False, compare=False)

    def next_deadline_ms(self) -> float:
        """Deadline (ms) of the next output token as PAB reserves for it in proxy mode: the later of
        the arrival-based envelope and the pace from the first token
        (replica_agent/policy/engine_state.py ``next_token_deadline``). A late first token is paced
        from itself (no catch-up reserved: it failed its TTFT); an early one keeps the envelope, as
        proxy mode always did. Plugin mode and the fleet simulation pace every decode from its
        first token; in proxy mode that stricter rule cost the demo 4 points of SLO attainment (more
        requests refused slo-infeasible at arrival), so it stays as it was there."""
        e = self.envelope
        envelope = e.deadline_ms(self.tokens_out)
        if self.first_token_ms is None:
            return envelope
        return max(envelope, next_token_deadline(e.arrival_ms, e.ttft_ms, e.tpot_ms, self.tokens_out,
                                                 self.first_token_ms))

    def slack_ms(self, now_ms: float) -> float:
        """Next token's deadline minus ``now_ms`` (ms); negative = behind its envelope."""
        return self.envelope.slack_ms(self.tokens_out, now_ms)

    @property
    def context_tokens(self) -> int:
        """Tokens in the KV cache once prefilled: prompt + tokens out."""
        return self.prompt_tokens + self.tokens_out


@dataclass(frozen=True, slots=True)
class FinishedRequest:
    """What remains of a request after finish or abort (for metrics and logs).

    Attributes:
        request: its final state.
        outcome: ``ok``, ``client_disconnect``, ``upstream_error``, ...
        end_ms: finish time (ms).
    """

    request: TrackedRequest
    outcome: str
    end_ms: float


@dataclass(slots=True)
class Tracker:
    """The requests on this replica, keyed by request id.

    Attributes:
        max_requests: bound on tracked requests (> 0).
        num_decodes: requests in decode (kept up to date by every event: O(1) per token).
        decode_context_tokens: their summed context (prompt + tokens out).
        num_prefills: requests in prefill.
        prefill_idle_since_ms: since when no request has been in prefill (ms); None while one is;
            -inf before any request.
        prefill_head_since_ms: since when the engine has served its head prefill, first come
            first served (ms): the arrival of a prefill at an idle replica, or the end of the
            previous one (the next starts); None while none is in prefill.
        finish_window_ms: the window of :meth:`finish_rate_per_s` (ms).
    """

    max_requests: int = 65536
    finish_window_ms: float = 5000.0
    _finished_at: deque[float] = field(default_factory=lambda: deque(maxlen=4096))
    _requests: dict[str, TrackedRequest] = field(default_factory=dict)
    num_decodes: int = 0
    decode_context_tokens: int = 0
    num_prefills: int = 0
    prefill_idle_since_ms: float | None = float("-inf")
    prefill_head_since_ms: float | None = None
    # change counters of the decode and prefill sets: the tuples :meth:`decodes` and
    # :meth:`prefills` last returned stay valid while their counter has not moved
    _decodes_gen: int = 0
    _prefills_gen: int = 0
    _decodes_cache: tuple[int, tuple[DecodeState, ...]] = (-1, ())
    _prefills_cache: tuple[int, tuple[PendingPrefill, ...]] = (-1, ())

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def get(self, request_id: str) -> TrackedRequest | None:
        """The tracked request, or None."""
        return self._requests.get(request_id)

    def on_arrival(
        self,
        request_id: str,
        slo_class: str,
        ttft_ms: float,
        tpot_ms: float,
        arrival_ms: float,
        prompt_tokens: int,
        max_tokens: int | None = None,
        lease_id: str = "",
        now_ms: float | None = None,
    ) -> TrackedRequest:
        """Start tracking a request in the prefill phase.

        Args:
            arrival_ms: arrival time (ms); the proxy passes now - router queue time.
            prompt_tokens: prompt length (tokens), >= 0.
            now_ms: when it reaches the engine (ms; default ``arrival_ms``).

        Raises:
            KeyError: if ``request_id`` is already tracked.
            TrackerFull: if ``max_requests`` requests are tracked.
            ValueError: on negative ``prompt_tokens``.
        """
        if request_id in self._requests:
            raise KeyError(f"request {request_id!r} already tracked")
        if len(self._requests) >= self.max_requests:
            raise TrackerFull(f"{len(self._requests)} requests tracked (max {self.max_requests})")
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        req = TrackedRequest(
            request_id=request_id,
            slo_class=slo_class,
            envelope=Envelope(arrival_ms, ttft_ms, tpot_ms),
            prompt_tokens=int(prompt_tokens),
            max_tokens=max_tokens if max_tokens and max_tokens > 0 else None,
            lease_id=lease_id,
            tracked_ms=arrival_ms if now_ms is None else now_ms,
        )
        self._requests[request_id] = req
        self._prefills_gen += 1
        if self.num_prefills == 0:
            self.prefill_head_since_ms = arrival_ms if now_ms is None else now_ms
        self.num_prefills += 1
        self.prefill_idle_since_ms = None
        return req

    def _leave_prefill(self, now_ms: float) -> None:
        self.num_prefills -= 1
        if self.num_prefills == 0:
            self.prefill_idle_since_ms = now_ms
            self.prefill_head_since_ms = None
        else:
            self.prefill_head_since_ms = now_ms

    def on_token(self, request_id: str, now_ms: float, n: int = 1) -> bool:
        """``n`` output tokens seen at ``now_ms``. Returns True when this was the first token
        (the request moved from prefill to decode). Unknown ids are ignored (False)."""
        req = self._requests.get(request_id)
        if req is None or n <= 0:
            return False
        first = req.phase is Phase.PREFILL
        if first:
            self._prefills_gen += 1
            req.phase = Phase.DECODE
            req.first_token_ms = now_ms
            req.computed_tokens = req.prompt_tokens
            self._leave_prefill(now_ms)
            self.num_decodes += 1
            self.decode_context_tokens += req.prompt_tokens
        req.tokens_out += n
        self.decode_context_tokens += n
        req.last_token_ms = now_ms
        req.decode_state = None
        self._decodes_gen += 1
        return first

    def on_usage(
        self, request_id: str, prompt_tokens: int | None = None, completion_tokens: int | None = None
    ) -> None:
        """Correct counts from the engine's ``usage`` (exact where chunks carried several tokens)."""
        req = self._requests.get(request_id)
        if req is None:
            return
        before = req.context_tokens
        if prompt_tokens is not None and prompt_tokens >= 0:
            req.prompt_tokens = int(prompt_tokens)
            if req.phase is Phase.DECODE:
                req.computed_tokens = req.prompt_tokens
        if completion_tokens is not None and completion_tokens >= 0:
            req.tokens_out = int(completion_tokens)
        if req.phase is Phase.DECODE:
            self.decode_context_tokens += req.context_tokens - before
            req.decode_state = None
            self._decodes_gen += 1
        else:
            self._prefills_gen += 1

    def on_finish(self, request_id: str, now_ms: float, outcome: str = "ok") -> FinishedRequest | None:
        """Stop tracking (finished or aborted); None when unknown."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self._finished_at.append(now_ms)
        if req.phase is Phase.PREFILL:
            self._prefills_gen += 1
            self._leave_prefill(now_ms)
        else:
            self._decodes_gen += 1
            self.num_decodes -= 1
            self.decode_context_tokens -= req.context_tokens
        return FinishedRequest(req, outcome, now_ms)

    def on_abort(self, request_id: str, now_ms: float, outcome: str = "aborted") -> FinishedRequest | None:
        """Same as :meth:`on_finish` with an abort outcome."""
        return self.on_finish(request_id, now_ms, outcome)

    def finish_rate_per_s(self, now_ms: float) -> float | None:
        """Requests that left this replica (finished or aborted: each freed a sequence slot) per second
        over the last ``finish_window_ms``; None with fewer than 2 in the window (no rate to trust).
        Read by PAB's slot wait (replica_agent/policy/pab.py "Sequence slots")."""
        cut = now_ms - self.finish_window_ms
        q = self._finished_at
        while q and q[0] < cut:
            q.popleft()
        if len(q) < 2:
            return None
        return 1000.0 * len(q) / self.finish_window_ms

    def decodes(self) -> tuple[DecodeState, ...]:
        """Running decodes as PAB inputs, in arrival order.

        Kept between calls: the tuple is rebuilt only after a decode changed (first token, token,
        usage, finish), and then each request's :class:`DecodeState` only when its own fields
        changed (the tracker's events clear ``TrackedRequest.decode_state``); equal to building
        every entry afresh (tests/unit/test_tracker.py)."""
        gen, cached = self._decodes_cache
        if gen == self._decodes_gen:
            return cached
        out = []
        for r in self._requests.values():
            if r.phase is Phase.DECODE:
                d = r.decode_state
                if d is None:
                    d = r.decode_state = DecodeState(
                        next_deadline_ms=r.next_deadline_ms(),
                        tpot_ms=r.envelope.tpot_ms,
                        context_tokens=r.context_tokens,
                        tokens_out=r.tokens_out,
                        max_tokens=r.max_tokens,
                    )
                out.append(d)
        result = tuple(out)
        self._decodes_cache = (self._decodes_gen, result)
        return result

    def prefill_keys(self) -> Iterator[str]:
        """Keys of the requests in prefill, in arrival order (the order of :meth:`prefills`)."""
        return (k for k, r in self._requests.items() if r.phase is Phase.PREFILL)

    def recent_prefills(self, since_ms: float) -> list[tuple[str, PendingPrefill]]:
        """(key, PAB input) of the requests still in prefill that reached the engine at or after
        ``since_ms`` (ms), newest first; walks back from the newest tracked request and stops at the
        first older one (arrival order is tracking order), so the cost is the recent requests only."""
        out: list[tuple[str, PendingPrefill]] = []
        for key in reversed(self._requests):
            r = self._requests[key]
            if r.tracked_ms < since_ms:
                break
            if r.phase is Phase.PREFILL:
                out.append((key, PendingPrefill(r.prompt_tokens, r.computed_tokens)))
        return out

    def prefills(self) -> tuple[PendingPrefill, ...]:
        """In-flight prefills (arrived, no token yet) as PAB inputs, in arrival order; kept between
        calls while no prefill arrived, ended or was corrected by ``usage``."""
        gen, cached = self._prefills_cache
        if gen == self._prefills_gen:
            return cached
        result = tuple(
            PendingPrefill(r.prompt_tokens, r.computed_tokens)
            for r in self._requests.values()
            if r.phase is Phase.PREFILL
        )
        self._prefills_cache = (self._prefills_gen, result)
        return result

    def counts(self) -> dict[str, int]:
        """Tracked requests per phase name (``prefill``, ``decode``)."""
        out = {p.value: 0 for p in Phase}
        for r in self._requests.values():
            out[r.phase.value] += 1
        return out

    def min_slack_ms(self, now_ms: float) -> float | None:
        """Smallest slack (ms) over tracked requests (prefills: against the first-token deadline); None if empty."""
        if not self._requests:
            return None
        return min(r.slack_ms(now_ms) for r in self._requests.values())
