"""Logprobs in OpenAI's two shapes: chat (`content: [{token, logprob, bytes, top_logprobs}]`)
and completions (parallel lists `tokens / token_logprobs / top_logprobs / text_offset`).

An *entry* is (token id, logprob, [(id, logprob), ...] top list); Choice.logprob_entries
gives them for generated tokens, echo prompt entries come from Engine.score."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hyspec.server.state import ServerState


def chat_logprobs(state: "ServerState", entries: list) -> dict:
    content = []
    for token_id, logprob, top in entries:
        text = state.token_str(token_id)
        content.append({"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")),
                        "top_logprobs": [{"token": state.token_str(t), "logprob": v,
                                          "bytes": list(state.token_str(t).encode("utf-8"))}
                                         for t, v in (top or [])]})
    return {"content": content, "refusal": None}


def completion_logprobs(state: "ServerState", echo_entries: list, entries: list, first_offset: int) -> dict:
    """The completions shape over the echoed prompt's entries then the generated ones;
    text offsets count characters from `first_offset`."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = first_offset
    for token_id, logprob, top in list(echo_entries) + list(entries):
        text = state.token_str(token_id)
        tokens.append(text)
        token_logprobs.append(logprob)
        tops.append(None if top is None else {state.token_str(t): v for t, v in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}
