"""Text in, text out over a `Session`: each user turn through the tokenizer's chat template, the reply
generated token by token with incremental detokenization and stop strings, and `Chat`, the conversation
(or plain completion) object of the library.

Model-agnostic: everything takes a ready Session and a transformers-style tokenizer (`encode`, `decode`,
`apply_chat_template`). The decode command's chat (rsqr_jax.cli.chat) runs its turns through the same
functions, so a library reply and a command-line reply are the same tokens.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

__all__ = ["Chat", "ChatFeed", "Pins", "TextStream", "generate_reply", "has_chat_template", "system_prompt_text"]


class ChatFeed:
    """Turns a growing conversation into the exact text still to feed, via the model's chat template."""

    def __init__(self, tokenizer, messages: list[dict] | None = None, fed_text: str = ""):
        self.tok = tokenizer
        self.messages: list[dict] = list(messages or [])
        self.fed_text = fed_text

    def user_turn(self, content: str) -> list[int]:
        return self.tok.encode(self.user_turn_text(content), add_special_tokens=False)

    def user_turn_text(self, content: str) -> str:
        """The text still to feed for a new user turn (what `user_turn` tokenizes)."""
        self.messages.append({"role": "user", "content": content})
        full = self.tok.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
        if full.startswith(self.fed_text):
            new = full[len(self.fed_text):]
        else:  # the template rewrote earlier text: close the turn and render only the new message
            new = self.tok.apply_chat_template(self.messages[-1:], tokenize=False, add_generation_prompt=True)
        self.fed_text = full
        return new

    def assistant_reply(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})
        self.fed_text += text


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def system_prompt_text(tokenizer, system: str | None) -> str:
    """The text a conversation opens with for its system prompt, as the chat template renders it ("" if the
    template adds none). system None: the template's own default system prompt, if it has one (found as what
    the template renders before the user turn's header)."""
    render = tokenizer.apply_chat_template
    probe = "\u2063probe\u2063"  # a user turn no template rewrites
    with_system = [{"role": "system", "content": "x" if system is None else system}]
    sys_text = render(with_system, tokenize=False, add_generation_prompt=False)
    first = render(with_system + [{"role": "user", "content": probe}], tokenize=False, add_generation_prompt=True)
    if not first.startswith(sys_text):
        raise ValueError("the chat template does not open a conversation with its system prompt: nothing to pin")
    if system is not None:
        return sys_text
    header = first[len(sys_text):first.index(probe)]
    plain = render([{"role": "user", "content": probe}], tokenize=False, add_generation_prompt=True)
    i = plain.find(header) if header else -1
    return plain[:i] if i > 0 else ""


@dataclasses.dataclass(frozen=True)
class Pins:
    """What a conversation pins from its start, kept forever, exactly: the first `keep`
    tokens of the stream (llama.cpp's n_keep), the system prompt (`system`), or the whole first prompt, system
    prompt and first user turn (`first_turn`). All three are prefixes of the stream: the longest one is pinned."""

    keep: int = 0
    system: bool = False
    first_turn: bool = False

    def __post_init__(self):
        if isinstance(self.keep, bool) or not isinstance(self.keep, int) or self.keep < 0:
            raise ValueError(f"keep must be an integer >= 0, got {self.keep!r}")

    def __bool__(self) -> bool:
        return bool(self.keep or self.system or self.first_turn)

    def system_tokens(self, tokenizer, system: str | None) -> int:
        """Tokens of the rendered system prompt (0 unless `system`)."""
        if not self.system:
            return 0
        text = system_prompt_text(tokenizer, system)
        return len(tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def room(self, tokenizer, system: str | None, first_turn_room: int = 0) -> int:
        """The pinned tokens a session needs room for (CacheSpec.pins): first_turn_room stands for the first
        turn, whose length is known only when it is sent."""
        return max(self.keep, self.system_tokens(tokenizer, system), first_turn_room if self.first_turn else 0)

    def count(self, tokenizer, first_ids: list[int], system: str | None) -> int:
        """Tokens to pin from the stream's start, given the first prompt's token ids."""
        n = max(self.keep, len(first_ids) if self.first_turn else 0)
        if self.system:
            k = self.system_tokens(tokenizer, system)
            sys_ids = tokenizer.encode(system_prompt_text(tokenizer, system), add_special_tokens=False) if k else []
            same = next((i for i, (a, b) in enumerate(zip(sys_ids, first_ids)) if a != b), min(k, len(first_ids)))
            n = max(n, same)  # the system prompt's tokens as the stream holds them
        return n

    def apply(self, session, tokenizer, first_ids: list[int], system: str | None) -> None:
        """Pin the start of a new stream (nothing fed yet) before `first_ids` are fed; PinError (one line)
        past the session's room, before anything is fed."""
        if self and session.n_tokens == 0:
            session.pin_next(self.count(tokenizer, first_ids, system))


class TextStream:
    """Incremental detokenization: each new token decodes only a short tail of the reply (not the whole
    reply again), and text that ends inside a multi-byte character (U+FFFD) is held back until it is whole.
    The concatenated deltas equal decoding the whole reply at once."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # start of the tail that is decoded again
        self._read = 0  # tokens whose text has been emitted
        self.text = ""

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """The new text this token completes ("" if it completes none yet)."""
        self.ids.append(int(token))
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        rest = self._decode(self.ids[self._prefix:])[len(self._decode(self.ids[self._prefix:self._read])):]
        self._prefix = self._read = len(self.ids)
        self.text += rest
        return rest

def _find_stop(text: str, stop: tuple[str, ...], start: int) -> int:
    hits = [i for s in stop if (i := text.find(s, start)) >= 0]
    return min(hits) if hits else -1


def generate_reply(session, tokenizer, max_new_tokens: int, stop: tuple[str, ...] = (),
                   emit: Callable[[str], None] | None = None, with_ids: bool = False):
    """Generate one reply token by token: (text, tokens generated, stop reason "eos" / "stop" / "length"),
    and with_ids the emitted token ids too (the end-of-sequence one excluded).

    Each token is detokenized incrementally and handed to `emit` as soon as it cannot be the start of a stop
    string; a stop string ends the reply (the text is cut before it)."""
    emit = emit or (lambda s: None)
    stream = TextStream(tokenizer)
    hold = max((len(s) for s in stop), default=1) - 1
    shown, n, reason = 0, 0, "length"
    while n < max_new_tokens and session.pending is not None:
        token = session.generate(1)[0]
        n += 1
        if token in session.eos_ids:
            reason = "eos"
            break
        stream.push(token)
        if stop:
            at = _find_stop(stream.text, stop, max(0, shown - hold))
            if at >= 0:
                emit(stream.text[shown:at])
                return (stream.text[:at], n, "stop") + ((stream.ids,) if with_ids else ())
        safe = len(stream.text) - hold
        if safe > shown:
            emit(stream.text[shown:safe])
            shown = safe
    stream.flush()
    text = stream.text
    if stop and (at := _find_stop(text, stop, max(0, shown - hold))) >= 0:
        text, reason = text[:at], "stop"
    emit(text[shown:])
    return (text, n, reason) + ((stream.ids,) if with_ids else ())


class Chat:
    """A conversation with a model under a bounded cache: `send(text)` feeds a user turn through the chat
    template and returns the reply; `complete(text)` feeds plain text and returns its continuation. Both
    stream into the one session, so the cache stays bounded by its policy however long the chat runs; a
    Chat is a conversation or a completion, not both (the template's text and raw text would interleave).

    system: the system prompt of the conversation. max_new_tokens / stop: each reply's defaults (a stop
    string ends a reply and is cut off). pins: what the conversation pins from its start (`Pins`; the session
    needs room for them, `pins=` of its creation). `on_text`, given to a call, sees the reply's text as it grows.
    After each call `stop_reason` is "eos", "stop" or "length" and `n_generated` the tokens it generated.
    """

    def __init__(self, session, tokenizer, *, system: str | None = None, max_new_tokens: int = 256,
                 stop: tuple[str, ...] = (), pins: Pins | None = None):
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        self.session, self.tokenizer = session, tokenizer
        self.system, self.max_new_tokens, self.stop = system, max_new_tokens, tuple(stop)
        self.pins = Pins() if pins is None else pins
        self.stop_reason: str | None = None
        self.n_generated = 0
        self.reset(cache=False)

    @property
    def messages(self) -> list[dict]:
        """The conversation so far (system prompt, user turns, replies), as the chat template sees it."""
        return self._feed.messages

    def reset(self, *, cache: bool = True) -> None:
        """Forget the conversation (and, with cache, empty the session's cache)."""
        if cache:
            self.session.reset()
        self._feed = ChatFeed(self.tokenizer, [{"role": "system", "content": self.system}] if self.system else [])
        self._mode: str | None = None

    def send(self, text: str, *, max_new_tokens: int | None = None, stop: tuple[str, ...] | None = None,
             on_text: Callable[[str], None] | None = None) -> str:
        """The model's reply to a user turn (fed through the tokenizer's chat template)."""
        if not has_chat_template(self.tokenizer):
            raise ValueError("the tokenizer has no chat template: use complete() for plain text")
        self._enter("chat")
        before = (list(self._feed.messages), self._feed.fed_text)
        ids = self._feed.user_turn(text)
        try:
            self.pins.apply(self.session, self.tokenizer, ids, self.system)
        except ValueError:  # nothing was fed: the conversation stays as it was
            self._feed.messages, self._feed.fed_text = before
            raise
        reply = self._reply(ids, max_new_tokens, stop, on_text)
        self._feed.assistant_reply(reply)
        return reply

    def complete(self, text: str, *, max_new_tokens: int | None = None, stop: tuple[str, ...] | None = None,
                 on_text: Callable[[str], None] | None = None) -> str:
        """The continuation of `text` (fed as plain text after everything fed so far)."""
        self._enter("completion")
        ids = self.tokenizer.encode(text)
        dataclasses.replace(self.pins, system=False).apply(self.session, self.tokenizer, ids, None)  # no template
        return self._reply(ids, max_new_tokens, stop, on_text)

    def _enter(self, mode: str) -> None:
        if self._mode not in (None, mode):
            used, new = ("send", "complete") if self._mode == "chat" else ("complete", "send")
            raise ValueError(f"this Chat streams a {'conversation' if self._mode == 'chat' else 'completion'} "
                             f"(send and complete do not mix): reset() before {new}() after {used}()")
        self._mode = mode

    def _reply(self, ids, max_new_tokens, stop, on_text) -> str:
        self.session.feed(ids)
        n = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        text, self.n_generated, self.stop_reason = generate_reply(self.session, self.tokenizer, n,
                                                                  self.stop if stop is None else tuple(stop),
                                                                  on_text)
        return text
