"""The router's OpenAI surface beyond generation: the model catalog, ``GET /v1/models[/{id}]``,
the relayed utility paths and the refused ones.

| path | what the router does |
| --- | --- |
| ``POST /v1/completions``, ``POST /v1/chat/completions`` | admitted (PAB lease, quotas, fair queue): router/server.py |
| ``GET /v1/models``, ``GET /v1/models/{id}`` | tenant auth, then served from the catalog: the union of the replicas' own ``/v1/models`` cards |
| ``POST /tokenize``, ``POST /detokenize`` | relayed to a healthy replica after tenant auth; no lease (no GPU work) |
| ``/v1/embeddings``, ``/v1/responses``, any other path | 404 ``unsupported_endpoint`` naming what is supported |

The catalog (:class:`ModelCatalog`) asks every replica's agent for ``/v1/models`` (relayed from
its engine: ``id``, ``root``, ``owned_by``, ``max_model_len``, ...) at most once per ``ttl_s`` wall
seconds, on demand; the first card seen for an id is kept. A request naming a model no replica
serves is refused with 404 ``model_not_found`` before any quota or lease is taken. While no replica
has answered yet, the catalog is unknown and nothing is refused on that ground.

A generation request never waits for a fetch while a catalog is known (:meth:`ModelCatalog.served_for`):
a catalog older than ``ttl_s`` is used as it is and refreshed in the background; only a model missing
from a catalog older than :data:`MISS_REFRESH_S` (one just deployed) waits for a fetch. Before, the
first request after each ``ttl_s`` waited for every replica's ``/v1/models``: 20-60 ms on a loaded
machine, once every 5 s (scripts/bench_backlog.py's ``infeasible`` scenario: the one slow refusal
of a run, 60.8 ms inside the router against 3-16 ms for the others).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable
from typing import Any

import aiohttp
from aiohttp import web

from fairbatch_common.openai_errors import MODEL_NOT_FOUND, error_body

SUPPORTED = ("POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /v1/models/{id}",
             "POST /tokenize", "POST /detokenize")  # fmt: skip
RELAYED_PATHS = ("/tokenize", "/detokenize")
REFUSED_PATHS = ("/v1/embeddings", "/v1/responses", "/v1/audio/transcriptions", "/v1/audio/translations",
                 "/v1/images/generations", "/v1/moderations", "/v1/files", "/v1/batches", "/v1/rerank", "/v1/score",
                 "/pooling", "/classify")  # fmt: skip
UNSUPPORTED_CODE = "unsupported_endpoint"
CATALOG_TTL_S = 5.0
FETCH_TIMEOUT_S = 2.0
MISS_REFRESH_S = 1.0
"""A request naming a model the catalog lacks waits for a fetch when the catalog is older than this (s)."""


def json_error(status: int, message: str, err_type: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> web.Response:  # fmt: skip
    """An error response in the vocabulary of fairbatch_common/openai_errors.py."""
    return web.Response(status=status, text=json.dumps(error_body(message, err_type, code, param)),
                        content_type="application/json")  # fmt: skip


def unsupported(method: str, path: str) -> web.Response:
    """404 for an OpenAI path the router does not serve, naming what it does."""
    return json_error(
        404, f"{method} {path} is not supported by fairbatch-router; supported: {', '.join(SUPPORTED)}.",
        code=UNSUPPORTED_CODE,
    )


def model_not_found(model: str, served: Iterable[str]) -> web.Response:
    """404 ``model_not_found`` (param ``model``), listing the served models."""
    names = ", ".join(sorted(served)) or "none"
    return json_error(404, f"The model `{model}` does not exist. Served models: {names}.", code=MODEL_NOT_FOUND,
                      param="model")  # fmt: skip


class ModelCatalog:
    """The models the replicas serve, from their ``/v1/models`` (see the module docstring).

    Args:
        session: returns the pooled HTTP session to the agents.
        replica_urls: returns the agents' HTTP base URLs now (discovery may change them).
        ttl_s: wall seconds a fetched catalog is reused.
        fallback_model: a name from the router's config, listed only while no replica answered.
        headers: sent with every fetch (the router-agent token, ``x-fairbatch-token``, when configured).
    """

    def __init__(self, session: Callable[[], aiohttp.ClientSession], replica_urls: Callable[[], list[str]],
                 ttl_s: float = CATALOG_TTL_S, fallback_model: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        self._headers = headers or None
        self._session = session
        self._urls = replica_urls
        self._ttl_s = ttl_s
        self._fallback = fallback_model
        self._cards: dict[str, dict[str, Any]] | None = None
        self._fetched_at = -float("inf")
        self._lock = asyncio.Lock()
        self._background: asyncio.Task[Any] | None = None

    async def _fetch_one(self, url: str) -> list[dict[str, Any]]:
        try:
            async with self._session().get(url + "/v1/models", headers=self._headers,
                                           timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S)) as r:
                if r.status != 200:
                    return []
                data = json.loads(await r.read()).get("data")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, AttributeError):
            return []
        return [c for c in data if isinstance(c, dict) and isinstance(c.get("id"), str)] if isinstance(data, list) else []

    async def refresh(self, force: bool = False, max_age_s: float | None = None) -> dict[str, dict[str, Any]] | None:
        """The cards by id, re-fetched when older than ``max_age_s`` (default ``ttl_s``; ``force``:
        always); None while no replica answered. Concurrent callers share one fetch."""
        max_age = self._ttl_s if max_age_s is None else max_age_s
        if not force and time.monotonic() - self._fetched_at < max_age:
            return self._cards
        async with self._lock:
            if not force and time.monotonic() - self._fetched_at < max_age:
                return self._cards
            results = await asyncio.gather(*(self._fetch_one(u) for u in self._urls()))
            cards: dict[str, dict[str, Any]] = {}
            for replica_cards in results:
                for c in replica_cards:
                    cards.setdefault(c["id"], c)
            now = time.monotonic()
            # no answer: ask again after 1 s rather than on every request
            self._fetched_at = now if cards else now - self._ttl_s + 1.0
            if cards:
                self._cards = cards
            return self._cards

    async def served(self) -> set[str] | None:
        """Ids the replicas serve; None while unknown (no replica answered)."""
        cards = await self.refresh()
        return None if cards is None else set(cards)

    async def served_for(self, model: str) -> set[str] | None:
        """Ids the replicas serve, for a request naming ``model``, without waiting on a fetch while a
        catalog is known (module docstring): a stale one (older than ``ttl_s``) is returned as it is
        and refreshed in the background; ``model`` missing from one older than
        :data:`MISS_REFRESH_S` waits for a fetch (shared by concurrent callers). None while unknown."""
        cards = self._cards
        if cards is None:
            cards = await self.refresh()
        else:
            age = time.monotonic() - self._fetched_at
            if model not in cards and age >= MISS_REFRESH_S:
                cards = await self.refresh(max_age_s=MISS_REFRESH_S)
            elif age >= self._ttl_s and (self._background is None or self._background.done()):
                self._background = asyncio.create_task(self.refresh())
        return None if cards is None else set(cards)

    async def close(self) -> None:
        """Cancel a background refresh still running."""
        task, self._background = self._background, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def list_response(self) -> web.Response:
        """``GET /v1/models``: the replicas' cards (the configured name while none answered)."""
        cards = await self.refresh()
        if cards is None:
            data = [{"id": self._fallback, "object": "model", "created": 0, "owned_by": "fairbatch"}] if self._fallback else []
        else:
            data = list(cards.values())
        return web.json_response({"object": "list", "data": data})

    async def model_response(self, model_id: str) -> web.Response:
        """``GET /v1/models/{id}``: that card, or 404 ``model_not_found``."""
        cards = await self.refresh()
        if cards is not None and model_id in cards:
            return web.json_response(cards[model_id])
        return model_not_found(model_id, cards or ())
