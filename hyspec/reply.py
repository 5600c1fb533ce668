"""One reply as an OpenAI-style chat API shows it: the reasoning of a thinking model
(hyspec.reasoning) as `reasoning_content`, the answer as `content`, and with tools the calls
(hyspec.tools) as `tool_calls`; whole (`Reply.whole`) or streamed (`Reply.delta`, whose
pieces add up to the whole reply's fields). The server's chat route and Engine.chat use it."""

from __future__ import annotations

from hyspec.reasoning import ReasoningStream, split_reasoning
from hyspec.tools import ToolCall, ToolSpec, ToolStream, parse_forced, parse_tool_calls


class Reply:
    """One choice's text as the chat API shows it. `think`: None when the reply is not
    split (no reasoning parser), else whether it starts inside a thinking block (then a
    constrained output's grammar starts after ``</think>``: hyspec.constraints
    Constraint.after_text). `mode`: off | auto | required |
    named (tools)."""

    def __init__(self, mode: str, tools: ToolSpec | None, think: bool | None, constrained: bool = False) -> None:
        self.mode, self.tools, self.think = mode, tools, think
        self.calls_end = not constrained  # a constrained reply's reasoning ends at </think> only
        self.reasoning = ReasoningStream(think, self.calls_end) if think is not None else None
        self.tool_stream = ToolStream(tools.tools, tools.parallel) if mode == "auto" else None
        self.calls: list[ToolCall] = []  # once final
        self.sent = 0  # characters of answer streamed (off / named)
        self.call_id = ToolCall("", "").id  # a named call's id, streamed with its first piece

    @classmethod
    def of(cls, tools: ToolSpec | None, think: bool | None, constrained: bool = False) -> "Reply":
        """The Reply of a request with these tools (None: none; tool_choice "none" parses
        nothing); constrained: its output runs under a constraint (after the reasoning, if any)."""
        return cls("off" if tools is None or not tools.parses else tools.choice, tools, think, constrained)

    def whole(self, text: str) -> dict:
        """The message of a finished reply."""
        reasoning, answer = split_reasoning(text, self.think, self.calls_end) if self.think is not None \
            else (None, text)
        content = answer
        if self.mode == "auto":
            content, self.calls = parse_tool_calls(answer, self.tools.tools)
            if not self.tools.parallel:  # parallel_tool_calls=false: one call at most
                self.calls = self.calls[:1]
        elif self.mode in ("named", "required"):
            self.calls = parse_forced(answer, self.tools)
            content = "" if self.calls else answer  # an incomplete "required" array stays text
        # (null without text when the reply is calls, or is meant to be: a forced call's stream opens
        # with content null and sends no "" piece, so a forced reply cut before any output is null too)
        msg = {"role": "assistant",
               "content": content if content or not (self.calls or self.mode in ("named", "required")) else None}
        if reasoning:  # (an empty thinking block: no field, as a stream, which never sends an empty piece)
            msg["reasoning_content"] = reasoning
        if self.calls:
            msg["tool_calls"] = [c.openai() for c in self.calls]
        return msg

    def delta(self, text: str, final: bool) -> dict:
        """The delta fields of a stream that has produced `text` so far."""
        out: dict = {}
        answer = text
        if self.reasoning is not None:
            piece = self.reasoning.update(text, final)
            if piece:
                out["reasoning_content"] = piece
            answer = self.reasoning.answer
        if self.mode == "auto":
            piece = self.tool_stream.update(answer, final)
            if piece:
                out["content"] = piece
            stream = self.tool_stream
            if stream.new_calls:  # each call as soon as its block closed
                first = len(stream.calls) - len(stream.new_calls)
                out["tool_calls"] = [c.openai(first + i) for i, c in enumerate(stream.new_calls)]
            if final:
                self.calls = stream.calls
        elif self.mode == "named":  # the output is the arguments: streamed as they come
            piece = answer[self.sent:]
            if piece:
                call = {"index": 0, "function": {"arguments": piece}}
                if self.sent == 0:  # the first piece names the call
                    call = {"index": 0, "id": self.call_id, "type": "function",
                            "function": {"name": self.tools.named.name, "arguments": piece}}
                out["tool_calls"] = [call]
                self.sent = len(answer)
            if final:
                self.calls = [ToolCall(c.name, c.arguments, self.call_id) for c in parse_forced(answer, self.tools)]
        elif self.mode == "required":  # a JSON array: sent whole once complete
            if final:
                self.calls = parse_forced(answer, self.tools)
                if self.calls:
                    out["tool_calls"] = [c.openai(i) for i, c in enumerate(self.calls)]
                elif answer:
                    out["content"] = answer
        else:
            piece = answer[self.sent:]
            if piece:
                out["content"] = piece
                self.sent = len(answer)
        return out


__all__ = ["Reply"]
