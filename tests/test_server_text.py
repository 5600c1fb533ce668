"""Stop-string matching / detokenisation and chat-template rendering as the server uses it
(hyspec/chat_template.py; no server, no model)."""

from __future__ import annotations

import json

import pytest

from hyspec.chat_template import (
    PLAIN_TEMPLATE,
    ChatTemplate,
    TemplateError,
    load_template,
)
from hyspec.engine import DEFAULT_MODEL_DIR
from hyspec.server.text import StopMatcher
from hyspec.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEFAULT_MODEL_DIR)


def _dec(tok):
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def test_stop_string_across_token_boundary(tok):
    text = "def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n"
    ids = tok.encode(text)
    pieces = [tok.decode([t]) for t in ids]
    # a stop string that starts inside one token and ends inside a later one
    k = next(i for i in range(1, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 1)
    start = sum(len(p) for p in pieces[:k]) + 1
    stop = text[start: start + len(pieces[k]) - 1 + 1]
    assert stop and text.find(stop) == start
    m = StopMatcher(_dec(tok), [stop])
    for j in range(0, len(ids), 3):  # rounds of 3 tokens
        m.feed(ids[j: j + 3])
        if m.stopped:
            break
    assert m.stopped and m.text == text[:start]
    assert m.n_tokens == k + 2  # the token that completed the match is counted, later ones are not
    assert m.emittable() == text[:start]
    kept = StopMatcher(_dec(tok), ["@@never@@", stop], include_stop=True)  # include_stop_str_in_output
    for j in range(0, len(ids), 3):
        kept.feed(ids[j: j + 3])
    assert kept.stopped and kept.text == kept.emittable() == text[:start + len(stop)]
    assert kept.n_tokens == k + 2


def test_skip_break_leaves_the_opening_line_break_out_of_a_match(tok):
    """skip_break (hyspec chat's plain template): a line break opening the text is no part of
    a match; the next one is; without it the opening break matches at once."""
    ids = tok.encode("\n    return x\ny = 2\n")
    plain, skipping = StopMatcher(_dec(tok), ["\n"]), StopMatcher(_dec(tok), ["\n"], skip_break=True)
    for m in (plain, skipping):
        for t in ids:
            m.feed([t])
            if m.stopped:
                break
    assert plain.stopped and plain.text == "" and plain.n_tokens == 1
    assert skipping.stopped and skipping.text == "\n    return x"
    other = StopMatcher(_dec(tok), ["\n    return"], skip_break=True)  # (a match holding the break)
    other.feed(ids)
    assert not other.stopped


def test_stop_holdback_and_no_stop(tok):
    text = "x = 1\ny = 2\n"
    ids = tok.encode(text)
    m = StopMatcher(_dec(tok), ["y = 3"])
    m.feed(ids)
    assert not m.stopped and m.text == text
    # streaming never shows a prefix of the stop string before it is ruled out
    m2 = StopMatcher(_dec(tok), ["\ny = 3"])
    m2.feed(tok.encode("x = 1\ny"))
    assert m2.emittable() == "x = 1" and m2.emittable(final=True) == "x = 1\ny"
    # no stop strings: everything is emittable, one decode per feed
    m3 = StopMatcher(_dec(tok), None)
    m3.feed(ids[:2])
    m3.feed(ids[2:])
    assert m3.emittable() == text and m3.n_tokens == len(ids)


def test_drop_final_stop_id_and_incomplete_utf8(tok):
    ids = tok.encode("a = 'é'")
    m = StopMatcher(_dec(tok), [], drop_ids={0})
    m.feed(ids + [0])
    assert m.text == "a = 'é'" and m.n_tokens == len(ids) + 1
    raw = "é".encode()  # two bytes -> two byte-level tokens in this vocabulary
    byte_ids = [t for t in tok.encode("é")]
    if len(byte_ids) == 2:
        m2 = StopMatcher(_dec(tok), [])
        m2.feed(byte_ids[:1])
        assert m2.emittable() == ""  # half a character is held back
        m2.feed(byte_ids[1:])
        assert m2.emittable() == raw.decode()


CHATML = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_chat_template_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    msgs = [{"role": "user", "content": "Write a loop."}, {"role": "assistant", "content": "for i in x:"},
            {"role": "user", "content": "thanks"}]
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    want = hf.apply_chat_template(msgs, chat_template=CHATML, tokenize=False, add_generation_prompt=True)
    assert ChatTemplate(CHATML).render(msgs, add_generation_prompt=True) == want
    # the same template read from a checkpoint's tokenizer_config.json
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    src, where, specials = load_template(tmp_path)
    assert where == "tokenizer_config.json" and src == CHATML and specials["eos_token"] == "<|im_end|>"
    tpl = ChatTemplate.for_model(tmp_path)
    assert not tpl.plain and tpl.render(msgs, add_generation_prompt=True) == want


def test_fallback_template_and_errors():
    src, where, _ = load_template(DEFAULT_MODEL_DIR)  # the default model has no chat template
    assert where == "plain" and src == PLAIN_TEMPLATE
    msgs = [{"role": "user", "content": "def f():\n"}, {"role": "assistant", "content": "    pass"}]
    assert ChatTemplate(src).render(msgs, add_generation_prompt=True) == "def f():\n    pass"  # contents only
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok")
    with pytest.raises(TemplateError, match="user first"):
        strict.render([{"role": "assistant", "content": "x"}])
    with pytest.raises(TemplateError):  # the sandbox refuses attribute games
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])
    with pytest.raises(TemplateError):  # a template that does not parse
        ChatTemplate("{% for %}")
    # chat_template_kwargs reach the template
    t = ChatTemplate("{{ greeting }}{{ messages | length }}{{ add_generation_prompt }}")
    assert t.render([{"role": "user", "content": "x"}], True, greeting="hi") == "hi1True"


def test_a_checkpoints_template_that_does_not_parse_names_its_file(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}{{ m "}))
    with pytest.raises(TemplateError, match=r"tokenizer_config\.json: the chat template does not parse"):
        ChatTemplate.for_model(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(TemplateError, match=r"chat_template\.jinja: the chat template does not parse"):
        ChatTemplate.for_model(tmp_path)


def test_incremental_decode_equals_full_decode(tok):
    """Committed text plus a re-decoded tail equals decoding everything at once, for rounds
    of any size, multi-byte characters included; what is emittable is always a prefix of
    the final text."""
    import random

    text = "naïve = '日本語 ✓ — ok'\nfor x in range(3):\n    print(x, '€')\n"
    ids = tok.encode(text)
    rng = random.Random(0)
    for stops in (None, ["@@"]):
        for _ in range(5):
            m = StopMatcher(_dec(tok), stops, drop_ids={0})
            i, shown = 0, []
            while i < len(ids):
                n = rng.randint(1, 4)
                m.feed(ids[i: i + n])
                i += n
                cur = m.emittable()
                assert text.startswith(cur)
                assert len(cur) >= len(shown)
                shown = cur
            m.feed([0])  # a final EOS: counted, not shown
            assert m.text == tok.decode(ids) == text and m.n_tokens == len(ids) + 1


@pytest.mark.parametrize("text,stops,final", [
    ("aé😀 世界b", ["é😀"], "a"),  # the stop's next character arrives as several byte tokens
    ("abx世界", ["x世"], "ab"),
    ("aé€ ok", ["é😀"], "aé€ ok"),  # a partial match that a multi-byte character then breaks
])
def test_a_stream_never_shows_the_start_of_a_stop_string(tok, text, stops, final):
    """Fed one token at a time, what is emittable is always a prefix of the final text:
    text that may still become a stop string is held back even while the next character
    is incomplete (its bytes split over tokens)."""
    ids = tok.encode(text)
    m = StopMatcher(_dec(tok), stops)
    for t in ids:
        m.feed([t])
        assert final.startswith(m.emittable()), (m.emittable(), final)
        if m.stopped:
            break
    assert m.emittable(final=True) == final


def _chars(ids):
    """A decoder of one character per id (the id's code point): every boundary is a token's."""
    return "".join(map(chr, ids))


def _ids(text):
    return [ord(c) for c in text]


SP_PIECES = ["\u2581hello", "\u2581world", "<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "!"]


def _sentencepiece(ids):
    """The decoder of a SentencePiece vocabulary with byte fallback, as a Llama / Mistral
    tokenizer.json has it: the first token's leading space is stripped, and each byte of an
    incomplete character decodes as one U+FFFD."""
    from tokenizers import decoders

    dec = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                             decoders.Strip(" ", 1, 0)])
    return dec.decode([SP_PIECES[i] for i in ids])


@pytest.mark.parametrize("stops", [None, ["@@"]])
def test_a_sentencepiece_decoder_keeps_its_spaces_and_holds_back_every_byte_of_a_character(stops):
    """A SentencePiece decoder drops the leading space of the first token it decodes, so a
    token re-decoded without its left context lost its space ("helloworld"); and it decodes an
    incomplete character as one U+FFFD per byte: all of them are held back, not only the last."""
    final = "hello world😀!"
    m = StopMatcher(_sentencepiece, stops)
    for t in [0, 1, 2, 3, 4, 5, 6]:
        m.feed([t])
        assert final.startswith(m.emittable()), (m.emittable(), final)
    assert m.text == m.emittable() == final


def test_a_token_that_completes_two_stop_strings_cuts_at_the_earlier_one():
    """One token may complete two stop strings at once: the text is cut before the one that
    starts first (was: the first of the list found, leaving the other in the text)."""
    vocab = ["x", "abc"]
    m = StopMatcher(lambda ids: "".join(vocab[i] for i in ids), ["c", "ab"])
    m.feed([0, 1])
    assert m.stopped and m.text == "x" and m.n_tokens == 2


def test_the_longest_start_of_a_stop_string_is_held_back():
    """A stop string whose start repeats in it ("```"): all of the text that may still become it
    is held back, not only its shortest possible start."""
    m = StopMatcher(_chars, ["```"])
    for c in "x = 1\n```":
        m.feed([ord(c)])
        assert "x = 1\n".startswith(m.emittable()), m.emittable()
    assert m.stopped and m.text == m.emittable() == "x = 1\n"


def test_a_stop_id_is_left_out_of_the_text_without_stop_strings(tok):
    """A stop id that is an ordinary token (stop_token_ids), with no stop strings: counted,
    never shown (the path that decodes once per round took it in)."""
    nl = tok.encode("\n")
    assert len(nl) == 1 and not tok.is_special(nl[0])
    ids = tok.encode("x = 1")
    for stops in (None, ["@@"]):
        m = StopMatcher(_dec(tok), stops, drop_ids=set(nl))
        m.feed(ids + nl)
        assert m.text == m.emittable() == "x = 1" and m.n_tokens == len(ids) + 1


def test_a_stop_string_that_ends_where_the_primed_text_ends_does_not_match():
    """A stop string wholly in the primed text (the earlier part of a reply that goes on) does
    not end the continuation, also when it ends at the primed text's last character; one that
    begins there and ends after it does."""
    m = StopMatcher(_chars, ["END"])
    m.prime(_ids("x END"))
    for t in _ids(" more"):
        m.feed([t])
    assert not m.stopped and m.text == "x END more"
    m = StopMatcher(_chars, ["END"])
    m.prime(_ids("x EN"))
    m.feed(_ids("D more"))
    assert m.stopped and m.n_tokens == len("x END") and m.text == "x "


def _bytes(ids):
    """A byte-level decoder (one byte per id): an incomplete trailing character decodes as U+FFFD."""
    return bytes(ids).decode("utf-8", errors="replace")


def test_an_empty_stop_string_is_ignored_and_a_stopped_text_is_all_emittable():
    """An empty stop string matches nothing (it would end every reply at once); once stopped
    the whole cut text is emittable, a tail that is the start of another stop string too."""
    m = StopMatcher(_chars, ["", "x!", "END"])
    for t in _ids("a = 1"):
        m.feed([t])
    assert not m.stopped and m.text == m.emittable() == "a = 1"
    m.feed(_ids("xEND"))
    assert m.stopped and m.text == m.emittable() == "a = 1x"


def test_the_opening_break_is_emittable_and_skip_break_starts_after_the_primed_text():
    """skip_break: the break that opens the text is no start of a match, so it is not held back;
    after primed text the opening break is the one right after it (not the primed text's first)."""
    m = StopMatcher(_chars, ["\n"], skip_break=True)
    m.feed(_ids("\n"))
    assert not m.stopped and m.emittable() == "\n"
    m = StopMatcher(_chars, ["\n"], skip_break=True)
    m.prime(_ids("hi"))
    m.feed(_ids("\nabc\ndef"))
    assert m.stopped and m.text == "hi\nabc" and m.n_tokens == len("hi\nabc\n")


def test_a_token_with_no_text_does_not_take_the_next_tokens_left_context():
    """A token that decodes to nothing (a special token, skip_special_tokens) is not committed
    as the next token's left context: a SentencePiece decoder decoding "▁world" alone would
    strip its space ("helloworld")."""
    special = 7

    def dec(ids):
        return _sentencepiece([i for i in ids if i != special])

    m = StopMatcher(dec, ["@@"])
    for t in [0, special, 1]:
        m.feed([t])
    assert m.text == m.emittable() == "hello world"


def test_a_character_cut_in_its_bytes_is_not_a_u_fffd_for_stop_strings():
    """A stop string of U+FFFD (a client stopping on undecodable output) is not met by a
    character whose bytes arrive over two tokens; a real U+FFFD meets it."""
    m = StopMatcher(_bytes, ["\ufffd"])
    for b in "é!".encode():
        m.feed([b])
    assert not m.stopped and m.text == "é!"
    m = StopMatcher(_bytes, ["\ufffd"])
    m.feed(list("a\ufffdb".encode()))
    assert m.stopped and m.text == "a" and m.n_tokens == 5  # (decided by the token after it)


def test_after_primed_tokens_that_end_in_an_undecided_character():
    """Primed tokens that end in a character's first byte: a stop string that the next token
    completes ends after the primed text (it matches); primed text that ends in a real U+FFFD:
    a stop string wholly in it does not match."""
    m = StopMatcher(_bytes, ["é"])
    m.prime(list("x ".encode()) + ["é".encode()[0]])
    m.feed(["é".encode()[1]] + list(b" more"))
    assert m.stopped and m.text == "x " and m.n_tokens == len("x é".encode())
    m = StopMatcher(_chars, ["x\ufffd"])
    m.prime(_ids("x\ufffd"))
    m.feed(_ids("ab"))
    assert not m.stopped and m.text == "x\ufffdab"
