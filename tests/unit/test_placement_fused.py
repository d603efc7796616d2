"""router/placement.py FusedPabPolicy: the ``pab`` policy in one pass must answer exactly as the
filters -> scorer -> picker chain (``pab-chain``): same ordered candidates (cut to
``max_candidates``), same refusal reason, same RNG draws (seeded tie-breaks).

Hand-worked case: time model a = 10 ms, b = 0.1 ms/token, c = 0; horizon H = 450 ms.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from replica_agent.policy.pab import ClassBudget, fits
from replica_agent.policy.time_model import TimeModel
from router.budgets import BudgetBook
from router.placement import (
    DEFAULT_MAX_CANDIDATES,
    FusedPabPolicy,
    HeadroomScorer,
    KvHeadroomScorer,
    PlacementRequest,
    ReplicaView,
    default_registry,
)

TM = TimeModel(10.0, 0.1, 0.0)
H = 450.0
CLASSES = ("interactive", "batch")


def view(rid: str, pab_ms: float, pab_tokens: int, *, kv: int = 100_000, healthy: bool = True) -> ReplicaView:
    budget = ClassBudget("interactive", H, pab_ms, pab_tokens, kv, ttft_ms=500.0, tpot_ms=50.0)
    return ReplicaView(rid, healthy, True, TM, {"interactive": budget})


# ---------------------------------------------------------------- hand-worked


def test_hand_worked_four_replicas() -> None:
    # P = 1000 tokens -> a + b*P = 10 + 0.1 * 1000 = 110 ms <= H, so the ordinary rule applies:
    #   r0: pab_ms 100, pab_tokens 900:  110 > 100                     -> does not fit
    #   r1: pab_ms 300, pab_tokens 800:  110 <= 300 but 1000 > 800 (KV) -> does not fit
    #   r2: pab_ms 250, pab_tokens 2400: 110 <= 250, 1000 <= 2400       -> fits, headroom (250-110)/450 = 0.3111
    #   r3: pab_ms 400, pab_tokens 3900: 110 <= 400, 1000 <= 3900       -> fits, headroom (400-110)/450 = 0.6444
    reps = [view("r0", 100.0, 900), view("r1", 300.0, 800), view("r2", 250.0, 2400), view("r3", 400.0, 3900)]
    req = PlacementRequest("interactive", 1000)
    assert [fits(1000, r.classes["interactive"], TM) for r in reps] == [False, False, True, True]
    scorer = HeadroomScorer()
    assert scorer.score(req, reps[2]) == pytest.approx(140.0 / 450.0)
    assert scorer.score(req, reps[3]) == pytest.approx(290.0 / 450.0)
    reg = default_registry()
    for seed in (None, 7):
        assert reg.build("pab", seed=seed).place(req, reps).candidates == ("r3", "r2")
        assert reg.build("pab-chain", seed=seed).place(req, reps).candidates == ("r3", "r2")
    # the best one excluded (already tried): r2 alone; one candidate asked for: r3 alone
    assert reg.build("pab").place(PlacementRequest("interactive", 1000, frozenset({"r3"})), reps).candidates == ("r2",)
    assert reg.build("pab", max_candidates=1).place(req, reps).candidates == ("r3",)
    # P = 2500 -> 260 ms: only r3 has the time (400 ms) and the tokens (3900)
    assert reg.build("pab").place(PlacementRequest("interactive", 2500), reps).candidates == ("r3",)
    # P = 5000 -> 510 ms > H: oversize, fits only where pab_ms == H (none here) -> refused by "fits"
    res = reg.build("pab").place(PlacementRequest("interactive", 5000), reps)
    assert res.candidates == () and res.reason == "fits"


def test_waited_ms_late_requests_keep_the_normal_fit() -> None:
    # P = 1000 -> 110 ms. r2: pab_ms 250, pab_tokens 2400; r3: pab_ms 400, pab_tokens 3900; H = 450.
    reps = [view("r2", 250.0, 2400), view("r3", 400.0, 3900)]
    reg = default_registry()
    # w = 100: headroom (pab - w - 110) / 450: r3 190/450, r2 40/450; both on time
    req = PlacementRequest("interactive", 1000, waited_ms=100.0)
    assert HeadroomScorer().score(req, reps[0]) == pytest.approx(40.0 / 450.0)
    assert HeadroomScorer().score(req, reps[1]) == pytest.approx(190.0 / 450.0)
    for name in ("pab", "pab-chain"):
        assert reg.build(name).place(req, reps).candidates == ("r3", "r2")
        assert reg.build(name).place(replace(req, on_time_only=True), reps).candidates == ("r3", "r2")
    # w = 200: on time only on r3 (250 - 200 = 50 < 110); the normal fit keeps both
    for name in ("pab", "pab-chain"):
        req = PlacementRequest("interactive", 1000, waited_ms=200.0)
        assert reg.build(name).place(replace(req, on_time_only=True), reps).candidates == ("r3",)
        assert reg.build(name).place(req, reps).candidates == ("r3", "r2")
    # w = 400: 110 > H - w = 50: late everywhere; on time nowhere (reason "on-time"), the normal
    # fit places it where a fresh arrival would go (not only on an idle replica)
    for name in ("pab", "pab-chain"):
        req = PlacementRequest("interactive", 1000, waited_ms=400.0)
        res = reg.build(name).place(replace(req, on_time_only=True), reps)
        assert res.candidates == () and res.reason == "on-time"
        assert reg.build(name).place(req, reps).candidates == ("r3", "r2")
    # negative waited_ms raises like fits()
    with pytest.raises(ValueError, match="waited_ms"):
        reg.build("pab").place(PlacementRequest("interactive", 1000, waited_ms=-1.0), reps)


def test_start_window_hand_worked() -> None:
    # window 2 steps of 1000 tokens: 2 * (10 + 0.1 * 1000) = 220 ms. P = 1000 -> b*P = 100 ms.
    #   r0: nothing pending                  -> passes (whatever the prompt)
    #   r1: 100 ms pending: 100 + 100 <= 220 -> passes
    #   r2: 150 ms pending: 150 + 100 > 220  -> out
    def pending(rid: str, inflight: float) -> ReplicaView:
        cb = ClassBudget("interactive", H, 400.0, 3900, 100_000, inflight_reservation_ms=inflight, kv_free_tokens=100_000)
        return ReplicaView(rid, True, True, TM, {"interactive": cb})

    reps = [pending("r0", 0.0), pending("r1", 100.0), pending("r2", 150.0)]
    req = PlacementRequest("interactive", 1000, window_steps=2, step_tokens=1000)
    reg = default_registry()
    for name in ("pab", "pab-chain"):
        assert sorted(reg.build(name, seed=1).place(req, reps).candidates) == ["r0", "r1"]
        res = reg.build(name).place(req, reps[2:])
        assert res.candidates == () and res.reason == "window"
        assert reg.build(name).place(replace(req, window_steps=0), reps[2:]).candidates == ("r2",)
    # a prompt longer than the window on its own starts where nothing is pending: 3000 -> 300 ms
    assert reg.build("pab").place(replace(req, prompt_tokens=3000), reps).candidates == ("r0",)


def test_kv_headroom_breaks_equal_time_headroom() -> None:
    # same time headroom; r1 has more KV left after the prompt: (50 000 - 1000) / 50 000 = 0.98
    # against (20 000 - 1000) / 50 000 = 0.38 -> r1 first, whatever the seed
    def kv_view(rid: str, kv_limited: int) -> ReplicaView:
        cb = ClassBudget("interactive", H, 400.0, 3900, kv_limited, kv_free_tokens=50_000)
        return ReplicaView(rid, True, True, TM, {"interactive": cb})

    reps = [kv_view("r0", 20_000), kv_view("r1", 50_000)]
    req = PlacementRequest("interactive", 1000)
    assert KvHeadroomScorer().score(req, reps[0]) == pytest.approx(0.38)
    assert KvHeadroomScorer().score(req, reps[1]) == pytest.approx(0.98)
    reg = default_registry()
    for seed in (None, 1, 2, 3):
        for name in ("pab", "pab-chain"):
            assert reg.build(name, seed=seed).place(req, reps).candidates == ("r1", "r0")


def test_oversize_prompt_takes_the_idle_replica() -> None:
    # P = 5000 -> 510 ms > H = 450: r1 is idle (pab_ms == H) with KV for 5000; r2 idle without the KV.
    reps = [view("r0", 449.0, 4390), view("r1", H, 4400), view("r2", H, 4400, kv=4000)]
    assert default_registry().build("pab").place(PlacementRequest("interactive", 5000), reps).candidates == ("r1",)


def test_refusal_reasons_match_chain() -> None:
    reg = default_registry()
    cases = [
        ([], "exclude"),
        ([view("r0", 400.0, 3900)], "exclude"),  # excluded below
        ([view("r1", 400.0, 3900, healthy=False)], "healthy"),
        ([ReplicaView("r2", True, False, TM, {})], "fresh"),
        ([ReplicaView("r3", True, True, None, {})], "fresh"),
        ([ReplicaView("r4", True, True, TM, {}, max_prompt_tokens=10)], "max-prompt"),
        ([view("r5", 50.0, 400)], "fits"),
    ]
    for reps, reason in cases:
        req = PlacementRequest("interactive", 1000, frozenset({"r0"}))
        assert reg.build("pab").place(req, reps).reason == reason
        assert reg.build("pab-chain").place(req, reps).reason == reason


def test_negative_prompt_raises_like_fits() -> None:
    with pytest.raises(ValueError, match="prompt_tokens"):
        default_registry().build("pab").place(PlacementRequest("interactive", -1), [view("r0", 400.0, 3900)])


def test_registry_and_parameters() -> None:
    reg = default_registry()
    policy = reg.build("pab")
    assert isinstance(policy, FusedPabPolicy) and policy.max_candidates == DEFAULT_MAX_CANDIDATES == 3
    assert [f.name for f in policy.filters] == ["exclude", "healthy", "fresh", "max-prompt", "fits", "on-time", "window"]
    assert [s.name for s, _ in policy.scorers] == ["headroom", "kv-headroom"]
    with pytest.raises(ValueError, match="max_candidates"):
        reg.build("pab", max_candidates=0)


def test_view_is_a_snapshot_of_the_book() -> None:
    class Clock:
        def now_ms(self) -> float:
            return 0.0

    class Snap:
        seq = 1
        coefficients = TM
        classes = [ClassBudget("interactive", H, 400.0, 3900, 100_000)]
        ttl_ms = 1000.0
        healthy = True
        max_prompt_tokens = 0
        status_detail = ""

    book = BudgetBook(Clock(), ["r0"])  # type: ignore[arg-type]
    book.update("r0", Snap())
    before = book.views(0.0)[0]
    book.take_local("r0", "interactive", 3000)  # 310 ms and 3000 tokens taken from the book's figures
    after = book.views(0.0)[0]
    assert before.classes["interactive"].pab_ms == 400.0 and after.classes["interactive"].pab_ms == pytest.approx(90.0)
    reg = default_registry()
    req = PlacementRequest("interactive", 1000)
    for v in (before, after):
        assert reg.build("pab").place(req, [v]) == reg.build("pab-chain").place(req, [v])


def test_review_cases_fused_equals_chain_to_the_last_bit() -> None:
    """Two inputs where the fused pass and the chain once parted (review of the cross-chunk term):
    the headroom computed as pab - w - (a + b*P) against (pab - w - a) - b*P, and the fit's price
    summed in another order."""
    reg = default_registry()
    # e = 0: r0 (a = 9.8626, PAB 296.905) and r1 (a = 0, PAB 287.0424) have the same headroom by hand,
    # 296.905 - 9.8626 - 126.7384 = 287.0424 - 0 - 126.7384 = 160.304 for a 1,744-token prompt (b = 0.0726711):
    # a tie, broken by id only if both sides round alike ((pab - a) - b*P; pab - (a + b*P) comes out one
    # ulp lower for r0, which then sorts after r1)
    a10, a0 = TimeModel(9.8626, 0.0726711, 0.0), TimeModel(0.0, 0.0726711, 0.0)
    views = [ReplicaView("r0", True, True, a10, {"interactive": ClassBudget("interactive", H, 296.905, 10_000, 100_000)}),
             ReplicaView("r1", True, True, a0, {"interactive": ClassBudget("interactive", H, 287.0424,
                                                                            10_000, 100_000)})]  # fmt: skip
    req = PlacementRequest("interactive", 1744)
    got = reg.build("pab", max_candidates=None).place(req, views)
    assert got == reg.build("pab-chain").place(req, views) and got.candidates == ("r0", "r1")
    # e > 0: a budget at the prompt's price to the last bit
    tm = TimeModel(1.0765989428688993, 0.0512275188342961, 0.0, 1e-5, chunk_tokens=871.6)
    one = [ReplicaView("r0", True, True, tm, {"interactive": ClassBudget("interactive", 900.0, 591.6956638940802,
                                                                          100_000, 100_000)})]  # fmt: skip
    req = PlacementRequest("interactive", 7144)
    assert reg.build("pab").place(req, one) == reg.build("pab-chain").place(req, one)


# ---------------------------------------------------------------- randomized equivalence


def random_view(rng: random.Random, rid: str) -> ReplicaView:
    """Mostly ordinary views, with many budgets, limits and flags right at the fit rule's edges."""
    tm = None
    if rng.random() > 0.05:
        tm = TimeModel(rng.choice([0.0, 10.0, 9.8626]), rng.choice([0.1, 0.0726711, 0.05]), 0.0)
        if rng.random() < 0.4:  # the online model's cross-chunk term (e over chunks of K)
            tm = TimeModel(tm.a_ms, tm.b_ms_per_new_token, 0.0, rng.choice([3.3e-6, 1e-5]),
                           chunk_tokens=rng.choice([0.0, 256.0, 871.6, 2048.0]))  # fmt: skip
    t = tm or TM
    classes = {}
    for name in CLASSES:
        if rng.random() < 0.15:
            continue
        h = rng.choices([450.0, 900.0, 0.0, -5.0, -1.0], weights=[10, 10, 1, 1, 3])[0]
        if h == -1.0:  # within 1e-9 of the prefill time of some prompt: the oversize edge
            h = t.prefill_ms(rng.randint(1000, 8000)) + rng.choice([-2e-9, -5e-10, 0.0, 5e-10])
        r = rng.random()
        if r < 0.15:
            pab = max(h, 0.0)  # idle: nothing reserved
        elif r < 0.3:
            pab = max(0.0, h - rng.choice([5e-10, 1e-9, 2e-9, 1e-6]))  # idle only within the 1e-9 tolerance
        elif r < 0.5:
            pab = rng.choice([100.0, 200.0, 300.0])  # equal budgets: ties
        elif r < 0.7:  # exactly (or within 1e-9 of) the prefill time of some prompt
            pab = max(0.0, t.prefill_ms(rng.randint(0, 5000)) + rng.choice([-2e-9, -5e-10, 0.0, 5e-10]))
        else:
            pab = rng.uniform(0.0, max(h, 1.0))
        kvl = rng.choice([100_000, rng.randint(0, 8000)])
        tokens = min(t.tokens_within_ms(pab) + rng.choice([0, 0, 5]), kvl) if rng.random() < 0.9 else rng.randint(0, 9000)
        inflight = rng.choice([0.0, 0.0, rng.uniform(0.0, 800.0)])
        classes[name] = ClassBudget(name, h, pab, tokens, kvl, inflight_reservation_ms=inflight,
                                    kv_free_tokens=rng.choice([0, kvl, kvl + rng.randint(0, 5000)]))
    mp = rng.choice([0, 0, 0, rng.randint(1, 9000)])
    if classes and rng.random() < 0.2:  # max prompt next to a token limit
        cb = rng.choice(list(classes.values()))
        mp = max(0, rng.choice([cb.pab_tokens, cb.kv_limited_tokens]) + rng.choice([-1, 0, 1]))
    return ReplicaView(rid, healthy=rng.random() > 0.1, fresh=rng.random() > 0.1, time_model=tm, classes=classes,
                       max_prompt_tokens=mp)  # fmt: skip


def random_prompt(rng: random.Random, reps: list[ReplicaView]) -> int:
    """A random prompt, often right at a view's edge (time, tokens, KV, horizon, max prompt) or past it."""
    if reps and rng.random() < 0.6:
        v = rng.choice(reps)
        cb = next(iter(v.classes.values()), None)
        if cb is not None:
            t = v.time_model or TM
            by_time = round((cb.pab_ms - t.a_ms) / t.b_ms_per_new_token)
            edge = rng.choice([cb.pab_tokens, cb.kv_limited_tokens, v.max_prompt_tokens, by_time,
                               t.tokens_within_ms(cb.horizon_ms)])  # fmt: skip
            return max(0, edge + rng.choice([-1, 0, 0, 1]))
    return rng.choice([0, 1, int(rng.lognormvariate(7.0, 1.2))])


def random_waited(rng: random.Random, reps: list[ReplicaView]) -> float:
    """Mostly 0 (fresh request), else random ages, often right where the budget or horizon minus
    the age meets some prompt's prefill time, and ages past the horizon."""
    r = rng.random()
    if r < 0.4:
        return 0.0
    if reps and r < 0.75:
        v = rng.choice(reps)
        cb = next(iter(v.classes.values()), None)
        if cb is not None:
            t = v.time_model or TM
            prefill = t.a_ms + t.b_ms_per_new_token * rng.randint(0, 5000)
            base = rng.choice([cb.pab_ms, cb.horizon_ms])
            return max(0.0, base - prefill + rng.choice([-2e-9, -5e-10, 0.0, 5e-10]))
    return rng.choice([rng.uniform(0.0, 500.0), rng.uniform(0.0, 2000.0), 1e-9, 1000.0])


@pytest.mark.parametrize("seed", [None, 1234])
def test_fused_equals_chain_on_random_fleets(seed: int | None) -> None:
    rng = random.Random(20240611 if seed is None else seed)
    reg = default_registry()
    ks = (1, 3, None)
    fused = {k: reg.build("pab", seed=seed, max_candidates=k) for k in ks}
    chains = {k: reg.build("pab-chain", seed=seed) for k in ks}  # one chain per fused policy: same RNG stream
    nonempty = 0
    for _ in range(600):
        n = rng.choice([0, 1, 2, 3, 5, 8, 16, 40])
        ids = [f"r{i}" for i in range(n)]
        rng.shuffle(ids)
        reps = [random_view(rng, rid) for rid in ids]
        for _ in range(4):
            cls = rng.choice(CLASSES + ("unknown",)) if rng.random() < 0.1 else rng.choice(CLASSES)
            exclude = frozenset(rid for rid in ids if rng.random() < 0.15)
            prompt = random_prompt(rng, reps)
            cached = {}  # prefix-aware requests: some replicas hold part (or more than all) of the prompt
            if rng.random() < 0.3:
                cached = {rid: rng.choice([0, rng.randint(1, prompt + 10)]) for rid in ids if rng.random() < 0.5}
            req = PlacementRequest(cls, prompt, exclude, random_waited(rng, reps),
                                   on_time_only=rng.random() < 0.3, window_steps=rng.choice([0, 0, 1, 4]),
                                   step_tokens=rng.choice([512, 2048]), cached_tokens=cached)
            for k in ks:
                want = chains[k].place(req, reps)
                got = fused[k].place(req, reps)
                assert got.candidates == want.candidates[:k], (req, k)
                assert got.reason == want.reason, (req, k)
                nonempty += bool(got.candidates)
                if seed is not None:
                    assert fused[k].picker.rng.getstate() == chains[k].picker.rng.getstate()  # type: ignore[attr-defined]
    assert nonempty > 1000  # the cases do place most of the time


def test_fused_place_chain_is_the_chain() -> None:
    rng = random.Random(5)
    reps = [random_view(rng, f"r{i}") for i in range(30)]
    policy = default_registry().build("pab", max_candidates=None)
    chain = default_registry().build("pab-chain")
    for p in (0, 100, 1000, 3000, 9000):
        req = PlacementRequest("interactive", p)
        assert policy.place_chain(req, reps) == chain.place(req, reps) == policy.place(req, reps)  # type: ignore[attr-defined]


@pytest.mark.parametrize("waited_ms", [0.0, 100.0, 0.3])
def test_fused_equals_chain_at_the_tolerance_edges(waited_ms: float) -> None:
    # Every combination of horizon, budget, token caps, KV, max prompt and prompt within a few 1e-9 ms
    # or one token of the edges of the fit rule, one view at a time; with an age w, the horizon and
    # budget are raised by w so that H - w and pab - w sit at the same edges.
    p0 = 4000
    pf = TM.a_ms + TM.b_ms_per_new_token * p0 + waited_ms  # prefill time of p0 tokens (ms), plus w
    reg = default_registry()
    fused, chain = reg.build("pab"), reg.build("pab-chain")
    checked = fitting = 0
    for h in (pf - 2e-9, pf - 5e-10, pf, pf + 5e-10, pf + 2e-9):
        for pab in (h, h - 5e-10, h - 2e-9, pf - 2e-9, pf - 5e-10, pf + 5e-10):
            for tokens in (p0 - 1, p0, p0 + 1):
                for kvl in (p0 - 1, p0, p0 + 1):
                    for mp in (0, p0 - 1, p0, p0 + 1):
                        v = ReplicaView("r0", True, True, TM, {"interactive": ClassBudget("interactive", h, pab, tokens, kvl)}, mp)
                        for p in (p0 - 1, p0, p0 + 1):
                            req = PlacementRequest("interactive", p, waited_ms=waited_ms)
                            got, want = fused.place(req, [v]), chain.place(req, [v])
                            assert got == want, (h, pab, tokens, kvl, mp, p)
                            checked += 1
                            fitting += bool(got.candidates)
    assert checked == 5 * 6 * 3 * 3 * 4 * 3 and 0 < fitting < checked
