"""Thinking replies: the reasoning a Qwen3 / Qwen3.5 model writes between ``<think>`` and
``</think>``, split from the answer (OpenAI-style servers return it as
``reasoning_content``; vLLM's ``--reasoning-parser qwen3``).

Two template styles exist:

* Qwen3.5 (and Qwen3 2507 "thinking" models): the generation prompt already ends in
  ``<think>\\n``; the model writes its reasoning, ``</think>``, then the answer. With
  thinking switched off (``chat_template_kwargs: {"enable_thinking": false}``) the prompt
  ends in an empty ``<think>\\n\\n</think>\\n\\n`` and the reply is all answer.
* Qwen3 (first release): the model itself writes ``<think>`` first.

So a reply starts *inside* the reasoning when the generation prompt (the text the template
adds after the messages) leaves a ``<think>`` open, or when the reply starts with
``<think>``. Inside, the reasoning ends at ``</think>`` or at a ``<tool_call>`` that starts
a call (a ``{`` or ``<function=`` follows; Qwen3.5 models sometimes call a tool without
closing their thinking; the call is then answer text, for hyspec.tools to parse). A reply cut while thinking is all
reasoning. The answer's leading whitespace is dropped.

Reasoning ended by a call may still be closed later: the model calls, then writes the
``</think>`` it owed (``<tool_call>...</tool_call>\\n</think>\\n\\nDone.``). The first ``</think>``
of such an answer that stands outside every ``<tool_call>`` ... ``</tool_call>`` block is
dropped, with the whitespace right after it (as the answer's leading whitespace after a
``</think>`` is); one inside a block (in a call's arguments, or in a block never closed) is
left as written. A stream holds back a trailing start of ``</think>`` outside a block."""

from __future__ import annotations

from hyspec.tools import TOOL_CLOSE, TOOL_OPEN, call_follows, partial_tag

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a prompt leaves the reply inside a thinking block. Give it the generation
    prompt's own text (ChatTemplate.generation_suffix), not the whole conversation: a user
    message that mentions ``<think>`` must not count."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def _start(text: str) -> int:
    """Where the reasoning starts: after a ``<think>`` the reply itself opens with."""
    stripped = text.lstrip()
    return len(text) - len(stripped) + len(THINK_OPEN) if stripped.startswith(THINK_OPEN) else 0


def _scan(text: str, start: int, calls_end: bool = True) -> tuple[int, int, int]:
    """(end, after, hold) of reasoning that starts at `start`: the reasoning is
    text[start:end], the answer text[after:]; without an end yet, end = after = len(text).
    `hold`: how far a stream may send the reasoning (not into a tag that may still end it).
    The end is ``</think>``, or a ``<tool_call>`` that starts a call
    (hyspec.tools.call_follows; not with calls_end False: a constrained reply's reasoning
    ends at ``</think>`` only, where its grammar starts); a mere mention of the tag is
    reasoning text."""
    close = text.find(THINK_CLOSE, start)
    pos, call, maybe = start, -1, -1
    while calls_end:
        i = text.find(TOOL_OPEN, pos)
        if i < 0 or (0 <= close < i):
            break
        follows = call_follows(text, i + len(TOOL_OPEN))
        if follows:
            call = i
            break
        if follows is None and maybe < 0:
            maybe = i
        pos = i + len(TOOL_OPEN)
    ends = [x for x in (close, call) if x >= 0]
    if ends:
        end = min(ends)
        return end, end + len(THINK_CLOSE) if end == close else end, end
    hold = len(text) - max(partial_tag(text[start:], THINK_CLOSE), partial_tag(text[start:], TOOL_OPEN))
    return len(text), len(text), min(hold, maybe) if maybe >= 0 else hold


def _stray_close(text: str, pos: int) -> tuple[int, int]:
    """(where, hold) of the first ``</think>`` from `pos` outside every ``<tool_call>`` ...
    ``</tool_call>`` block (a block runs from a ``<tool_call>`` to the next
    ``</tool_call>``; one never closed runs to the end of the text): where = -1 when there
    is none, and then `hold` is where a trailing start of ``</think>`` outside a block
    begins (len(text) when there is none); else hold = where."""
    inside = False
    while True:
        if inside:
            j = text.find(TOOL_CLOSE, pos)
            if j < 0:
                return -1, len(text)
            pos, inside = j + len(TOOL_CLOSE), False
            continue
        i, k = text.find(THINK_CLOSE, pos), text.find(TOOL_OPEN, pos)
        if i >= 0 and (k < 0 or i < k):
            return i, i
        if k < 0:
            return -1, len(text) - partial_tag(text[pos:], THINK_CLOSE)
        pos, inside = k + len(TOOL_OPEN), True


def _answer(text: str, end: int, after: int, final: bool) -> str:
    """The answer of `text` whose reasoning _scan ended at (end, after). Ended by a call
    (after == end < len(text)): the first ``</think>`` outside a call block and the
    whitespace after it are dropped; while not `final`, a trailing start of ``</think>``
    that may still become that tag is held back (the answer so far is a prefix of the
    final one)."""
    if after != end or end == len(text):  # closed by </think>, or no end (yet): all reasoning
        return text[after:].lstrip()
    i, hold = _stray_close(text, after)
    if i >= 0:
        return text[after:i] + text[i + len(THINK_CLOSE):].lstrip()
    return text[after:len(text) if final else hold]


def split_reasoning(text: str, opens: bool, calls_end: bool = True) -> tuple[str | None, str]:
    """(reasoning, answer) of a finished reply; reasoning None when the reply has none.
    calls_end: a ``<tool_call>`` that starts a call ends the reasoning too."""
    if not opens and not text.lstrip().startswith(THINK_OPEN):
        return None, text
    start = _start(text)
    end, after, _ = _scan(text, start, calls_end)
    return text[start:end], _answer(text, end, after, True)


class ReasoningStream:
    """A growing reply, split for streaming: `update(text, final)` (the whole text so far)
    gives the reasoning not yet sent, and sets `answer` to the answer so far (a prefix of
    the final answer, for the content path to stream). While the text might still turn out
    to open with ``<think>``, or ends in what may become a tag that ends the reasoning, that
    part is held back (so is a trailing start of the ``</think>`` that an answer begun by a
    call drops); at the end the pieces equal :func:`split_reasoning`'s."""

    def __init__(self, opens: bool, calls_end: bool = True) -> None:
        self.opens, self.calls_end = opens, calls_end
        self.sent = 0  # characters of reasoning sent
        self.answer = ""

    def update(self, text: str, final: bool) -> str:
        if final:
            reasoning, self.answer = split_reasoning(text, self.opens, self.calls_end)
            delta = (reasoning or "")[self.sent:]
            self.sent += len(delta)
            return delta
        stripped = text.lstrip()
        self.answer = ""
        if THINK_OPEN.startswith(stripped):  # "" or a start of "<think>": where it starts is undecided
            return ""
        if not self.opens and not stripped.startswith(THINK_OPEN):
            self.answer = text
            return ""
        start = _start(text)
        end, after, hold = _scan(text, start, self.calls_end)
        self.answer = _answer(text, end, after, False)
        delta = text[start + self.sent:hold] if hold > start + self.sent else ""
        self.sent += len(delta)
        return delta


__all__ = ["split_reasoning", "ReasoningStream", "prompt_opens_thinking", "THINK_OPEN", "THINK_CLOSE"]
