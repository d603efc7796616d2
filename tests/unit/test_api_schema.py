"""Request validation shared by router and agent (fairbatch_common/api_schema.py): every refusal is an
ApiError 400 naming the field; what passes is what the engine and proto/admission.proto can hold."""

from __future__ import annotations

import json

import pytest

from fairbatch_common.api_schema import (
    MAX_JSON_DEPTH,
    MAX_N,
    UINT32_MAX,
    ApiError,
    decode_json_object,
    validate_request,
)


def refusal(raw: bytes | str, chat: bool = False, max_context: int = 0) -> ApiError:
    with pytest.raises(ApiError) as info:
        validate_request(raw.encode() if isinstance(raw, str) else raw, chat, max_context)
    assert info.value.status == 400
    return info.value


def test_valid_completion_and_chat() -> None:
    v = validate_request(b'{"model": "m", "prompt": "hi", "max_tokens": 8, "stream": true, "temperature": 0.5}', False)
    assert (v.model, v.stream, v.max_tokens, v.n) == ("m", True, 8, 1)
    assert v.body["temperature"] == 0.5  # unknown fields are kept for the engine
    v = validate_request(json.dumps({"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}]}], "max_completion_tokens": 3, "max_tokens": 9, "n": 2}).encode(), True)
    assert (v.stream, v.max_tokens, v.n) == (False, 3, 2)  # max_completion_tokens wins
    for prompt in ([1, 2, 3], [[1, 2], [3]], ["a", "b"], ["a", [4, 5]]):
        assert validate_request(json.dumps({"model": "m", "prompt": prompt}).encode(), False).max_tokens is None


def test_nesting_is_bounded_also_where_json_loads_would_recurse() -> None:
    ok = '{"model": "m", "prompt": "x", "extra": ' + "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1) + "}"
    validate_request(ok.encode(), False)  # the root object + 31 lists = 32 levels
    deep = ok.replace("[", "[[", 1).replace("]", "]]", 1)
    err = refusal(deep)
    assert err.code == "invalid_json" and "nested more than 32" in err.message
    err = refusal('{"a": ' + "[" * 200_000 + "]" * 200_000 + "}")  # json.loads raises RecursionError here
    assert err.code == "invalid_json"


def test_lone_surrogates_and_bad_bytes() -> None:
    err = refusal('{"model": "m", "prompt": "abc\\ud800"}')
    assert err.param == "prompt" and "lone surrogate" in err.message
    err = refusal('{"model": "m", "messages": [{"role": "user", "content": "\\udfff"}]}', chat=True)
    assert err.param == "messages[0].content"
    assert refusal('{"model": "m", "prompt": "x", "\\ud800": 1}').code == "invalid_json"  # a key as well
    assert refusal(b'{"model": "m", "prompt": "\xff\xfe\xfa"}').code == "invalid_json"  # not UTF-8
    assert refusal(b"\x1f\x8b\x08\x00").code == "invalid_json"  # gzip bytes


@pytest.mark.parametrize("text, param", [
    ('{"model": "m", "prompt": "x", "max_tokens": 1' + "0" * 400 + "}", "max_tokens"),  # 10**400
    ('{"model": "m", "prompt": "x", "max_tokens": 9223372036854775808}', "max_tokens"),  # 2**63
    ('{"model": "m", "prompt": "x", "max_tokens": 4294967296}', "max_tokens"),  # 2**32: above the uint32
    ('{"model": "m", "prompt": "x", "max_tokens": 0}', "max_tokens"),
    ('{"model": "m", "prompt": "x", "max_tokens": true}', "max_tokens"),
    ('{"model": "m", "prompt": "x", "max_tokens": 4.0}', "max_tokens"),
    ('{"model": "m", "prompt": "x", "max_completion_tokens": -1}', "max_completion_tokens"),
    ('{"model": "m", "prompt": "x", "n": 129}', "n"),
    ('{"model": "m", "prompt": "x", "best_of": 0}', "best_of"),
    ('{"model": "m", "prompt": "x", "stream": "yes"}', "stream"),
    ('{"model": "", "prompt": "x"}', "model"),
    ('{"prompt": "x"}', "model"),
    ('{"model": "m"}', "prompt"),
    ('{"model": "m", "prompt": []}', "prompt"),
    ('{"model": "m", "prompt": [1, -2]}', "prompt"),
    ('{"model": "m", "prompt": [4294967296]}', "prompt"),
    ('{"model": "m", "prompt": [["a"]]}', "prompt"),
    ('{"model": "m", "prompt": {"a": 1}}', "prompt"),
])
def test_completion_fields(text: str, param: str) -> None:
    err = refusal(text)
    assert err.param == param, err.message
    assert err.code == "invalid_value"


def test_upper_bounds_pass() -> None:
    v = validate_request(f'{{"model": "m", "prompt": [{UINT32_MAX}], "max_tokens": {UINT32_MAX}, "n": {MAX_N}}}'
                         .encode(), False)
    assert (v.max_tokens, v.n) == (UINT32_MAX, MAX_N)


def test_max_tokens_within_the_context_when_known() -> None:
    body = b'{"model": "m", "prompt": "x", "max_tokens": 32769}'
    assert validate_request(body, False, max_context=0).max_tokens == 32769  # unknown context: the engine decides
    err = refusal(body, max_context=32768)
    assert err.param == "max_tokens" and "(32769) is larger than the model's context length (32768" in err.message
    assert validate_request(body.replace(b"32769", b"32768"), False, 32768).max_tokens == 32768


@pytest.mark.parametrize("text, param", [
    ('{"model": "m", "messages": []}', "messages"),
    ('{"model": "m"}', "messages"),
    ('{"model": "m", "messages": ["hi"]}', "messages[0]"),
    ('{"model": "m", "messages": [{"content": "hi"}]}', "messages[0].role"),
    ('{"model": "m", "messages": [{"role": "user", "content": 5}]}', "messages[0].content"),
])
def test_chat_fields(text: str, param: str) -> None:
    assert refusal(text, chat=True).param == param


@pytest.mark.parametrize("raw", [b"", b"{not json", b"[1, 2]", b'"s"', b'{"a": NaN}', b'{"a": Infinity}',
                                 b'{"a": 1e400}', b'{"a": ' + b"9" * 5000 + b"}"])
def test_not_an_acceptable_json_object(raw: bytes) -> None:
    with pytest.raises(ApiError) as info:
        decode_json_object(raw)
    assert info.value.status == 400 and info.value.code == "invalid_json"
    assert set(info.value.to_json()["error"]) == {"message", "type", "param", "code"}


def test_long_token_id_lists_are_checked_whole() -> None:
    """Issue 30 item 8: long id lists are checked in C-level slices of 32,768 ids; a bad id anywhere is
    still found and named, and the exact count comes back as ``prompt_ids``."""
    ids = list(range(100_000))  # > 3 slices
    v = validate_request(json.dumps({"model": "m", "prompt": ids}).encode(), False)
    assert v.prompt_ids == 100_000
    v = validate_request(json.dumps({"model": "m", "prompt": [ids, [7, 8], ids[:40]]}).encode(), False)
    assert v.prompt_ids == 100_000 + 2 + 40
    assert validate_request(json.dumps({"model": "m", "prompt": ["a", ids]}).encode(), False).prompt_ids is None
    assert validate_request(b'{"model": "m", "prompt": "text"}', False).prompt_ids is None
    bad = list(ids)
    bad[70_000] = UINT32_MAX + 1  # in the third slice
    err = refusal(json.dumps({"model": "m", "prompt": bad}))
    assert err.param == "prompt" and f"token id prompt[70000] is outside [0, {UINT32_MAX}]" in err.message
    bad[70_000] = -1
    err = refusal(json.dumps({"model": "m", "prompt": [[1], bad]}))
    assert "token id prompt[1][70000] is outside" in err.message
    # longer than a known context: counted, not range-checked (the caller refuses it by its count)
    assert validate_request(json.dumps({"model": "m", "prompt": [[1], bad]}).encode(), False, 32_768).prompt_ids \
        == 100_001
    bad[70_000] = True  # a JSON true is not a token id
    err = refusal(json.dumps({"model": "m", "prompt": bad}))
    assert err.param == "prompt" and "must be a string, a list of strings, a list of token ids" in err.message


@pytest.mark.parametrize("raw", [
    json.dumps({"model": "m", "prompt": "x", "seed": 2**70}).encode(),  # beyond 64 bits: orjson reads a float
    json.dumps({"model": "m", "prompt": list(range(40)) + [2**65]}).encode(),
    json.dumps({"model": "m", "prompt": "x", "temperature": 1e300, "logit_bias": {"5": -1.5}}).encode(),
    json.dumps({"model": "m", "prompt": "h\u00e9llo \u2603", "n": 2}, ensure_ascii=False).encode("utf-16"),  # BOM
    json.dumps({"model": "m", "prompt": [[1] * 20, ["a"] * 20]}).encode(),
])
def test_decoding_gives_what_json_loads_gives(raw: bytes) -> None:
    """The orjson path and its json.loads fallback decode every body as json.loads does (types kept:
    an integer beyond 64 bits stays an int)."""
    body = decode_json_object(raw)
    expected = json.loads(raw)
    assert body == expected
    assert [type(v) for v in body.values()] == [type(v) for v in expected.values()]


def test_an_integer_beyond_64_bits_is_refused_as_before() -> None:
    err = refusal(json.dumps({"model": "m", "prompt": [1, 2**65]}))
    assert "token id prompt[1] is outside" in err.message  # an int out of range, not "not an id" (a float)
