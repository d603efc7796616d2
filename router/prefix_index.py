"""The router's approximate map of which replica holds which prompt prefix (PURE: no I/O, no clock).

An engine with automatic prefix caching (vLLM's default) keeps the KV blocks of recent prompts
and reuses them for any later prompt that starts with the same tokens. The router cannot see the
engines' caches, so it keeps, per replica, the prefix keys of the prompts it sent there, in LRU
order with a capacity of about the replica's KV cache (the approach of llm-d's approximate
prefix-cache scorer and of the SGLang / vllm-router cache-aware policies, which learn from their
own routing decisions instead of asking the engines).

Keys are *chained*: key i stands for the whole prompt up to the end of block i (the way vLLM
hashes its blocks), so a match is the number of leading keys a replica holds.

Where keys come from:

- :func:`text_block_keys`: the live router has the prompt text but not its token ids
  (router/tokens.py only estimates the count), so it cuts the text into chunks of
  ``chunk_chars`` characters (default 64 characters, about 16 tokens at router/tokens.py's
  4 characters per token) and chains a hash of each; only whole chunks get a key. Two prompts
  with equal first ``k * chunk_chars`` characters tokenize to equal first tokens up to where a
  token straddles the chunk boundary, so the estimate is within about one chunk of the engine's
  own hit (llm-d's approximate scorer makes the same approximation).
- the fleet simulation passes chained ids of the trace's 512-token prefix blocks.

Estimated cached tokens on a replica: ``min(matched_keys * tokens_per_key, prompt_tokens - 1)``
(:meth:`PrefixIndex.cached_tokens`; an engine always computes the last prompt token).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DEFAULT_CHUNK_CHARS = 64
"""Characters per key of :func:`text_block_keys` (about 16 tokens, vLLM's default block size)."""


def text_block_keys(text: str, chunk_chars: int = DEFAULT_CHUNK_CHARS) -> list[int]:
    """Chained 64-bit keys of the whole ``chunk_chars``-character chunks of ``text`` (module docstring).

    Key i = the first 8 bytes of blake2b(key_{i-1} || chunk_i) (stable across processes, unlike
    ``hash`` of a str), so equal keys at i mean equal text up to the end of chunk i.

    Raises:
        ValueError: if ``chunk_chars`` < 1.
    """
    if chunk_chars < 1:
        raise ValueError(f"chunk_chars must be >= 1, got {chunk_chars}")
    keys = []
    prev = b""
    for i in range(len(text) // chunk_chars):
        prev = hashlib.blake2b(prev + text[i * chunk_chars:(i + 1) * chunk_chars].encode("utf-8", "surrogatepass"),
                               digest_size=8).digest()  # fmt: skip
        keys.append(int.from_bytes(prev, "big"))
    return keys


@dataclass(slots=True)
class PrefixIndex:
    """Per replica, an LRU set of chained prefix keys (module docstring).

    Attributes:
        capacity_keys: keys kept per replica (about its KV cache tokens / tokens per key), >= 1.
        tokens_per_key: prompt tokens one key stands for (the estimate's unit), >= 1.

    Raises:
        ValueError: if ``capacity_keys`` or ``tokens_per_key`` < 1.
    """

    capacity_keys: int
    tokens_per_key: int
    _lru: dict[str, OrderedDict[int, None]] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.capacity_keys < 1 or self.tokens_per_key < 1:
            raise ValueError(f"capacity_keys and tokens_per_key must be >= 1, got {self.capacity_keys}, "
                             f"{self.tokens_per_key}")  # fmt: skip

    def match(self, keys: Sequence[int], replica_ids: Iterable[str] | None = None) -> dict[str, int]:
        """Leading keys of ``keys`` each replica holds (replicas with none are left out).

        Args:
            keys: the prompt's chained keys, in order.
            replica_ids: the replicas to look at (default: every replica with keys).
        """
        if not keys:
            return {}
        lru = self._lru
        first = keys[0]
        alive = [r for r in (lru if replica_ids is None else replica_ids) if r in lru and first in lru[r]]
        out: dict[str, int] = {}
        depth = 1
        n = len(keys)
        while alive and depth < n:
            k = keys[depth]
            still = []
            for r in alive:
                if k in lru[r]:
                    still.append(r)
                else:
                    out[r] = depth
            alive = still
            depth += 1
        for r in alive:
            out[r] = depth
        return out

    def cached_tokens(self, keys: Sequence[int], prompt_tokens: int,
                      replica_ids: Iterable[str] | None = None) -> dict[str, int]:  # fmt: skip
        """Estimated cached prompt tokens per replica: ``min(matched * tokens_per_key, prompt_tokens - 1)``."""
        cap = max(0, prompt_tokens - 1)
        t = self.tokens_per_key
        return {r: min(m * t, cap) for r, m in self.match(keys, replica_ids).items()}

    def insert(self, replica_id: str, keys: Sequence[int]) -> None:
        """Record that ``replica_id`` now holds the prompt of ``keys`` (the post-decision update).

        Keys are touched last first, so the prompt's first key is the most recently used: a
        replica's shared leading blocks outlive their tails (the engine frees a request's blocks
        tail first too). Beyond ``capacity_keys`` the least recently used keys are dropped.
        """
        lru = self._lru.get(replica_id)
        if lru is None:
            lru = self._lru[replica_id] = OrderedDict()
        for k in reversed(keys):
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
        while len(lru) > self.capacity_keys:
            lru.popitem(last=False)

    def forget(self, replica_id: str) -> None:
        """Drop everything known about ``replica_id`` (it restarted or left)."""
        self._lru.pop(replica_id, None)

    def size(self, replica_id: str) -> int:
        """Keys held for ``replica_id``."""
        lru = self._lru.get(replica_id)
        return 0 if lru is None else len(lru)
