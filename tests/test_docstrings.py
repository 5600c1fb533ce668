"""The public API's docstrings read as written: no escape sequence turned into a control
character inside a code span (help() showed Session.send's `--stop "\\n"` broken over two lines)."""

import inspect
import re

from hyspec import Engine, PrefixStore, SamplingParams, Session, SpecOptions


def _docs():
    for cls in (Engine, Session, PrefixStore, SamplingParams, SpecOptions):
        yield cls.__qualname__, cls.__doc__ or ""
        for name, member in vars(cls).items():
            f = getattr(member, "__func__", member)
            if isinstance(member, property):
                f = member.fget
            if callable(f) and (f.__doc__ or ""):
                yield f"{cls.__qualname__}.{name}", f.__doc__


def test_code_spans_hold_no_control_characters():
    """(`from hyspec import PrefixStore` too: the sessions docs name it so)"""
    docs = list(_docs())
    assert len(docs) > 40
    for where, doc in docs:
        for span in re.findall(r"`([^`]*)`", inspect.cleandoc(doc)):
            # a span may wrap at a line end between words, never split a quoted string
            assert not re.search(r"[\"']\s*\n\s*[\"']", span), f"{where}: code span {span!r}"
