"""Thinking replies: the reasoning a Qwen3 / Qwen3.5 model writes between ``<think>`` and
``</think>``, split from the answer (OpenAI-style servers return it as
``reasoning_content``; vLLM's ``--reasoning-parser qwen3``).

Two template styles exist:

* Qwen3.5 (and Qwen3 2507 "thinking" models): the generation prompt already ends in
  ``<think>\\n``; the model writes its reasoning, ``</think>``, then the answer. With
  thinking switched off (``chat_template_kwargs: {"enable_thinking": false}``) the prompt
  ends in an empty ``<think>\\n\\n</think>\\n\\n`` and the reply is all answer.
* Qwen3 (first release): the model itself writes ``<think>`` first.

So a reply starts *inside* the reasoning when the prompt's last ``<think>`` is not closed,
or when the reply starts with ``<think>``. Inside, the reasoning ends at ``</think>`` or at
a ``<tool_call>`` (Qwen3.5 models sometimes call a tool without closing their thinking;
the call is then answer text, for hyspec.tools to parse). A reply cut while thinking is all
reasoning. The answer's leading whitespace is dropped."""

from __future__ import annotations

from hyspec.tools import TOOL_OPEN, partial_tag

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt leaves the reply inside a thinking block."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def _start(text: str) -> int:
    """Where the reasoning starts: after a ``<think>`` the reply itself opens with."""
    stripped = text.lstrip()
    return len(text) - len(stripped) + len(THINK_OPEN) if stripped.startswith(THINK_OPEN) else 0


def split_reasoning(text: str, opens: bool) -> tuple[str | None, str]:
    """(reasoning, answer) of a finished reply; reasoning None when the reply has none."""
    if not opens and not text.lstrip().startswith(THINK_OPEN):
        return None, text
    start = _start(text)
    ends = [i for i in (text.find(THINK_CLOSE, start), text.find(TOOL_OPEN, start)) if i >= 0]
    if not ends:
        return text[start:], ""
    end = min(ends)
    after = end + len(THINK_CLOSE) if text.startswith(THINK_CLOSE, end) else end
    return text[start:end], text[after:].lstrip()


class ReasoningStream:
    """A growing reply, split for streaming: `update(text, final)` (the whole text so far)
    gives the reasoning not yet sent, and sets `answer` to the answer so far (a prefix of
    the final answer, for the content path to stream). While the text might still turn out
    to open with ``<think>``, or ends in what may become a closing tag, that part is held
    back; at the end the pieces equal :func:`split_reasoning`'s."""

    def __init__(self, opens: bool) -> None:
        self.opens = opens
        self.sent = 0  # characters of reasoning sent
        self.answer = ""

    def update(self, text: str, final: bool) -> str:
        if final:
            reasoning, self.answer = split_reasoning(text, self.opens)
            delta = (reasoning or "")[self.sent:]
            self.sent += len(delta)
            return delta
        stripped = text.lstrip()
        if not self.opens:
            if THINK_OPEN.startswith(stripped):  # "" or a start of "<think>": undecided
                self.answer = ""
                return ""
            if not stripped.startswith(THINK_OPEN):
                self.answer = text
                return ""
        start = _start(text)
        ends = [i for i in (text.find(THINK_CLOSE, start), text.find(TOOL_OPEN, start)) if i >= 0]
        if ends:
            end = min(ends)
            after = end + len(THINK_CLOSE) if text.startswith(THINK_CLOSE, end) else end
            self.answer = text[after:].lstrip()
        else:
            end = len(text) - max(partial_tag(text[start:], THINK_CLOSE), partial_tag(text[start:], TOOL_OPEN))
            self.answer = ""
        delta = text[start + self.sent:end] if end > start + self.sent else ""
        self.sent += len(delta)
        return delta


__all__ = ["split_reasoning", "ReasoningStream", "prompt_opens_thinking", "THINK_OPEN", "THINK_CLOSE"]
