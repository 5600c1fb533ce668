"""Text side of the server: incremental detokenisation with stop strings, and chat templates.

Nothing here touches the model; everything is pure and unit-testable."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

# Used when a checkpoint has no `chat_template` (the embedded default model is a plain
# Python-code model and has none). One block per message, "<role>:\n<content>\n\n", and
# with add_generation_prompt the header of the assistant's turn. Documented in docs/server.md.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}:\n{{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:\n{% endif %}"
)


class StopMatcher:
    """Turns a growing list of generated token ids into text, detecting stop strings.

    feed(ids) consumes ids one at a time (one batch per round when there are no stop
    strings). Text is decoded incrementally: tokens whose text is final are committed, and
    only the last few are re-decoded, with a few tokens of left context so that decoders
    whose output depends on the neighbour (byte-level pieces of one character, leading
    spaces) give the same text as decoding everything at once. Each new piece of text is
    searched for every stop string, including matches that straddle token boundaries. On a
    match the text is cut at the start of the stop string and `stopped` is set; `n_tokens`
    is the number of ids consumed up to and including the one that completed the match
    (the rest of a round is discarded).

    `emittable()` is the text that may be streamed already: everything except a trailing
    part that could still become a stop string, and except a trailing incomplete UTF-8
    sequence (decoded as U+FFFD).

    `drop_ids`: ids that end generation (EOS / stop token ids): counted in n_tokens, never
    shown in the text.
    """

    def __init__(self, decode, stops: list[str] | None = None, drop_ids=()):
        self.decode = decode
        self.stops = [s for s in (stops or []) if s]
        self.drop_ids = set(drop_ids)
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._shown: list[int] = []  # ids that make up the text (drop ids left out)
        self._committed = ""  # text of _shown[:_read]
        self._prefix = 0  # left context for the next decode starts here
        self._read = 0
        self._scan_from = 0

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    def feed(self, new_ids) -> None:
        if self.stopped:
            return
        new_ids = list(new_ids)
        if not self.stops:  # no per-token search needed: one decode per round
            self.ids.extend(new_ids)
            self._shown.extend(t for t in new_ids if t not in self.drop_ids)
            self._redecode()
            return
        for t in new_ids:
            self.ids.append(t)
            if t in self.drop_ids:
                continue
            self._shown.append(t)
            self._redecode()
            if self._search():
                return

    def _redecode(self) -> None:
        ids = self._shown
        before = self.decode(ids[self._prefix: self._read]) if self._read > self._prefix else ""
        now = self.decode(ids[self._prefix:]) if len(ids) > self._prefix else ""
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self._committed += now[len(before):]
            self._prefix, self._read = self._read, len(ids)  # the just-committed tokens are the next context
            self.text = self._committed
        else:  # nothing final yet (an incomplete character, or a token with no text)
            self.text = self._committed + now[len(before):]

    def _search(self) -> bool:
        longest = max(len(s) for s in self.stops)
        start = max(0, self._scan_from - longest - 4)  # a trailing U+FFFD may resolve later
        best = -1
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (best < 0 or i < best):
                best = i
        if best >= 0:
            self.text = self.text[:best]
            self.stopped = True
            return True
        self._scan_from = len(self.text)
        return False

    def emittable(self, final: bool = False) -> str:
        if final or self.stopped:
            return self.text
        text = self.text
        hold = 0
        for s in self.stops:  # longest suffix of text that is a proper prefix of a stop string
            for L in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:L]):
                    hold = L
                    break
        end = len(text) - hold
        while end > 0 and text[end - 1] == "\ufffd":
            end -= 1
        return text[:end]


# --------------------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------------------


def load_chat_template(model_dir: str | Path | None) -> tuple[str, bool, dict]:
    """(template source, whether it is the checkpoint's own, special tokens) for a checkpoint
    directory: tokenizer_config.json's `chat_template` (a string, or a list of named
    templates of which "default" is taken), else chat_template.jinja, else the fallback."""
    specials: dict = {}
    if model_dir is not None:
        d = Path(model_dir)
        cfg_path = d / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                cfg = {}
            for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
                v = cfg.get(key)
                if isinstance(v, dict):
                    v = v.get("content")
                if isinstance(v, str):
                    specials[key] = v
            tpl = cfg.get("chat_template")
            if isinstance(tpl, list):
                named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
                tpl = named.get("default") or next(iter(named.values()), None)
            if isinstance(tpl, str) and tpl:
                return tpl, True, specials
        jinja_path = d / "chat_template.jinja"
        if jinja_path.is_file():
            return jinja_path.read_text(encoding="utf-8"), True, specials
    return FALLBACK_CHAT_TEMPLATE, False, specials


class TemplateError(ValueError):
    """The template refused the conversation (raise_exception) or failed to render."""


class ChatTemplate:
    """Renders a conversation the way transformers' apply_chat_template does: a sandboxed
    jinja2 environment with trim_blocks / lstrip_blocks, the loopcontrols extension, a
    `tojson` filter, and `raise_exception` / `strftime_now` globals."""

    def __init__(self, source: str, specials: dict | None = None):
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(str(message))

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(source)
        self.specials = dict(specials or {})

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        import jinja2

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools, **self.specials, **kwargs)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed to render: {e}") from None
