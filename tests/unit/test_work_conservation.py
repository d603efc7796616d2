"""Property tests (hypothesis) of the admission core's work conservation (issue 18).

Invariant (router/admission_queue.py, :class:`Dispatcher`): after a wake-up's chain of passes
(``dispatch_chain``) that admitted nothing, no entry left in the queue fits any replica (placement's
own rule: PAB fit, KV, start window, exclusions), except the one replica held for an entry ahead of
it, and a sheddable entry fits none on time; the stall watchdog reads 0. Two and three classes (one
sheddable), and scan budgets far below the queue's length (chains of truncated passes, issue 25).
The admit function is the router's: the ``pab`` placement on the current views, then the local
take (router/budgets.py ``BudgetBook.take_local``); the budget book is random.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replica_agent.policy.pab import ClassBudget
from replica_agent.policy.time_model import TimeModel
from router.admission_queue import Attempt, Dispatcher, FifoQueue, WaitingRequest
from router.fair_queue import FairQueue, TenantShare
from router.placement import PlacementRequest, ReplicaView, default_registry

TM = TimeModel(10.0, 0.1, 0.0)
CLASSES = {"interactive": (450.0, 0), "batch": (18_000.0, 1)}  # horizon ms, band
THREE_CLASSES = {**CLASSES, "chat": (900.0, 0)}  # the third one sheddable (SHEDDABLE)
SHEDDABLE = {"chat"}
WINDOW_STEPS, STEP_TOKENS = 4.0, 2048


@dataclass
class Clock:
    t: float = 1000.0
    scale: float = 1.0

    def now_ms(self) -> float:
        return self.t

    def to_wall_s(self, ms: float) -> float:
        return ms / 1000.0


class Book:
    """A pure budget book: class budgets per replica, taken from as placement grants."""

    def __init__(self, replicas: dict[str, dict[str, ClassBudget]]) -> None:
        self.classes = replicas

    def views(self) -> list[ReplicaView]:
        return [ReplicaView(rid, True, True, TM, dict(c)) for rid, c in self.classes.items()]

    def take(self, rid: str, slo_class: str, p: int) -> None:
        for name, cb in list(self.classes[rid].items()):
            cost = TM.prefill_ms(p) if name == slo_class else TM.b_ms_per_new_token * p
            self.classes[rid][name] = replace(
                cb, pab_ms=max(0.0, cb.pab_ms - cost), pab_tokens=max(0, cb.pab_tokens - p),
                kv_limited_tokens=max(0, cb.kv_limited_tokens - p),
                inflight_reservation_ms=cb.inflight_reservation_ms + cost,
            )  # fmt: skip


def request(e: WaitingRequest, now: float, avoid: frozenset[str] = frozenset(), on_time_only: bool = False):
    return PlacementRequest(e.slo_class, e.prompt_tokens, e.exclude | avoid, e.waited_ms(now), on_time_only,
                            WINDOW_STEPS, STEP_TOKENS)  # fmt: skip


def class_budget(name: str, draw) -> ClassBudget:  # noqa: ANN001
    h, _ = THREE_CLASSES[name]
    inflight = draw(st.sampled_from([0.0, 0.0, 50.0, 300.0, 900.0]))
    decode = draw(st.sampled_from([0.0, 0.0, 100.0, 400.0]))
    pab = max(0.0, h - inflight - decode)
    kv_free = draw(st.sampled_from([0, 2_000, 20_000, 200_000]))
    kv_limited = max(0, kv_free - draw(st.sampled_from([0, 500, 5_000])))
    tokens = min(TM.tokens_within_ms(pab), kv_limited)
    return ClassBudget(name, h, pab, tokens, kv_limited, decode_reservation_ms=decode,
                       inflight_reservation_ms=inflight, kv_free_tokens=kv_free)  # fmt: skip


@st.composite
def scenario(draw):  # noqa: ANN001, ANN201
    n_rep = draw(st.integers(1, 4))
    classes = THREE_CLASSES if draw(st.booleans()) else CLASSES
    replicas = {f"r{i}": {name: class_budget(name, draw) for name in classes} for i in range(n_rep)}
    n = draw(st.integers(0, 80))
    entries = []
    for i in range(n):
        entries.append(dict(
            rid=f"q{i}",
            tenant=draw(st.sampled_from(["A", "B", "C"])),
            slo_class=draw(st.sampled_from(list(classes))),
            prompt=draw(st.sampled_from([1, 100, 1000, 3000, 4300, 6000, 20_000]) | st.integers(0, 30_000)),
            waited=draw(st.sampled_from([0.0, 100.0, 440.0, 2000.0, 30_000.0])),
            exclude=frozenset(r for r in replicas if draw(st.booleans()) and draw(st.booleans())),
        ))  # fmt: skip
    fair = draw(st.booleans())
    max_bypass = draw(st.sampled_from([0, 2, 8]))
    # 2-8: far fewer calls than entries, so chains of truncated passes (issue 25); 4096: one pass
    max_scan = draw(st.sampled_from([2, 3, 8, 100, 4096]))
    return replicas, entries, fair, max_bypass, max_scan


async def run_to_fixpoint(replicas, entries, fair, max_bypass, max_scan):  # noqa: ANN001, ANN201
    clock = Clock()
    book = Book(replicas)
    policy = default_registry().build("pab", seed=0)
    granted: dict[str, str] = {}
    if fair:
        queue = FairQueue(10_000, 10**9, {"A": TenantShare(3.0, 0), "B": TenantShare(1.0, 0),
                                          "C": TenantShare(1.0, 1)})  # fmt: skip
    else:
        queue = FifoQueue(10_000, 10**9)
    loop = asyncio.get_running_loop()
    for e in entries:
        horizon, band = THREE_CLASSES[e["slo_class"]]
        arrival = clock.t - e["waited"]
        w = WaitingRequest(e["rid"], e["tenant"], e["slo_class"], e["prompt"], 16, clock.t, 10**12,
                           loop.create_future(), exclude=e["exclude"], priority=band, arrival_ms=arrival,
                           first_token_deadline_ms=arrival + horizon,  # margin 0: ttft = horizon
                           sheddable=e["slo_class"] in SHEDDABLE)  # fmt: skip
        queue.push(w)

    async def admit(entry: WaitingRequest, attempt: Attempt) -> str | None:
        res = policy.place(request(entry, clock.t, attempt.avoid, attempt.on_time_only), book.views())
        if not res.candidates:
            return None
        rid = res.candidates[0]
        book.take(rid, entry.slo_class, entry.prompt_tokens)
        granted[entry.request_id] = rid
        return rid

    async def orphan(g: str) -> None:
        raise AssertionError("no waiter leaves in this test")

    def hold_for(entry: WaitingRequest) -> str | None:
        usable = sorted(r for r in book.classes if r not in entry.exclude)
        return usable[0] if usable else None

    def probe(entry: WaitingRequest, attempt: Attempt) -> bool:
        return bool(policy.place(request(entry, clock.t, attempt.avoid, attempt.on_time_only), book.views()).candidates)

    d = Dispatcher(queue, clock, admit, orphan, max_bypass=max_bypass, max_scan=max_scan,  # type: ignore[arg-type]
                   hold_for=hold_for, skip_dominated=True, probe=probe)
    for _ in range(len(entries) + 5):  # each wake-up (chain) but the last admits one at least
        stats = await d.dispatch_chain()
        if stats.admitted == 0:
            break
    else:
        raise AssertionError("the dispatcher did not reach a fixpoint")
    # the watchdog agrees: nothing placeable is left, so no stall
    assert not stats.stalled and d.stalled_ms(clock.t) == 0.0
    return clock, book, queue, d, granted, policy


@pytest.mark.timeout(900)  # 300 examples, CPU-bound: ~20 s idle, past 120 s beside a parallel make test
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_no_queued_request_fits_a_replica_it_may_use(sc) -> None:  # noqa: ANN001
    clock, book, queue, d, granted, _ = asyncio.run(run_to_fixpoint(*sc))
    chain = default_registry().build("pab-chain")
    hold = d.hold
    behind_holder = False
    for e in queue.ordered(clock.t):
        avoid = frozenset((hold[1],)) if hold is not None and behind_holder else frozenset()
        # a sheddable entry is only ever placed on time (phase 1), never late
        res = chain.place(request(e, clock.t, avoid, on_time_only=e.sheddable), book.views())
        assert res.candidates == (), (e.request_id, e.prompt_tokens, e.slo_class, res)
        if hold is not None and e is hold[0]:
            behind_holder = True
    # every grant went to a replica the entry may use
    by_id = {e["rid"]: e for e in sc[1]}
    assert all(rid not in by_id[q]["exclude"] for q, rid in granted.items())


@pytest.mark.timeout(900)  # as above
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_a_single_entry_never_stops_the_others(sc) -> None:  # noqa: ANN001
    """Whatever the first entry is, every later entry that fits a replica it may use on the
    budget left by the pass is admitted: the queue is never held for it (at most one replica is)."""
    replicas, entries, fair, max_bypass, max_scan = sc
    blocker = dict(rid="blocker", tenant="A", slo_class="interactive", prompt=10**6, waited=0.0,
                   exclude=frozenset())  # fits nowhere: longer than every KV
    clock, book, queue, d, granted, _ = asyncio.run(run_to_fixpoint(replicas, [blocker, *entries], False,
                                                                    max_bypass, max_scan))
    assert "blocker" not in granted
    hold = d.hold
    assert hold is None or hold[0].request_id == "blocker"
    chain = default_registry().build("pab-chain")
    held = frozenset((hold[1],)) if hold is not None else frozenset()
    for e in queue.ordered(clock.t):
        if e.request_id != "blocker":
            assert chain.place(request(e, clock.t, held, on_time_only=e.sheddable), book.views()).candidates == ()
