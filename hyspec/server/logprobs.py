"""Logprobs in OpenAI's two shapes: chat (`content: [{token, logprob, bytes, top_logprobs}]`)
and completions (parallel lists `tokens / token_logprobs / top_logprobs / text_offset`).

An *entry* is (token id, logprob, [(id, logprob), ...] top list); Choice.logprob_entries
gives them for generated tokens, echo prompt entries come from Engine.score."""

from __future__ import annotations

import codecs
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hyspec.server.state import ServerState


def chat_logprobs(state: "ServerState", entries: list) -> dict:
    content = []
    for token_id, logprob, top in entries:
        content.append({"token": state.token_str(token_id), "logprob": logprob,
                        "bytes": list(state.token_bytes(token_id)),  # the token's own bytes (a character
                        # split over tokens: its bytes on each; the token string shows U+FFFD there)
                        "top_logprobs": [{"token": state.token_str(t), "logprob": v,
                                          "bytes": list(state.token_bytes(t))} for t, v in (top or [])]})
    return {"content": content, "refusal": None}


class TextOffsets:
    """Character offsets of tokens in the text the server returns (completions'
    ``text_offset``): a token's offset counts the complete characters before it, from
    `start`. The tokens' raw bytes go through one incremental UTF-8 decoder, so a
    character split over byte tokens counts once, where it completes; special tokens
    (left out of the text) count nothing. A stream keeps one per choice and advances it
    chunk by chunk, so it gives the offsets a whole response gives. `specials`: special
    tokens are in the text and count (an echoed prompt is shown as sent)."""

    def __init__(self, state: "ServerState", start: int = 0, specials: bool = False) -> None:
        self.state, self.chars, self.specials = state, start, specials
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, ids) -> list[int]:
        out = []
        for t in ids:
            if self.specials and self.state.is_special(t):  # an unfinished character before it is one
                self.chars += len(self._utf8.decode(b"", final=True))  # U+FFFD, in the text before it
                out.append(self.chars)
                self.chars += len(self.state.token_str(t))
                continue
            out.append(self.chars)
            if not self.state.is_special(t):
                self.chars += len(self._utf8.decode(self.state.token_bytes(t)))
        return out


def completion_logprobs(state: "ServerState", echo_entries: list, entries: list, offsets: TextOffsets) -> dict:
    """The completions shape over the echoed prompt's entries (offsets from 0; its special
    tokens are in the echoed text) then the generated ones (offsets from `offsets`, advanced
    past them)."""
    tokens, token_logprobs, tops, text_offset = [], [], [], []
    for group, counter in ((list(echo_entries), TextOffsets(state, 0, specials=True)), (list(entries), offsets)):
        text_offset += counter.advance([token_id for token_id, _, _ in group])
        for token_id, logprob, top in group:
            tokens.append(state.token_str(token_id))
            token_logprobs.append(logprob)
            if top is None:
                tops.append(None)
                continue
            alternatives = {state.token_str(t): v for t, v in top}
            # as OpenAI's completions: the chosen token is always among them (up to logprobs + 1),
            # with its own logprob where another id prints alike (byte tokens all print U+FFFD)
            alternatives[state.token_str(token_id)] = logprob
            tops.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": text_offset}
