"""What PAB loses when the agent sees no per-token progress of non-stream requests.

One replica (the demo's: llama-3-8b-a100, vllm serve's A100 defaults, vLLM's default policy)
replays a window of a trace on a virtual clock (loadgen/sim/virtual.py), which gives every request's
arrival and token times. At every sample instant (every ``--sample-ms`` simulated ms) the agent's
tracker is rebuilt from those times twice, as proxy mode would see the same requests:

- ``stream``: prefill from arrival to the first token, then a decode with its tokens so far;
- ``whole`` (non-stream relayed as is): prefill from arrival to the answer (the last token),
  holding its prompt's in-flight reservation the whole time, never a decode.

The KV free figure is the engine's truth at that instant (the same in both). PAB per class is the
agent's own code (replica_agent/policy/pab.py). Printed: mean PAB_ms and PAB_tokens per class, the
share of instants with PAB_tokens = 0 (the replica takes no new prompt), the share at which a
median-length prompt of the trace fits (``pab.fits``), and the mean over instants of
(PAB_tokens stream - PAB_tokens whole). Writes JSON with ``--out``.

Run: ``.venv/bin/python scripts/measure_nonstream_pab.py --trace azure-conv --rate 1.75 --duration-s 120``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from loadgen.sim.engine import EngineConfig, SimEngine
from loadgen.sim.virtual import VirtualRequest, run_virtual
from loadgen.traces import load_trace, resolve_trace, select
from replica_agent.policy.batching import PolicyConfig, make_policy
from replica_agent.policy.pab import ReplicaState, SloClass, compute_budgets, fits
from replica_agent.policy.profiles import load_profile, vllm_serve_batch_defaults
from replica_agent.tracker import Tracker


def is_whole(i: int, share: float) -> bool:
    """Request i is non-stream for a ``share`` of the requests, evenly spread (share 0.5: every other one)."""
    return int((i + 1) * share) > int(i * share)


def tracker_at(records, t: float, mode: str, cls: SloClass, share: float = 1.0) -> Tracker:
    """The proxy-mode tracker at instant ``t`` (simulated ms) under ``mode`` (``stream`` | ``whole``;
    under ``whole`` only a ``share`` of the requests is non-stream, the others stream)."""
    tr = Tracker()
    for i, rec in enumerate(records):
        req, times = rec.request, rec.token_times_ms
        if rec.rejected or req.arrival_ms > t or not times or times[-1] <= t:
            continue  # not arrived, refused, or finished by t
        tr.on_arrival(req.request_id, cls.name, cls.ttft_ms, cls.tpot_ms, req.arrival_ms, req.prompt_tokens,
                      req.output_tokens)  # fmt: skip
        if mode == "stream" or not is_whole(i, share):
            seen = [x for x in times if x <= t]
            for x in seen:
                tr.on_token(req.request_id, x, 1)
    return tr


def kv_used_at(records, t: float) -> int:
    """KV tokens held at ``t``: prompt + tokens out of every request admitted and not finished
    (a prefill's whole prompt once it arrived; block rounding ignored)."""
    used = 0
    for rec in records:
        req, times = rec.request, rec.token_times_ms
        if rec.rejected or req.arrival_ms > t or not times or times[-1] <= t:
            continue
        used += req.prompt_tokens + sum(1 for x in times if x <= t)
    return used


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default="azure-conv")
    ap.add_argument("--rate", type=float, default=1.75, help="trace rate scale (1.75 = the demo's x7 over 4 replicas)")
    ap.add_argument("--duration-s", type=float, default=120.0, help="seconds of trace replayed")
    ap.add_argument("--sample-ms", type=float, default=50.0)
    ap.add_argument("--profile", default="llama-3-8b-a100")
    ap.add_argument("--whole-share", type=float, default=1.0, help="share of the requests sent non-stream (0..1)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    profile = load_profile(args.profile)
    batch = vllm_serve_batch_defaults(profile.gpu).resolve(None, None)
    engine = SimEngine(
        EngineConfig(time_model=profile.time_model, num_gpu_blocks=profile.kv_capacity_tokens // 16, block_size=16,
                     max_num_batched_tokens=batch.max_num_batched_tokens, max_num_seqs=batch.max_num_seqs),
        make_policy("vllm-default", PolicyConfig(500.0, 50.0)),
    )  # fmt: skip
    trace = select(load_trace(resolve_trace(args.trace)), args.duration_s, args.rate)
    reqs = [VirtualRequest(f"q{i}", r.arrival_ms, max(1, r.prompt_tokens), max(1, r.output_tokens))
            for i, r in enumerate(trace)]  # fmt: skip
    run = run_virtual(reqs, engine)
    records = run.records
    classes = [SloClass("interactive", 500.0, 50.0), SloClass("test-fleet", 1000.0, 100.0)]
    median_prompt = int(statistics.median(r.prompt_tokens for r in reqs))
    tm = profile.time_model
    capacity = profile.kv_capacity_tokens
    end = max((rec.token_times_ms[-1] for rec in records if rec.token_times_ms), default=0.0)
    result: dict[str, object] = {"trace": args.trace, "rate": args.rate, "duration_s": args.duration_s,
                                 "whole_share": args.whole_share,
                                 "requests": len(reqs), "median_prompt_tokens": median_prompt, "classes": {}}  # fmt: skip
    print(f"{args.trace} x{args.rate} for {args.duration_s:g} s: {len(reqs)} requests on one {args.profile} replica; "
          f"median prompt {median_prompt} tokens; sampled every {args.sample_ms:g} ms; "
          f"'whole' = {args.whole_share:.0%} of the requests non-stream")  # fmt: skip
    for cls in classes:
        rows: dict[str, dict[str, list[float]]] = {m: {"ms": [], "tok": [], "zero": [], "fits": []} for m in ("stream", "whole")}
        diffs: list[float] = []
        t = args.sample_ms
        while t < end:
            kv_free = max(0, capacity - kv_used_at(records, t))
            per_mode = {}
            for mode in ("stream", "whole"):
                tr = tracker_at(records, t, mode, cls, args.whole_share)
                if len(tr) == 0:
                    break
                state = ReplicaState(now_ms=t, decodes=tr.decodes(), prefills=tr.prefills(), kv_free_tokens=kv_free,
                                     time_model=tm, margin_frac=0.1)  # fmt: skip
                b = compute_budgets(state, [cls])[cls.name]
                per_mode[mode] = b
                rows[mode]["ms"].append(b.pab_ms)
                rows[mode]["tok"].append(b.pab_tokens)
                rows[mode]["zero"].append(1.0 if b.pab_tokens == 0 else 0.0)
                rows[mode]["fits"].append(1.0 if fits(median_prompt, b, tm) else 0.0)
            if len(per_mode) == 2:
                diffs.append(per_mode["stream"].pab_tokens - per_mode["whole"].pab_tokens)
            t += args.sample_ms
        out = {m: {"mean_pab_ms": statistics.fmean(v["ms"]), "mean_pab_tokens": statistics.fmean(v["tok"]),
                   "closed_share": statistics.fmean(v["zero"]), "median_prompt_fits_share": statistics.fmean(v["fits"])}
               for m, v in rows.items()}  # fmt: skip
        out["mean_tokens_lost"] = statistics.fmean(diffs) if diffs else 0.0
        out["instants"] = len(diffs)
        result["classes"][cls.name] = out  # type: ignore[index]
        print(f"class {cls.name} (TTFT {cls.ttft_ms:g} / TPOT {cls.tpot_ms:g} ms), {len(diffs)} busy instants:")
        for m in ("stream", "whole"):
            o = out[m]
            print(f"  {m:6s}: PAB {o['mean_pab_ms']:6.1f} ms, {o['mean_pab_tokens']:7.0f} tokens; closed {o['closed_share']:6.1%}; "
                  f"a {median_prompt}-token prompt fits {o['median_prompt_fits_share']:6.1%}")  # fmt: skip
        print(f"  whole loses {out['mean_tokens_lost']:.0f} PAB tokens on average")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
