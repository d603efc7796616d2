"""What the simulated engine's "model" writes: sampling parameters -> the tokens of every choice.

Pure (no I/O, no clock). The server (loadgen/sim/server.py) computes each choice's whole output
when the request arrives, gives the engine core one sequence per choice whose length is the
choice's token count (so stops and EOS free KV exactly when vLLM would), and formats the text,
logprobs and finish reasons of this module as vLLM does.

The model. A fixed next-token distribution over :data:`VOCAB` (64 words of 4 ASCII bytes, so the
sim tokenizer's 4-bytes-per-token count holds for every output) plus an EOS token:
``p(VOCAB[r]) = 0.99 * 0.9**r / sum_j 0.9**j`` (rank r = 0 is ``" tok"``), ``p(EOS) = 0.01``.

- Greedy (no ``seed``, or ``temperature == 0``): every token is ``" tok"`` (the argmax; EOS is
  never the argmax; under a mask, the best unmasked word), so a request without a seed writes ``" tok" * max_tokens`` as before, and
  every choice of ``n > 1`` is the same (as vLLM's greedy choices are).
- Sampled (``seed`` s, temperature != 0): choice i draws from the distribution with
  ``random.Random(f"{s}/{i}")``: reproducible for the same (seed, n), different across choices.
  Without ``seed`` the sim decodes greedily (a simplification: vLLM would sample randomly).
- Structured output (``response_format`` json_object / json_schema, or a forced function in
  ``tool_choice``): the text is a JSON value built from the schema (values drawn with the same
  rng), cut into 4-byte tokens, then EOS; each forced token has logprob ln 0.9.
- ``min_tokens`` m: EOS and ``stop_token_ids`` are masked (redrawn) while fewer than m tokens
  exist, stop strings are not checked until more than m tokens exist (vLLM v1's detokenizer);
  structured output pads with ``"    "`` tokens up to m before its EOS.
- ``ignore_eos``: EOS is masked (redrawn); structured output pads with ``"    "`` to max_tokens.
- ``stop_token_ids``: generation ends at a sampled id in the list (finish ``stop``, stop_reason the
  id); its text stays in the output (a vocabulary word, not a special token). EOS ends with
  stop_reason None and adds no text. Both count in usage.
- ``stop`` strings: checked on the text each new token adds (window of the new text plus the
  string's length - 1, stop strings in list order, as vLLM); the text is cut before the match
  (after it with ``include_stop_str_in_output``), finish ``stop``, stop_reason the string.
- ``max_tokens``: finish ``length`` when reached.

Token ids: EOS = 2; ``VOCAB[r]`` = 100 + r; any other 4-byte piece of a structured text =
1000 + crc32(piece) % 31000. Logprobs are ln p of the distribution above; the top-k of a position
are the k most likely vocabulary words (rank order), a forced token first for structured output.
"""

from __future__ import annotations

import bisect
import json
import math
import random
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

VOCAB: tuple[str, ...] = (
    " tok", " the", " and", " for", " was", " you", " are", " not", " but", " can", " all", " one",
    " had", " her", " his", " its", " out", " day", " get", " has", " him", " how", " man", " new",
    " now", " old", " see", " two", " way", " who", " boy", " did", " let", " put", " say", " she",
    " too", " use", " sun", " sky", " sea", " map", " red", " big", " cat", " dog", " run", " top",
    " end", " low", " yes", " far", " few", " ask", " own", " try", " act", " add", " age", " air",
    " arm", " art", " bad", " bed",
)  # fmt: skip
EOS_ID = 2
EOS_PROB = 0.01
VOCAB_ID_BASE = 100
PIECE_ID_BASE = 1000
PIECE_ID_SPAN = 31000
PAD_TEXT = "    "
FORCED_LOGPROB = math.log(0.9)
MAX_LOGPROBS = 20

_WEIGHTS = [0.9**r for r in range(len(VOCAB))]
_TOTAL = sum(_WEIGHTS)
VOCAB_LOGPROBS: tuple[float, ...] = tuple(math.log((1.0 - EOS_PROB) * w / _TOTAL) for w in _WEIGHTS)
EOS_LOGPROB = math.log(EOS_PROB)
# inverse CDF over [EOS, VOCAB[0], VOCAB[1], ...]
_CDF: list[float] = []
_acc = EOS_PROB
_CDF.append(_acc)
for _w in _WEIGHTS:
    _acc += (1.0 - EOS_PROB) * _w / _TOTAL
    _CDF.append(_acc)
_VOCAB_INDEX = {w: r for r, w in enumerate(VOCAB)}


def token_id(piece: str) -> int:
    """Id of a 4-byte text piece (see the module docstring)."""
    r = _VOCAB_INDEX.get(piece)
    if r is not None:
        return VOCAB_ID_BASE + r
    return PIECE_ID_BASE + zlib.crc32(piece.encode()) % PIECE_ID_SPAN


@dataclass(frozen=True, slots=True)
class Token:
    """One generated token.

    Attributes:
        id: token id; text: its text ("" for EOS); logprob: ln p (natural log);
        top: the position's most likely (text, logprob) pairs in rank order (``MAX_LOGPROBS`` of them).
    """

    id: int
    text: str
    logprob: float
    top: tuple[tuple[str, float], ...]


@dataclass(slots=True)
class ChoiceOutput:
    """Everything one choice outputs.

    Attributes:
        index: choice index (0..n-1).
        tokens: every generated token (usage counts them all).
        text: the final text (after a stop-string cut).
        deltas: per token, the text a stream chunk carries for it ("" while held back);
            ``"".join(deltas) == text``.
        finish_reason: ``"length"`` or ``"stop"``.
        stop_reason: the stop string, the stop token id, or None (EOS, length).
    """

    index: int
    tokens: list[Token] = field(default_factory=list)
    text: str = ""
    deltas: list[str] = field(default_factory=list)
    finish_reason: str = "length"
    stop_reason: str | int | None = None


@dataclass(frozen=True, slots=True)
class Sampling:
    """The sampling parameters the sim honours (validated by :func:`parse_sampling`).

    Attributes:
        n: choices; seed: None = greedy; greedy: argmax decoding (no seed or temperature 0);
        max_tokens, min_tokens: per choice (tokens); ignore_eos; stop: stop strings;
        stop_token_ids; include_stop_str_in_output;
        logprobs: None = off; chat: top_logprobs count (0 with ``logprobs: true``); completions: k;
        schema: JSON schema of a structured answer (``{}`` = any JSON object), None = free text;
        tool_name: the forced function (chat), None otherwise.
    """

    n: int = 1
    seed: int | None = None
    greedy: bool = True
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    schema: Mapping[str, Any] | None = None
    tool_name: str | None = None

    @property
    def plain(self) -> bool:
        """True when the output is the legacy ``" tok" * max_tokens`` with no extra fields."""
        return (self.n == 1 and self.greedy and not self.stop and not self.stop_token_ids
                and self.logprobs is None and self.schema is None and self.min_tokens == 0)  # fmt: skip


class SamplingError(ValueError):
    """An invalid sampling parameter; ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _int(body: Mapping[str, Any], key: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise SamplingError(f"'{key}' must be an integer, got {v!r}", key)
    if v < lo or (hi is not None and v > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise SamplingError(f"'{key}' must be {bound}, got {v}", key)
    return v


def _bool(body: Mapping[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise SamplingError(f"'{key}' must be a boolean, got {v!r}", key)
    return v


def _schema_of_tool(body: Mapping[str, Any]) -> tuple[str | None, Mapping[str, Any] | None]:
    """The forced function's (name, parameters schema), or (None, None) when no function is forced."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise SamplingError("'tools' must be a list", "tools")
    if choice is None:
        if tools:
            raise SamplingError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                                "tool_choice")  # fmt: skip
        return None, None
    if choice == "none":
        return None, None
    if isinstance(choice, str):
        raise SamplingError(f"tool_choice {choice!r} is not supported by the simulated engine "
                            "(a named function is)", "tool_choice")  # fmt: skip
    fn = choice.get("function") if isinstance(choice, Mapping) else None
    name = fn.get("name") if isinstance(fn, Mapping) else None
    if not isinstance(name, str):
        raise SamplingError("'tool_choice' must name a function: {\"type\": \"function\", \"function\": {\"name\": ...}}",
                            "tool_choice")  # fmt: skip
    for t in tools or []:
        tf = t.get("function") if isinstance(t, Mapping) else None
        if isinstance(tf, Mapping) and tf.get("name") == name:
            params = tf.get("parameters")
            return name, params if isinstance(params, Mapping) else {}
    raise SamplingError(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")


def _schema_of_format(body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, Mapping) else None
        return schema if isinstance(schema, Mapping) else {}
    raise SamplingError("'response_format.type' must be 'text', 'json_object' or 'json_schema'", "response_format")


def parse_sampling(body: Mapping[str, Any], chat: bool, default_max_tokens: int) -> Sampling:
    """Validate the sampling fields of a request body (``max_tokens`` resolved by the caller).

    Raises:
        SamplingError: a malformed or unsupported value, naming the field.
    """
    n = _int(body, "n", 1, 1, 128)
    seed = _int(body, "seed", None, -(2**63), 2**64 - 1)
    temp = body.get("temperature")
    if temp is not None and (isinstance(temp, bool) or not isinstance(temp, int | float) or temp < 0):
        raise SamplingError(f"'temperature' must be a number >= 0, got {temp!r}", "temperature")
    greedy = seed is None or temp == 0
    min_tokens = _int(body, "min_tokens", 0, 0)
    if min_tokens > default_max_tokens:
        raise SamplingError(f"min_tokens must be less than or equal to max_tokens={default_max_tokens}, got {min_tokens}.",
                            "min_tokens")  # fmt: skip
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = tuple(s for s in stop if s)
    else:
        raise SamplingError("'stop' must be a string or a list of strings", "stop")
    ids = body.get("stop_token_ids")
    if ids is None:
        stop_ids: frozenset[int] = frozenset()
    elif isinstance(ids, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        stop_ids = frozenset(ids)
    else:
        raise SamplingError("'stop_token_ids' must be a list of integers", "stop_token_ids")
    if chat:
        want = _bool(body, "logprobs")
        top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if top is not None and top > 0 and not want:
            raise SamplingError("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
        logprobs = (top or 0) if want else None
        tool_name, tool_schema = _schema_of_tool(body)
    else:
        logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
        tool_name, tool_schema = None, None
    schema = tool_schema if tool_name is not None else _schema_of_format(body)
    return Sampling(
        n=n, seed=seed, greedy=greedy, max_tokens=default_max_tokens, min_tokens=min_tokens,
        ignore_eos=_bool(body, "ignore_eos"), stop=stops, stop_token_ids=stop_ids,
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output"), logprobs=logprobs,
        schema=schema, tool_name=tool_name,
    )  # fmt: skip


def _word(rng: random.Random) -> str:
    return VOCAB[rng.randrange(len(VOCAB))].strip()


def json_value(schema: Mapping[str, Any], rng: random.Random, depth: int = 0) -> Any:
    """A JSON value satisfying the common JSON-schema keywords of ``schema`` (type, properties,
    items, enum, const); ``{}`` at the top = an object ``{"<word>": "<word> <word>"}``."""
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return enum[rng.randrange(len(enum))]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    props = schema.get("properties")
    if kind == "object" or isinstance(props, Mapping) or (kind is None and depth == 0):
        if isinstance(props, Mapping) and props:
            return {k: json_value(v if isinstance(v, Mapping) else {}, rng, depth + 1) for k, v in props.items()}
        return {_word(rng): f"{_word(rng)} {_word(rng)}"}
    if kind == "array":
        items = schema.get("items")
        lo = schema.get("minItems", 1)
        count = max(lo if isinstance(lo, int) else 1, 1)
        return [json_value(items if isinstance(items, Mapping) else {"type": "string"}, rng, depth + 1)
                for _ in range(count)]  # fmt: skip
    if kind == "integer":
        return rng.randrange(100)
    if kind == "number":
        return rng.randrange(1000) / 10
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    return f"{_word(rng)} {_word(rng)}"


def _top_vocab(k: int) -> tuple[tuple[str, float], ...]:
    return tuple((VOCAB[r], VOCAB_LOGPROBS[r]) for r in range(min(k, len(VOCAB))))


_TOP = _top_vocab(MAX_LOGPROBS)
_FORCED_TOP = tuple((w, lp + math.log(0.1)) for w, lp in _top_vocab(MAX_LOGPROBS - 1))


def _sampled(rng: random.Random, masked: set[int]) -> Token:
    """One draw from the fixed distribution, redrawn while it hits a masked id."""
    while True:
        j = bisect.bisect_left(_CDF, rng.random())
        if j == 0:
            tok = Token(EOS_ID, "", EOS_LOGPROB, _TOP)
        else:
            r = min(j - 1, len(VOCAB) - 1)
            tok = Token(VOCAB_ID_BASE + r, VOCAB[r], VOCAB_LOGPROBS[r], _TOP)
        if tok.id not in masked:
            return tok


def _argmax(masked: set[int]) -> Token:
    """The most likely vocabulary word whose id is not masked (greedy decoding under a mask)."""
    r = next(r for r in range(len(VOCAB)) if VOCAB_ID_BASE + r not in masked)
    return Token(VOCAB_ID_BASE + r, VOCAB[r], VOCAB_LOGPROBS[r], _TOP)


def _forced(piece: str) -> Token:
    return Token(token_id(piece), piece, FORCED_LOGPROB, ((piece, FORCED_LOGPROB), *_FORCED_TOP))


_GREEDY = Token(VOCAB_ID_BASE, VOCAB[0], VOCAB_LOGPROBS[0], _TOP)
_EOS_FORCED = Token(EOS_ID, "", FORCED_LOGPROB, (("", FORCED_LOGPROB), *_FORCED_TOP))


def _structured_pieces(sp: Sampling, rng: random.Random) -> list[str]:
    text = json.dumps(json_value(sp.schema or {}, rng))
    return [text[i : i + 4] for i in range(0, len(text), 4)]


def _find_stop(sp: Sampling, text: str, new_chars: int) -> tuple[str, int] | None:
    for s in sp.stop:
        idx = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if idx >= 0:
            return s, idx
    return None


def generate_choice(sp: Sampling, index: int) -> ChoiceOutput:
    """The whole output of choice ``index`` under ``sp`` (see the module docstring)."""
    out = ChoiceOutput(index)
    rng = random.Random(f"{sp.seed}/{0 if sp.greedy else index}")
    pieces = _structured_pieces(sp, rng) if sp.schema is not None else None
    raw = ""
    holdback = 0 if sp.include_stop_str_in_output or not sp.stop else max(len(s) for s in sp.stop) - 1
    visible = 0
    while len(out.tokens) < sp.max_tokens:
        produced = len(out.tokens)
        masked: set[int] = set()
        if sp.ignore_eos or produced < sp.min_tokens:
            masked.add(EOS_ID)
        if produced < sp.min_tokens:
            masked |= sp.stop_token_ids
        if pieces is not None:
            if produced < len(pieces):
                tok = _forced(pieces[produced])
            elif EOS_ID in masked:
                tok = _forced(PAD_TEXT)
            else:
                tok = _EOS_FORCED
        elif sp.greedy:
            tok = _GREEDY if _GREEDY.id not in masked else _argmax(masked)
        else:
            tok = _sampled(rng, masked)
        out.tokens.append(tok)
        raw += tok.text
        done = False
        if tok.id == EOS_ID and not sp.ignore_eos:
            out.finish_reason, out.stop_reason, done = "stop", None, True
        elif tok.id in sp.stop_token_ids and produced >= sp.min_tokens:
            out.finish_reason, out.stop_reason, done = "stop", tok.id, True
        elif sp.stop and len(out.tokens) > sp.min_tokens:
            hit = _find_stop(sp, raw, len(tok.text))
            if hit is not None:
                s, idx = hit
                raw = raw[: idx + len(s)] if sp.include_stop_str_in_output else raw[:idx]
                out.finish_reason, out.stop_reason, done = "stop", s, True
        last = done or len(out.tokens) == sp.max_tokens
        new_visible = len(raw) if last else max(visible, len(raw) - holdback)
        out.deltas.append(raw[visible:new_visible])
        visible = new_visible
        if done:
            break
    out.text = raw
    return out


def generate(sp: Sampling) -> list[ChoiceOutput]:
    """Every choice of a request, index order."""
    return [generate_choice(sp, i) for i in range(sp.n)]


# ---- vLLM's logprobs shapes ---------------------------------------------------------------------


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def chat_logprob_entry(tok: Token, k: int) -> dict[str, Any]:
    """One ``logprobs.content[*]`` entry of a chat answer (OpenAI / vLLM shape)."""
    return {
        "token": tok.text, "logprob": tok.logprob, "bytes": _bytes(tok.text),
        "top_logprobs": [{"token": t, "logprob": lp, "bytes": _bytes(t)} for t, lp in tok.top[:k]],
    }  # fmt: skip


def completion_logprobs(tokens: Sequence[Token], k: int, text_offset: int) -> dict[str, Any]:
    """A completions ``logprobs`` object for ``tokens`` whose first starts at ``text_offset`` (chars).

    ``top_logprobs[j]`` maps the k most likely tokens, and the sampled one, to their logprobs
    (up to k + 1 entries, as OpenAI's legacy API says)."""
    offsets, lps, texts, tops = [], [], [], []
    off = text_offset
    for tok in tokens:
        offsets.append(off)
        lps.append(tok.logprob)
        texts.append(tok.text)
        top = dict(tok.top[:k])
        top.setdefault(tok.text, tok.logprob)
        tops.append(top)
        off += len(tok.text)
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": texts, "top_logprobs": tops}
