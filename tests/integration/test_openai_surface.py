"""The router's OpenAI surface: one error vocabulary whoever detects the error, the model
catalog from the engines, relayed and refused paths. One simulated engine + agent + router."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from tests.integration.test_fidelity import MODEL, PROMPT, fleet, targets  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(120)


async def post(s: aiohttp.ClientSession, fleet, path: str, body: dict, auth: bool = True) -> tuple[int, dict, dict]:  # noqa: F811
    url, h = targets(fleet)["router"]
    async with s.post(url + path, json=body, headers=h if auth else {}) as r:
        return r.status, await r.json(content_type=None), dict(r.headers)


async def test_models_are_the_engines_cards(fleet) -> None:  # noqa: F811
    url, h = targets(fleet)["router"]
    async with aiohttp.ClientSession() as s:
        async with s.get(fleet.engine_urls[0] + "/v1/models") as r:
            engine_card = (await r.json())["data"][0]
        async with s.get(url + "/v1/models", headers=h) as r:
            listed = await r.json()
        async with s.get(url + f"/v1/models/{MODEL}", headers=h) as r:
            assert r.status == 200
            one = await r.json()
        async with s.get(url + "/v1/models/no-such-model", headers=h) as r:
            assert r.status == 404
            err = (await r.json())["error"]
        for path in ("/v1/models", f"/v1/models/{MODEL}"):  # a key, as for every /v1 path (vLLM --api-key, OpenAI)
            async with s.get(url + path) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "invalid_api_key"
    assert listed == {"object": "list", "data": [engine_card]}
    assert one == engine_card
    assert (one["max_model_len"], one["root"], one["owned_by"]) == (32768, MODEL, "vllm")
    assert (err["code"], err["param"], err["type"]) == ("model_not_found", "model", "invalid_request_error")


async def test_unknown_model_refused_before_any_lease(fleet) -> None:  # noqa: F811
    async with aiohttp.ClientSession() as s:
        status, body, headers = await post(s, fleet, "/v1/completions", {"model": "gpt-4o", "prompt": "hi"})
    assert status == 404
    assert body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    assert MODEL in body["error"]["message"]  # names what is served
    assert "x-fairbatch-replica" not in headers  # never placed: no Reserve, no lease


async def test_context_length_same_code_from_router_and_engine(fleet) -> None:  # noqa: F811
    async with aiohttp.ClientSession() as s:
        # token ids: counted exactly by the router, 40000 > 32768 -> refused there
        status, body, headers = await post(s, fleet, "/v1/completions", {"model": MODEL, "prompt": [7] * 40000})
        assert status == 400 and "x-fairbatch-replica" not in headers
        router_err = body["error"]
        # 6 prompt tokens + max_tokens 32768 > 32768: only the engine can tell -> mapped by the agent
        status, body, headers = await post(s, fleet, "/v1/completions", {"model": MODEL, "prompt": PROMPT,
                                                                         "max_tokens": 32768})  # fmt: skip
        assert status == 400 and headers.get("x-fairbatch-replica") == "r0"
        engine_err = body["error"]
    for err in (router_err, engine_err):
        assert (err["code"], err["type"]) == ("context_length_exceeded", "invalid_request_error")
    assert router_err["param"] == "prompt" and engine_err["param"] == "max_tokens"
    assert "maximum context length is 32768" in engine_err["message"]


async def test_engine_invalid_param_names_it(fleet) -> None:  # noqa: F811
    async with aiohttp.ClientSession() as s:
        status, body, _ = await post(s, fleet, "/v1/chat/completions", {
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2})  # fmt: skip
    assert status == 400
    assert body["error"] == {"message": "when using `top_logprobs`, `logprobs` must be set to true.",
                             "type": "invalid_request_error", "param": "top_logprobs", "code": None}  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/embeddings", "/v1/responses"])
async def test_refused_paths_name_what_is_supported(fleet, path) -> None:  # noqa: F811
    async with aiohttp.ClientSession() as s:
        status, body, _ = await post(s, fleet, path, {"model": MODEL, "input": "x"})
    assert status == 404
    assert body["error"]["code"] == "unsupported_endpoint"
    assert "POST /v1/chat/completions" in body["error"]["message"] and path in body["error"]["message"]


async def test_tokenize_detokenize_relayed_with_auth(fleet) -> None:  # noqa: F811
    async with aiohttp.ClientSession() as s:
        async with s.post(fleet.engine_urls[0] + "/tokenize", json={"prompt": PROMPT}) as r:
            direct = await r.json()
        status, routed, headers = await post(s, fleet, "/tokenize", {"prompt": PROMPT})
        assert status == 200 and routed == direct and headers["x-fairbatch-replica"] == "r0"
        assert routed["count"] == 6 and routed["max_model_len"] == 32768  # 23 bytes / 4, rounded up
        status, _, _ = await post(s, fleet, "/tokenize", {"prompt": PROMPT}, auth=False)
        assert status == 401
        status, out, _ = await post(s, fleet, "/detokenize", {"tokens": [100, 101, 2]})
        assert (status, out) == (200, {"prompt": " tok the"})


def test_openai_client_sees_the_vocabulary(fleet) -> None:  # noqa: F811
    client = openai.OpenAI(base_url=fleet.router_url + "/v1", api_key=fleet.api_keys["acme"], max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="hi")
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32768)
    assert e.value.code == "context_length_exceeded"
