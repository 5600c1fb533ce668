"""Chat templates: a checkpoint's `chat_template` rendered the way Hugging Face
transformers renders it, or a documented plain template when the checkpoint has none.

Where the template comes from (first found, as transformers' AutoTokenizer loads it):
  1. chat_template.jinja next to tokenizer_config.json (newer transformers save it there;
     transformers gives it priority over a template entry in the tokenizer config);
  2. tokenizer_config.json "chat_template": a string, or a list of {"name", "template"}
     (the one named "default", else the first);
  3. PLAIN_TEMPLATE: every message's content as is, concatenated, no role markers.
     The embedded default model is a Python *code* model, not an instruction-tuned chat
     model: with the plain template a chat with it is "type code, the model continues it".
     The same fallback serves `hyspec chat` and `hyspec serve` (docs/server.md, docs/sessions.md).

Rendering matches transformers' `apply_chat_template`: a sandboxed (immutable) Jinja
environment with trim_blocks and lstrip_blocks, the loopcontrols extension, a `tojson`
filter, the `raise_exception(message)` and `strftime_now(format)` globals, and the
variables messages, add_generation_prompt, bos_token / eos_token / unk_token / pad_token
(from tokenizer_config.json; a string or an AddedToken dict), tools=None, documents=None,
plus any extra keyword arguments (the server's `chat_template_kwargs`). A message's reasoning
given as `reasoning` or `thinking` also reaches the template as `reasoning_content` (as
transformers aliases them: _alias_reasoning).

This is the one implementation: `hyspec chat` (hyspec/chat.py) and the server
(hyspec/server/state.py, ServerState.render_chat) both use it.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

PLAIN_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


class TemplateError(ValueError):
    """raise_exception() from a template, or a template that does not render."""


def _raise(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=1)
def _generation_tag():
    """A Jinja extension for ``{% generation %}...{% endgeneration %}``, the block some
    templates put around the assistant's text (transformers uses it to find the assistant's
    tokens for training masks and registers it for every template): its body renders as is."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return GenerationTag


@lru_cache(maxsize=16)
def _compile(source: str):
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _generation_tag()])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise TemplateError(f"the chat template does not parse: {e}") from None


def _token_text(v):
    if isinstance(v, dict):
        return v.get("content")
    return v


def load_template(model_dir) -> tuple[str, str, dict]:
    """(template source, where it came from, special tokens {bos_token: ..., ...})."""
    d = Path(model_dir) if model_dir is not None else None
    cfg = {}
    where = None if d is None else d / "tokenizer_config.json"
    if where is not None and where.is_file():  # a damaged one is an error, not the plain template in silence
        try:
            cfg = json.loads(where.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise TemplateError(f"{where}: cannot read it ({type(e).__name__}: {e})") from None
        if not isinstance(cfg, dict):
            raise TemplateError(f"{where}: the top level must be a JSON object")
    special = {k: _token_text(cfg.get(k)) for k in _SPECIAL}
    special = {k: v if isinstance(v, str) else None for k, v in special.items()}
    if d is not None and (d / "chat_template.jinja").is_file():  # (transformers: it wins over the config's)
        try:
            return (d / "chat_template.jinja").read_text(encoding="utf-8"), "chat_template.jinja", special
        except UnicodeDecodeError as e:
            raise TemplateError(f"{d / 'chat_template.jinja'}: not UTF-8 text ({e.reason} at byte {e.start + 1})") \
                from None
    tpl = cfg.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict) and "template" in t}
        if tpl and not named:  # (was: the plain template in silence; transformers fails on such a list too)
            raise TemplateError(f"{where}: chat_template is a list with no {{name, template}} entry")
        tpl = named.get("default") or next(iter(named.values()), None)
    if tpl is not None and not isinstance(tpl, str):
        raise TemplateError(f"{where}: chat_template must be a string (or a list of {{name, template}}), got "
                            f"{type(tpl).__name__}")
    if isinstance(tpl, str) and tpl:
        return tpl, "tokenizer_config.json", special
    return PLAIN_TEMPLATE, "plain", special


def render_chat(messages: list[dict], model_dir, add_generation_prompt: bool = True) -> str:
    """The conversation as the model's prompt text (see the module docstring)."""
    source, _, special = load_template(model_dir)
    return render_template(source, messages, add_generation_prompt, special)


REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names for a turn's reasoning


def _alias_reasoning(message):
    """A message's reasoning under each name templates read, as transformers'
    apply_chat_template passes it: the first of REASONING_FIELDS that is set becomes
    `reasoning_content` (what the Qwen templates read; vLLM's newer API and others send it
    back as `reasoning`) and, unless given, `thinking`."""
    if not isinstance(message, dict):
        return message
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def render_template(source: str, messages: list[dict], add_generation_prompt: bool = True,
                    special: dict | None = None, /, tools=None, **kwargs) -> str:
    """Render `source` (see the module docstring); kwargs are extra template variables (any
    name but `messages`: even "source" or "special" is a template variable here)."""
    import jinja2

    if "messages" in kwargs:
        raise TemplateError("messages is the conversation itself, not an extra template variable")
    variables = {"tools": tools, "documents": None}
    variables.update({k: v for k, v in (special or {}).items() if v is not None})
    variables.update(kwargs)
    if "developer" not in source and any(isinstance(m, dict) and m.get("role") == "developer" for m in messages):
        # OpenAI's "developer" role is its newer name for "system"; a template that never
        # names it (Qwen's: they test role == "system") would drop such a message in silence
        messages = [dict(m, role="system") if isinstance(m, dict) and m.get("role") == "developer" else m
                    for m in messages]
    messages = [_alias_reasoning(m) for m in messages]
    variables.update(messages=messages, add_generation_prompt=add_generation_prompt)
    try:
        return _compile(source).render(variables)  # (a dict: a variable may be called "self")
    except TemplateError:
        raise
    except jinja2.TemplateError as e:
        raise TemplateError(f"the chat template does not render: {e}") from None
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, RecursionError) as e:
        # the template's own Python error ({{ 1 / 0 }}, a str + int, a macro calling itself)
        raise TemplateError(f"the chat template does not render: {type(e).__name__}: {e}") from None


class ChatTemplate:
    """A checkpoint's template, loaded once: `ChatTemplate.for_model(dir).render(messages)`."""

    def __init__(self, source: str, special: dict | None = None, where: str = "given") -> None:
        self.source, self.where = source, where
        self.special = {k: v for k, v in (special or {}).items() if v is not None}
        _compile(source)  # a template that does not parse fails here, not at the first request

    @classmethod
    def for_model(cls, model_dir) -> "ChatTemplate":
        source, where, special = load_template(model_dir)
        try:
            return cls(source, special, where)
        except TemplateError as e:  # which file's template: the error names it
            raise TemplateError(f"{Path(model_dir) / where}: {e}") from None

    @property
    def reads_tools(self) -> bool:
        """Whether the template can show a request's tools to the model (it reads `tools`)."""
        return "tools" in self.source

    @property
    def thinks(self) -> bool:
        """Whether replies may hold a thinking part (the template writes ``</think>``)."""
        return "</think>" in self.source

    @property
    def plain(self) -> bool:
        """True for the fallback (the checkpoint has no template of its own)."""
        return self.where == "plain"

    def render(self, messages: list[dict], /, add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        return render_template(self.source, messages, add_generation_prompt, self.special, tools=tools, **kwargs)

    def generation_suffix(self, prompt: str, messages: list[dict], /, tools=None, **kwargs) -> str:
        """The part of `prompt` (these messages rendered with the generation prompt) that the
        generation prompt added: what hyspec.reasoning.prompt_opens_thinking must look at.
        The whole prompt when the template renders the messages differently without it."""
        kwargs = {k: v for k, v in kwargs.items() if k != "add_generation_prompt"}
        base = self.render(messages, add_generation_prompt=False, tools=tools, **kwargs)
        return prompt[len(base):] if prompt.startswith(base) else prompt


ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # OpenAI's message roles


def normalize_messages(messages) -> list[dict]:
    """OpenAI-style messages as the templates expect them: each a dict with a `role`;
    content None -> "", a list of text parts joined; an assistant message's tool call
    `arguments` given as JSON text parsed into an object (hyspec.tools.template_messages).
    ValueError names the message at fault. The server and Engine.chat_prompt use it."""
    from hyspec.tools import template_messages

    if isinstance(messages, (str, bytes, dict)) or not hasattr(messages, "__iter__"):
        raise ValueError("messages must be a list of {\"role\": ..., \"content\": ...} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string role")
        if message["role"] not in ROLES:
            raise ValueError(f"messages[{i}].role {message['role']!r} is not one of {', '.join(ROLES)}")
        m = dict(message)
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                if kind != "text":
                    raise ValueError(f"messages[{i}]: content parts of type {kind!r} are not supported (text only)")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}]: a text part needs a string \"text\"")
                parts.append(part["text"])
            m["content"] = "".join(parts)
        elif content is None:
            m["content"] = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string, a list of text parts or null")
        out.append(m)
    if not out:
        raise ValueError("messages must not be empty")
    return template_messages(out)


def read_template_file(path, flag: str = "chat template") -> str:
    """The text of a chat template file that exists and parses; ValueError naming `flag`
    (the CLIs check --chat-template before loading a model)."""
    from hyspec.config import input_file

    p = input_file(path, flag)
    try:
        source = p.read_text(encoding="utf-8")
        _compile(source)
    except (TemplateError, UnicodeDecodeError) as e:
        raise ValueError(f"{flag} {path}: {e}") from None
    return source

