"""Token-resume migration of a streamed ``/v1/completions`` or ``/v1/chat/completions`` (issue 29):
pure, no I/O, no clock.

A stream whose replica fails after its first byte (the agent's SSE error event when its engine died
or stalled, the connection lost, the agent silent past ``Router.silence_s``) is continued on another
replica instead of ending with the SSE error event. This module holds the decisions; router/server.py
carries them out (placement through the core, the relay of router/relay.py).

- :func:`migratable`: which requests can be continued at all (streamed, one choice, no output
  constraint such as tools or a JSON schema; completions: no ``echo``, a prompt that is a string or
  token ids; chat: a ``messages`` list).
- :class:`StreamResume`: one stream's state across its attempts. :meth:`StreamResume.feed` takes the
  upstream bytes of the current attempt and returns the bytes for the client: every SSE event is
  relayed, the agent's error event is held back (it marks the attempt failed), and a continuation's
  events get the first attempt's ``id`` and ``created``; its ``usage`` is rewritten to what the
  client asked for (the original prompt, every completion token).
- :func:`continuation_body`: the continuation's request (prompt + output so far, ``max_tokens`` and
  ``min_tokens`` reduced by the tokens sent, every other field, the ``seed`` included, unchanged).
- :func:`decide`: continue or give up (the migration limit, the context, nothing to continue).

Exactness. The output so far is kept as token ids when the engine streams them (each choice's
``token_ids``, vLLM's ``return_token_ids``); then a token-id prompt continues with
``prompt + token_ids``, the engine's own tokens. Otherwise the text is kept and a string prompt
continues with ``prompt + text``: exact when re-tokenizing the text gives back the same tokens (the
simulated engine: 4-byte tokens; vLLM: usually, but a BPE merge across the boundary can differ).
A token-id prompt whose engine streams no token ids cannot be continued (``not-continuable``),
nor a chat stream that sent reasoning, a refusal or a tool call.
A chat completion continues through the engine's chat template: ``messages`` + an assistant
message holding the text so far, ``continue_final_message: true, add_generation_prompt: false``
(vLLM renders the turn open, so the prompt is the original one plus the text; the simulated engine
does the same, loadgen/sim/tokenizer.py ``render_chat``).
The count of tokens sent is ``len(token_ids)`` per event when present, else the event's logprobs
entries when the client asked for logprobs, else one per event that carries a choice (one engine step
of one sequence: one token without speculative decoding; an empty final event with a
``finish_reason`` is not counted, an empty event before it is: vLLM sends one for a token whose bytes
end inside a UTF-8 character; a text continuation cut right after such events regenerates them,
:class:`StreamResume`). Greedy decoding (``temperature`` 0, or
the simulated engine without ``seed``) continues exactly as an unbroken run; a seeded sampled
request restarts its generator on the new replica, so the continuation is a valid sample given the
text so far but not the unbroken run's. A ``stop`` string that straddles the failure point is checked
here on the joined text (:class:`StreamResume`). :func:`decide_resume` and :func:`continuation_sizes`
are the decision on plain numbers, for the fleet simulation too (loadgen/fleet/sim.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fairbatch_common.openai_stream import fast_event_tokens, logprob_tokens

CAUSES = ("error_event", "disconnect", "silence", "replica_removed", "drain")
"""Why an attempt failed mid-stream (metric label ``cause``; router/relay.py ``RelayOutcome.cause``):
``drain`` is the hand-over event of a draining agent (an error event of type :data:`HANDOVER_TYPE`)."""

HANDOVER_TYPE = "replica_draining"
"""``error.type`` of the event a draining agent ends a stream with when it hands it over
(replica_agent/proxy.py ``HANDOVER_TYPE``, the same string: the agent imports nothing from the router)."""

_DONE = b"[DONE]"
_OPAQUE_DELTA = ("reasoning_content", "reasoning", "refusal", "tool_calls")
"""Chat delta fields a continuation's ``messages`` cannot carry back: a stream that sent one is not continued."""


def prompt_of(body: Mapping[str, Any]) -> str | list[int] | None:
    """A completions ``prompt`` as one string or one token-id list (a one-element list unwrapped);
    None for anything else (batched prompts, empty, not ints)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    return None


_CONSTRAINED = ("tools", "functions", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs")
"""Fields that constrain the output from its first token (a grammar, a tool call): a continuation
would restart the constraint mid-value, so such a request is not migrated."""


def migratable(body: Mapping[str, Any], chat: bool, stream: bool) -> bool:
    """Whether a request can be continued on another replica: streamed, one choice (``n`` and
    ``best_of`` absent or 1), no output constraint (``tools``, ``response_format`` other than text,
    vLLM's ``guided_*`` / ``structured_outputs``); a completion without ``echo`` and with a prompt
    :func:`prompt_of` accepts, or a chat completion with a ``messages`` list."""
    if not stream:
        return False
    if body.get("n", 1) not in (None, 1) or body.get("best_of", 1) not in (None, 1):
        return False
    if any(body.get(k) for k in _CONSTRAINED):
        return False
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        return False
    if chat:
        return isinstance(body.get("messages"), list) and bool(body["messages"])
    if body.get("echo"):
        return False
    return prompt_of(body) is not None


@dataclass(frozen=True, slots=True)
class MigrationDecision:
    """:func:`decide`'s answer.

    Attributes:
        go: place a continuation.
        reason: ``resume`` (go), ``complete`` (every token was sent: end the stream), ``limit``
            (``max_migrations`` continuations placed already), ``not-continuable`` (a token-id prompt
            and no token ids from the engine), ``context`` (prompt + output over the largest context).
    """

    go: bool
    reason: str


@dataclass(slots=True)
class StreamResume:
    """One migratable stream across its attempts.

    Args:
        body: the client's request (parsed JSON object; not modified).
        chat: a ``/v1/chat/completions`` stream (text in ``delta.content``; a continuation's
            role-only first event is not relayed: the client had the first attempt's).

    Attributes:
        response_id, created: the first attempt's ``id`` and ``created`` (None before its first event).
        texts: the choice's text pieces relayed so far.
        token_ids: its token ids so far, None once an event carried none.
        tokens: completion tokens relayed to the client so far.
        base_tokens: of those, the ones relayed before the current attempt.
        finish_reason: the last ``finish_reason`` relayed (None: not finished).
        done: the ``[DONE]`` event was relayed.
        error: the current attempt sent an error event (held back, never relayed).
        migrations: continuations placed so far.
        attempt_events: SSE events the current attempt relayed.
        events: SSE data events relayed to the client over all attempts (``[DONE]`` not counted).
        opaque: a chat event carried reasoning, a refusal or a tool call (not continuable).
        last_out: the relay's output that ended with ``[DONE]`` (written with the end of the body).
        error_message: the held-back error event's message (at most 200 characters; the agent's, e.g.
            "engine stalled: no byte for 3 s"), for the router's own error event when not continued.
        error_type: its ``type`` (``replica_draining``: a draining agent's hand-over).
        replay: events of the current attempt still to come that regenerate tokens the client already
            counted (a text continuation rolled back over the trailing empty-text events: below).
        stop_tail: the last ``len(longest stop) - 1`` characters relayed before the current attempt
            (a stop string that straddles the cut starts there; "" without ``stop``).
        cut: the router ended the stream at a stop string that straddled the cut (upstream closed).
        prompt_tokens: the original prompt's tokens as the router counted them (for the ``usage`` of a
            stream the router ends itself; an estimate for a text prompt).

    Cut inside a character. vLLM streams an empty ``text`` for a token whose bytes end inside a
    UTF-8 character (its detokenizer holds the bytes until the character is whole). A text
    continuation resumes from a string, which cannot hold those bytes, so it is rolled back over the
    trailing run of such events: their tokens are not subtracted from ``max_tokens``, the
    continuation regenerates them (greedy: the same tokens, now with the whole character), and its
    first :attr:`replay` events (as many as were rolled back; the client already has one event per
    token) are not relayed: their text is held and put in front of the next relayed event's. Worked:
    " caf" + "" (a token ending in the first byte of "é") cut, max_tokens 5 -> prompt + " caf",
    max_tokens 4 (not 3); the continuation regenerates that token (again "", held, not relayed), then
    "é" goes out: the client's events " caf", "", "é", ... one per token, the text whole.

    Stop strings across the cut. Each attempt's engine checks only its own output, so a ``stop`` that
    starts in the text before the cut and ends in the continuation is checked here, on the joined
    text: :attr:`stop_tail` + the continuation's text, while the latter is shorter than the longest
    stop. The first stop completed (the earliest end, then list order) ends the stream as the
    unbroken run would: the event's text is cut before the stop (after it with
    ``include_stop_str_in_output``), ``finish_reason`` ``stop`` and ``stop_reason`` the string, a
    ``usage`` event when the client asked for one, ``[DONE]``; the upstream is closed (:attr:`cut`).
    Worked: stop "END", relayed "x E", the continuation sends "ND y" -> joined "x END y": "END" at 2,
    inside the tail "x E" (3 characters, 2 of them kept as the tail "E" needs len("END") - 1 = 2) ->
    the event's text "", finish "stop". An engine that holds back a possible stop prefix (vLLM v1,
    the simulated engine) never relayed one, so there the continuation sees the whole stop itself.
    """

    body: Mapping[str, Any]
    chat: bool = False
    response_id: str | None = None
    created: int | None = None
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] | None = field(default_factory=list)
    tokens: int = 0
    base_tokens: int = 0
    finish_reason: str | None = None
    done: bool = False
    error: bool = False
    migrations: int = 0
    attempt_events: int = 0
    events: int = 0
    opaque: bool = False
    last_out: bytes = b""
    error_message: str = ""
    error_type: str = ""
    replay: int = 0
    stop_tail: str = ""
    cut: bool = False
    prompt_tokens: int = 0
    _empty_run: int = 0  # trailing relayed token events with no text (module docstring: cut inside a character)
    _empty_run_tokens: int = 0
    _replay_text: list[str] = field(default_factory=list)
    _cont_text: str = ""  # the current continuation's relayed text, while shorter than the longest stop
    _buf: bytes = b""
    _pending: list[bytes] = field(default_factory=list)

    def text(self) -> str:
        """The text relayed so far."""
        self._decode_pending()
        return "".join(self.texts)

    def _decode_pending(self) -> None:
        """The fast path's text pieces (JSON string bodies, still escaped) decoded into :attr:`texts`."""
        if self._pending:
            self.texts.append(json.loads(b'"' + b"".join(self._pending) + b'"'))
            self._pending.clear()

    def new_attempt(self) -> None:
        """An attempt starts (the first, a retry before the first byte, or a continuation): the
        previous attempt's error mark, event count and partial event are dropped."""
        self.error = False
        self.error_message = ""
        self.error_type = ""
        self.attempt_events = 0
        self._buf = b""

    def rolled_back(self) -> tuple[int, int]:
        """(events, tokens) a continuation regenerates: the trailing run of relayed token events
        with no text, for a text continuation (a token-id one resumes from the ids, exactly); (0, 0)
        otherwise. The class docstring says why."""
        if not self.chat and isinstance(prompt_of(self.body), list):
            return 0, 0
        return self._empty_run, self._empty_run_tokens

    def resume_tokens(self) -> int:
        """The tokens a continuation starts after (:attr:`tokens` minus :meth:`rolled_back`'s)."""
        return self.tokens - self.rolled_back()[1]

    def next_attempt(self) -> None:
        """A continuation is placed: the tokens so far (less the rolled-back ones) are its base; the
        attempt's state resets; the stop-string tail is taken."""
        events, tokens = self.rolled_back()
        self.migrations += 1
        self.tokens -= tokens
        self.base_tokens = self.tokens
        self.replay = events
        self._replay_text = []
        self._empty_run = self._empty_run_tokens = 0
        longest = max((len(x) for x in stop_strings(self.body)), default=0)
        self.stop_tail = self.text()[-(longest - 1):] if longest > 1 else ""
        self._cont_text = ""
        self.new_attempt()

    def feed(self, chunk: bytes) -> bytes:
        """The upstream bytes ``chunk`` of the current attempt -> the bytes to write to the client
        (complete SSE events only; a partial event waits for the next chunk). After an error event
        or ``[DONE]`` the rest of the attempt is dropped."""
        if self.error or self.done:
            return b""
        self._buf += chunk
        out: list[bytes] = []
        while not (self.error or self.done):
            end = self._buf.find(b"\n\n")
            if end < 0:
                break
            raw, self._buf = self._buf[:end + 2], self._buf[end + 2:]
            sent = self._event(raw)
            if sent:
                out.append(sent)
        return b"".join(out)

    def _event(self, raw: bytes) -> bytes:
        if raw.startswith(b"data: ") and raw.count(b"\n") == 2:  # one data line: nearly every event
            data = raw[6:-2]
            if self.migrations == 0 and self.response_id is not None:
                piece = fast_token_text(data, self.chat)
                if piece is not None:  # a plain token event of the first attempt: no JSON parse
                    self._pending.append(piece)
                    if piece:
                        self._empty_run = self._empty_run_tokens = 0
                    else:
                        self._empty_run += 1
                        self._empty_run_tokens += 1
                    self.token_ids = None
                    self.tokens += 1
                    self.events += 1
                    self.attempt_events += 1
                    return raw
        else:
            data = b"".join(line[5:].lstrip() for line in raw.split(b"\n") if line.startswith(b"data:"))
        if not data:
            return raw if raw.strip() else b""  # a comment or an empty keep-alive line: as is
        if data.strip() == _DONE:
            self.done = True
            return b"data: [DONE]\n\n"
        try:
            obj = json.loads(data)
        except ValueError:
            self.events += 1
            self.attempt_events += 1
            return raw  # not JSON: relayed as is, not understood
        if not isinstance(obj, dict):
            self.events += 1
            self.attempt_events += 1
            return raw
        if "error" in obj:
            self.error = True
            err = obj["error"]
            message = err.get("message") if isinstance(err, dict) else err
            self.error_message = message[:200] if isinstance(message, str) else ""
            kind = err.get("type") if isinstance(err, dict) else None
            self.error_type = kind[:64] if isinstance(kind, str) else ""
            return b""
        if self.chat and self.migrations > 0 and _role_only(obj):
            return b""  # the continuation's {"role": "assistant", "content": ""}: the client has one
        if self.migrations > 0 and (self.replay or self._replay_text) and not self._replayed(obj):
            return b""  # a regenerated token the client already counted: its text held for the next event
        self._account(obj)
        if self.migrations == 0:
            self.events += 1
            self.attempt_events += 1
            return raw  # the first attempt: the engine's bytes unchanged
        tail = self._straddling_stop(obj) if self.stop_tail else None
        self.events += 1
        self.attempt_events += 1
        if self.response_id is not None and "id" in obj:
            obj["id"] = self.response_id
        if self.created is not None and "created" in obj:
            obj["created"] = self.created
        usage = obj.get("usage")
        if isinstance(usage, dict):
            obj["usage"] = client_usage(usage, self.base_tokens)
        out = b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"
        if tail is not None:  # a stop string straddled the cut: the stream ends here
            self.cut = self.done = True
            out += tail + b"data: [DONE]\n\n"
        return out

    def _choice(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        """The event's one choice (a dict), or None."""
        choices = obj.get("choices")
        if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict):
            return choices[0]
        return None

    def _get_text(self, choice: Mapping[str, Any]) -> str:
        if self.chat:
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else None
        else:
            text = choice.get("text")
        return text if isinstance(text, str) else ""

    def _set_text(self, choice: dict[str, Any], text: str) -> None:
        if self.chat:
            delta = choice.get("delta")
            delta = dict(delta) if isinstance(delta, dict) else {}
            delta["content"] = text
            choice["delta"] = delta
        else:
            choice["text"] = text

    def _replayed(self, obj: dict[str, Any]) -> bool:
        """A continuation event while tokens are replayed (class docstring): returns False when the
        event is swallowed (counted, its text held), True when it goes on to be relayed, with the
        held text put in front of its own (the replay then ends)."""
        choice = self._choice(obj)
        if choice is None:
            return True
        if self.replay and choice.get("finish_reason") is None and not isinstance(obj.get("usage"), dict):
            self.replay -= 1
            self._replay_text.append(self._get_text(choice))
            self.tokens += self._count(choice)  # the client counted it before the cut (the base stays: the
            return False  # continuation's usage counts it among its own completion tokens)
        self.replay = 0
        held = "".join(self._replay_text)
        self._replay_text = []
        if held:
            self._set_text(choice, held + self._get_text(choice))
        return True

    def _count(self, choice: Mapping[str, Any]) -> int:
        """Tokens one choice event carries (token ids, else logprobs entries, else 1)."""
        ids = choice.get("token_ids")
        if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
            return len(ids)
        return logprob_tokens(choice.get("logprobs")) or 1

    def _straddling_stop(self, obj: dict[str, Any]) -> bytes | None:
        """Check a continuation event's text against the stop strings on the joined text (class
        docstring): None when none straddles the cut; else the event is rewritten to end the stream
        (text cut, ``finish_reason`` ``stop``, ``stop_reason``) and the bytes to send after it are
        returned (a ``usage`` event when the client asked for one, else nothing)."""
        choice = self._choice(obj)
        if choice is None:
            return None
        text = self._get_text(choice)
        stops = stop_strings(self.body)
        start = len(self.stop_tail) + len(self._cont_text)
        joined = self.stop_tail + self._cont_text + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in stops:  # a match from here on ends after the cut; one that starts before it straddles
            at = joined.find(stop, max(0, len(self.stop_tail) - len(stop) + 1))
            if 0 <= at < len(self.stop_tail) and (best is None or at + len(stop) < best[0]):
                best = (at + len(stop), at, stop)
        longest = max((len(x) for x in stops), default=0)
        self._cont_text = (self._cont_text + text)[: max(0, longest - 1)]
        if best is None:
            if len(self._cont_text) >= longest - 1:
                self.stop_tail = ""  # the continuation's text is as long as any stop: none can straddle now
            return None
        end, at, stop = best
        keep_to = end if self.body.get("include_stop_str_in_output") else at
        kept = joined[start:keep_to] if keep_to > start else ""
        self._set_text(choice, kept)
        if text and self.texts and self.texts[-1] == text:  # what _account kept of this event: the cut text
            if kept:
                self.texts[-1] = kept
            else:
                self.texts.pop()
        choice["finish_reason"] = "stop"
        if not self.chat or "stop_reason" in choice:
            choice["stop_reason"] = stop
        self.finish_reason = "stop"
        opts = self.body.get("stream_options")
        if not (isinstance(opts, Mapping) and opts.get("include_usage")):
            return b""
        usage = {"id": obj.get("id"), "object": obj.get("object"), "created": obj.get("created"),
                 "model": obj.get("model"), "choices": [],
                 "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                           "total_tokens": self.prompt_tokens + self.tokens}}
        return b"data: " + json.dumps(usage, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"

    def _account(self, obj: dict[str, Any]) -> None:
        if self.response_id is None and isinstance(obj.get("id"), str):
            self.response_id = obj["id"]
            if isinstance(obj.get("created"), int):
                self.created = obj["created"]
        for choice in obj.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            finish = choice.get("finish_reason")
            if self.chat:
                delta = choice.get("delta")
                delta = delta if isinstance(delta, dict) else {}
                text = delta.get("content")
                text = text if isinstance(text, str) else ""
                if any(delta.get(k) for k in _OPAQUE_DELTA):
                    self.opaque = True  # output the continuation's prompt could not carry
                elif "role" in delta and not text and finish is None:
                    continue  # the role event opens the turn: no token
            else:
                text = choice.get("text")
                text = text if isinstance(text, str) else ""
            ids = choice.get("token_ids")
            before = self.tokens
            if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
                self.tokens += len(ids)
                if self.token_ids is not None:
                    self.token_ids.extend(ids)
            else:
                self.token_ids = None
                counted = logprob_tokens(choice.get("logprobs"))  # one entry per token when asked for
                if counted:
                    self.tokens += counted
                elif text or finish is None:
                    self.tokens += 1
            if text:
                self._empty_run = self._empty_run_tokens = 0
            elif self.tokens > before:
                self._empty_run += 1
                self._empty_run_tokens += self.tokens - before
            if text:
                self._decode_pending()
                self.texts.append(text)
            if finish is not None:
                self.finish_reason = finish


_COMPLETION_TEXT = re.compile(rb'"text":"((?:[^"\\]|\\.)*)"')
_CHAT_TEXT = re.compile(rb'"delta":\{"content":"((?:[^"\\]|\\.)*)"')


def fast_token_text(payload: bytes, chat: bool) -> bytes | None:
    """The text of a plain one-token event read from its bytes (the JSON string's body, still
    escaped), or None when the event needs the full parse: the shapes
    fairbatch_common/openai_stream.py ``fast_event_tokens`` recognises (one choice, a null
    ``finish_reason``, no usage, logprobs, role, reasoning, tool calls or error), without
    ``token_ids``. Sound for the reason given there: generated text cannot hold an unescaped quote."""
    if b'"token_ids"' in payload or fast_event_tokens(payload) is None:
        return None
    m = (_CHAT_TEXT if chat else _COMPLETION_TEXT).search(payload)
    return None if m is None else m.group(1)


def _role_only(obj: Mapping[str, Any]) -> bool:
    """A chat chunk that only opens the assistant turn (role, empty content, no finish)."""
    choices = obj.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        return False
    delta = choices[0].get("delta")
    return (isinstance(delta, dict) and "role" in delta and not delta.get("content")
            and not delta.get("tool_calls") and choices[0].get("finish_reason") is None)


def client_usage(usage: Mapping[str, Any], base_tokens: int) -> dict[str, Any]:
    """A continuation's ``usage`` as the client counts it: its prompt was the original prompt plus
    the ``base_tokens`` relayed before it, so ``prompt_tokens - base_tokens`` is the original prompt
    and ``completion_tokens + base_tokens`` every completion token. Worked: original prompt 10,
    8 tokens sent, continuation usage {prompt 18, completion 4, total 22} -> {10, 12, 22}."""
    out = dict(usage)
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int):
        out["prompt_tokens"] = max(0, prompt - base_tokens)
        out["completion_tokens"] = completion + base_tokens
        out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def stop_strings(body: Mapping[str, Any]) -> tuple[str, ...]:
    """The request's ``stop`` strings (a string or a list of strings; empty ones and other shapes
    dropped)."""
    stop = body.get("stop")
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list):
        return tuple(x for x in stop if isinstance(x, str) and x)
    return ()


def _limit_key(body: Mapping[str, Any]) -> str | None:
    """The field that bounds the output: ``max_completion_tokens`` (chat's newer name, first when set),
    else ``max_tokens``; None when neither is an int."""
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return key
    return None


def remaining_tokens(body: Mapping[str, Any], sent: int) -> int | None:
    """``max_completion_tokens`` / ``max_tokens`` left after ``sent`` tokens (>= 0); None when the
    request gave neither (the engine's default, context - prompt, already shrinks with the longer prompt)."""
    key = _limit_key(body)
    if key is None:
        return None
    return max(0, body[key] - sent)


def _continued_messages(body: Mapping[str, Any], text: str) -> list[Any] | None:
    """``messages`` with the assistant's partial turn: appended as a new assistant message, or, when
    the client already asked to continue its own last assistant message, added to its content."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    out = list(messages)
    last = out[-1]
    if body.get("continue_final_message") and isinstance(last, Mapping) and last.get("role") == "assistant":
        content = last.get("content")
        if not isinstance(content, str):
            return None
        out[-1] = {**last, "content": content + text}
        return out
    out.append({"role": "assistant", "content": text})
    return out


def continuation_body(body: Mapping[str, Any], state: StreamResume) -> dict[str, Any] | None:
    """The continuation's request: the client's ``body`` with ``prompt`` + the output so far
    (token ids when both are ids, else text; chat: ``messages`` + an assistant message with the text,
    ``continue_final_message`` true and ``add_generation_prompt`` false, vLLM's way to continue a
    turn through the chat template), ``max_tokens`` / ``max_completion_tokens`` - tokens sent,
    ``min_tokens`` - tokens sent (>= 0), no ``echo``; everything else (``seed``, ``temperature``, ``stop``, ``logprobs``,
    ``stream_options``, ...) unchanged. None when it cannot be built: a token-id prompt without
    token ids from the engine, or a prompt :func:`prompt_of` refuses.

    Worked: {"prompt": "abcd", "max_tokens": 8, "min_tokens": 2, "seed": 7} after " tok tok tok"
    (3 tokens) -> {"prompt": "abcd tok tok tok", "max_tokens": 5, "min_tokens": 0, "seed": 7}."""
    if state.opaque:
        return None
    if state.chat:
        messages = _continued_messages(body, state.text())
        if messages is None:
            return None
        out = dict(body)
        out["messages"] = messages
        out["continue_final_message"] = True  # vLLM: render the last turn open, no generation prompt
        out["add_generation_prompt"] = False
        return _reduce(out, body, state.resume_tokens())
    prompt = prompt_of(body)
    if prompt is None:
        return None
    out = dict(body)
    if isinstance(prompt, list):
        if state.token_ids is None:
            return None
        out["prompt"] = prompt + state.token_ids
    else:
        out["prompt"] = prompt + state.text()
    out.pop("echo", None)
    return _reduce(out, body, state.resume_tokens())


def _reduce(out: dict[str, Any], body: Mapping[str, Any], sent: int) -> dict[str, Any]:
    """``out`` with the output bound (``max_completion_tokens`` / ``max_tokens``) and ``min_tokens``
    of ``body`` reduced by ``sent`` tokens (>= 0)."""
    for key in ("max_completion_tokens", "max_tokens", "min_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            out[key] = max(0, value - sent)
    return out


def decide_resume(sent: int, left: int | None, finished: bool, migrations: int, max_migrations: int,
                  continuable: bool, prompt_tokens: int, max_prompt: int | None) -> MigrationDecision:
    """Continue a stream whose replica failed mid-stream, or not: the rule on plain numbers (the
    router calls it through :func:`decide`; the fleet simulation, loadgen/fleet/sim.py, calls it
    directly).

    Args:
        sent: completion tokens relayed to the client so far.
        left: ``max_tokens`` left after them (:func:`remaining_tokens`; None: no limit given).
        finished: a ``finish_reason`` was relayed.
        migrations: continuations placed so far.
        max_migrations: ``migration.max_migrations`` (>= 0).
        continuable: a continuation request can be built (:func:`continuation_body` not None).
        prompt_tokens: the original prompt's tokens (the router's count or estimate).
        max_prompt: the largest prompt any replica takes (tokens; None: unknown, not checked).

    Returns:
        in this order: ``complete`` when ``finished`` or nothing is left; ``limit`` at
        ``max_migrations``; ``not-continuable``; ``context`` when prompt + ``sent`` exceeds
        ``max_prompt``; else ``resume``.
    """
    if finished or left == 0:
        return MigrationDecision(False, "complete")
    if migrations >= max_migrations:
        return MigrationDecision(False, "limit")
    if not continuable:
        return MigrationDecision(False, "not-continuable")
    if max_prompt is not None and prompt_tokens + sent > max_prompt:
        return MigrationDecision(False, "context")
    return MigrationDecision(True, "resume")


def continuation_sizes(prompt_tokens: int, max_tokens: int, resumed: int) -> tuple[int, int]:
    """(prompt tokens, max tokens) of a continuation as placement prices it: the prompt grows by the
    ``resumed`` tokens it carries back, the output bound shrinks by them (>= 0). Worked: a 100-token
    prompt, max_tokens 200, cut after 40 -> (140, 160)."""
    return prompt_tokens + resumed, max(0, max_tokens - resumed)


def decide(state: StreamResume, max_migrations: int, prompt_tokens: int, max_prompt: int | None) -> MigrationDecision:
    """Continue ``state`` on another replica, or not: :func:`decide_resume` on its numbers.

    Args:
        state: the stream (its attempt just failed after relaying at least one byte).
        max_migrations: ``migration.max_migrations`` (>= 0).
        prompt_tokens: the original prompt's tokens (the router's count or estimate).
        max_prompt: the largest prompt any replica takes (tokens; None: unknown, not checked).
    """
    left = remaining_tokens(state.body, state.tokens)
    finished = state.finish_reason is not None
    complete = finished or left == 0  # the continuation body is built only when it can matter
    return decide_resume(state.tokens, left, finished, state.migrations, max_migrations,
                         complete or state.migrations >= max_migrations
                         or continuation_body(state.body, state) is not None, prompt_tokens, max_prompt)
