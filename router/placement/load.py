"""What a baseline router knows about the replicas without PAB budgets: the load view the baseline
placement plugins read (router/placement/baselines.py). PURE (plain data, no I/O, no clock).

:class:`RouterLoad` is filled by whoever runs the policy:

- the router (router/core.py ``RouterCore``): ``outstanding`` and ``outstanding_tokens`` are the
  core's own per-replica counts of the requests it placed and has not seen end (exact, local to
  the router); ``scraped`` is refreshed from the agents' budget snapshots before each placement
  (``num_running``, ``num_waiting``, ``kv_usage`` of proto ``BudgetSnapshot``: the agent's latest
  scrape of the engine's ``/metrics``), see :meth:`RouterCore.refresh_load`;
- the fleet simulation (loadgen/fleet/sim.py): the same core counts; ``scraped`` from simulated
  scrapes every ``scrape_period_ms``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class MetricsSample:
    """One replica's engine metrics as of one scrape.

    Attributes:
        num_running: ``vllm:num_requests_running``.
        num_waiting: ``vllm:num_requests_waiting``.
        kv_usage: ``vllm:kv_cache_usage_perc`` (0..1).
        scraped_ms: when the sample reached the router (simulated ms, router clock).
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    scraped_ms: float = float("-inf")


@dataclass(slots=True)
class RouterLoad:
    """What one baseline router knows about the replicas (injected into its scorers).

    Attributes:
        outstanding: replica id -> requests this router sent there and has not seen end (a
            replica not listed: 0).
        scraped: replica id -> latest engine metrics (a replica not listed: never heard from).
        version: bumped on every change of ``scraped`` (scorers cache per version).
        outstanding_tokens: replica id -> prompt + requested output tokens of those requests.
        prompt_tokens: replica id -> whole prompt tokens of those requests (grant to end): the KV
            blocks a router counts as active there (``dynamo-kv``: ``/ block_size``).
        prefill_tokens: replica id -> uncached prompt tokens of those requests whose first token the
            router has not yet seen (grant to first token, or to the end when it never saw one:
            Dynamo's router-local active prefill tokens, llm-d's uncached tokens in flight).
    """

    outstanding: dict[str, int] = field(default_factory=dict)
    scraped: dict[str, MetricsSample] = field(default_factory=dict)
    version: int = 0
    outstanding_tokens: dict[str, int] = field(default_factory=dict)
    prompt_tokens: dict[str, int] = field(default_factory=dict)
    prefill_tokens: dict[str, int] = field(default_factory=dict)

    def add(self, replica_id: str, tokens: int) -> None:
        """One request (of ``tokens`` prompt + output tokens) sent to ``replica_id`` (``tokens`` < 0:
        one finished or refused there)."""
        self.outstanding[replica_id] = self.outstanding.get(replica_id, 0) + (1 if tokens >= 0 else -1)
        self.outstanding_tokens[replica_id] = self.outstanding_tokens.get(replica_id, 0) + tokens
