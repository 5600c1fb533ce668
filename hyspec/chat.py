"""`hyspec chat`: an interactive terminal chat over a session (hyspec/session.py).

Each line you type is a user message; the reply streams as rounds commit. The
conversation's state is kept between turns, so a turn prefills only the new text.
Commands:
    /rewind [N]   back to the exact state before the last N turns (default 1)
    /reset        start over (same settings)
    /stats        the last turn's figures and the acceptance over the turns in the conversation (a
                  rewound turn no longer counts), the prefix store, the state digest (JSON)
    /save FILE    write the session (state, rewind points, messages) to FILE
    /load FILE    continue a saved session (in this or any later process; its settings replace the flags)
    /paste        the lines that follow, up to one that is only /end (or Ctrl-D), are one message, as
                  typed (empty lines and lines starting with "/" included)
    /retry [SEED] the last message again, for another reply: its reply (continued parts too) is
                  undone and drawn anew with a new seed (a random one, shown; or SEED), sampling only
                  (a greedy reply would be the same)
    /quit         leave (end of input, Ctrl-D, too)
A line starting with "//" is sent as a message starting with "/" (the first "/" dropped).
--system TEXT opens the conversation (and each one after /reset) with a system message.
An empty line continues the reply (sends nothing new; the pending token runs first); the
continuation is shown on the reply's line (on a terminal its last line is drawn again below
the prompt), for a reply cut by --max-new-tokens and, with the plain template, for one ended
by a stop string or EOS too. With a chat template only a cut
reply goes on (an empty message would end it). Ctrl-C during a reply stops it after the
round in flight and keeps it as it stands, as a cut reply (an empty line continues it,
/rewind drops it); a second Ctrl-C before that round ends stops at once and undoes the
turn. At the prompt Ctrl-C only says how to leave.

The prompt text is the conversation rendered with the checkpoint's chat template
(hyspec/chat_template.py; the plain template when the checkpoint has none: the embedded
default model is a code model, so its chat is "type code, the model continues it": a line
is sent as typed, after a line break when the transcript does not end with one, so the
model continues the line itself (a line sent with its own trailing newline ends on a bare
"\n" token, which the tokenizer merges with the next line's indentation in the text the model
learnt from: "def f(x):\n" drew unrelated text, "def f(x):" the function's body). A turn
sends only the text the template adds after what the session already holds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import unicodedata
from pathlib import Path

from hyspec.chat_template import ChatTemplate, read_template_file, render_template
from hyspec.interrupt import stop_on_ctrl_c

HELP = ("commands: /rewind [N]  /retry [SEED]  /reset  /stats  /save FILE  /load FILE  "
        "/paste (lines up to /end: one message)  /help  /quit (or /exit)  (//text sends /text)")


class Chat:
    def __init__(self, engine, session, model_dir=None, out=sys.stdout, err=sys.stderr) -> None:
        self.eng, self.session, self.out, self.err = engine, session, out, err
        # the engine's template (the server's too: --chat-template, the EOS default), unless another
        # checkpoint directory is named
        same = model_dir is None or Path(model_dir).resolve() == Path(engine.model_dir).resolve()
        tpl = engine.chat_template if same else ChatTemplate.for_model(model_dir)
        self.template, self.template_source, self.special = tpl.source, tpl.where, tpl.special
        self.plain = self.template_source == "plain"
        self.template_kwargs: dict = {}  # extra template variables (--chat-template-kwargs)
        self.stop: list[str] = []  # stop strings (--stop): a reply ends with the token completing one
        self.system: list[dict] = []  # the messages every conversation opens with (--system: a system message)
        self.messages: list[dict] = []
        self.rendered = ""  # the text the session's tokens stand for
        self.cut = False  # the last reply was cut by max_new_tokens: an empty line continues it
        self.stack: list[tuple[list[dict], str, bool]] = []  # (messages, rendered, cut) before each turn
        # the sessions a template's re-render replaced (see user), oldest first, each with its
        # stack and parked (no slot): /rewind goes back into them
        self.previous: list[tuple[object, list]] = []
        # The screen: the line of a reply that an empty line continues (a cut one; with the
        # plain template any) stays open, so that the continuation follows it on the same line
        # (on a terminal, the line is drawn again below the prompt).
        self._line: list[int] | None = None  # the tokens of the reply whose text ends the screen
        self._shown = 0  # how much of its text is on screen (an incomplete UTF-8 sequence waits)
        # the plain template's reply to a line usually opens with the line's break: the typed
        # line (on a terminal) or the last reply (a pipe) already ended there, so it is not drawn
        self._skip_break = False
        self._open = False  # the cursor is still right after that text (no line break yet)
        self._typed: str | None = None  # the line typed on a terminal for this reply (its echo ends the row)

    def render(self, messages, gen: bool) -> str:
        return render_template(self.template, messages, gen, self.special, **self.template_kwargs)

    def say(self, line: str) -> None:
        self.end_line()
        print(line, file=self.out, flush=True)

    # -- the screen --------------------------------------------------------------------
    def _show(self, final: bool = False) -> None:
        """Write what is not yet on screen of the reply's text (all of it when final; else up
        to an incomplete UTF-8 sequence, which waits for the next tokens)."""
        text = self.eng.tokenizer.decode(self._shown_tokens())  # (generated ids: no checks per round)
        if self._skip_break and text:  # a new reply's first line break: the screen is on a new line already
            self._skip_break = False
            if text.startswith("\n") and self._shown == 0:
                self._shown = 1
            elif self._shown == 0 and self._typed is not None:  # the reply goes on the typed line itself:
                self._after_typed_line()  # drawn after it, not on the row below (where the Enter left the cursor)
        upto = len(text) if final else len(text.rstrip("\ufffd"))
        if upto > self._shown:
            self.out.write(text[self._shown:upto])
            self.out.flush()
            self._shown = upto
        self._open = True

    def _shown_tokens(self) -> list[int]:
        """The reply's tokens as shown: with a chat template, without the stop token that
        ended it (its text, e.g. <|im_end|>, is not part of the reply; the record leaves it
        out too); the plain template's text is the transcript itself, shown whole."""
        line = self._line
        if line and not self.plain and line[-1] in self.eng._stops(self.session.stop_ids, self.session.ignore_eos):
            return line[:-1]
        return line

    def end_line(self) -> None:
        """End an open reply line: what comes next starts on a new line."""
        if self._line is not None and self._open:
            self._show(final=True)
            self.out.write("\n")
            self.out.flush()
        self._line, self._open = None, False

    def prompt(self, marker: bool = True) -> None:
        """A terminal's input prompt. After a cut reply, on its own line; an empty line then
        draws the reply's last line again in its place (see user). marker False: all but the
        "> " itself (which the line editor then writes: input("> "))."""
        keep = self._line is not None and self._open and _is_terminal(self.out)
        line = self._line
        self.end_line()
        if keep:
            self._line = line
        if marker:
            self.out.write("> ")
        self.out.flush()

    def _columns(self) -> int:
        """The terminal's width (80 where it cannot be read)."""
        try:  # (a terminal that reports no size, 0 columns: 80, not one row per character)
            return os.get_terminal_size(self.out.fileno()).columns or 80
        except (AttributeError, OSError, ValueError):
            return 80

    def _after_typed_line(self) -> None:
        """Move the cursor back up to the end of the line typed on the terminal (the prompt and
        the line: its echo's last row, then the column after it)."""
        cols = self._columns()
        width = display_width(("> " + self._typed).expandtabs())
        if cols > 0 and width % cols:  # (a line that filled its last row exactly: the next row is right)
            self.out.write(f"\x1b[1F\x1b[{width % cols + 1}G")

    def _redraw(self) -> None:
        """Back over the prompt and the empty line typed to the cut reply's last line, which is
        drawn again: the continuation follows it there."""
        text = self.eng.tokenizer.decode(self._shown_tokens())  # (generated ids: no checks per round)
        start = text.rfind("\n") + 1
        cols = self._columns()
        rows = max(1, -(-display_width(text[start:].expandtabs()) // max(1, cols)))  # the rows the line took
        self.out.write(f"\x1b[{rows + 1}F\x1b[J")  # up to its first row (and the prompt's), cleared
        self._shown = start
        self._show()

    # -- a turn ------------------------------------------------------------------------
    def user(self, text: str, typed: str | None = None, cancel=None, params=None, recorded: bool = False) -> dict:
        """Send one input line (an empty one: the reply goes on, nothing new is sent). Returns
        the turn's stats ({} when there was nothing to continue). typed: the line as a
        terminal echoed it after the prompt (None: no echo, e.g. piped input); a reply that
        goes on on that line is drawn after it. cancel: a callable () -> bool asked after each
        round (Session.send's): once True the reply stops there and is kept, as a cut one.
        params: this turn's SamplingParams (None: the session's). recorded: text is a message
        as the record holds it (/retry), sent as it is (the plain template's line break
        before it included)."""
        eng, session = self.eng, self.session
        go_on = not text
        if go_on and not (session.tokens and (self.plain or self.cut)):
            # (with a chat template an empty message would end the reply: only a cut one goes on)
            self.say("[nothing to continue: type a message]" if not session.tokens else
                     "[nothing to continue: the last reply is complete; type a message]")
            return {}
        restart = False  # the template re-renders the past differently: the turn runs on a new session
        if go_on:
            messages_now, full, ids = self.messages, self.rendered, []
        else:
            # the transcript so far: the chat's record, or (a session loaded without one, or rewound
            # into turns before it) the session's own tokens, the last few decoded
            before_text = self.rendered or (eng.decode(session.tokens[-4:]) if session.tokens else
                                            self.render(self.messages, False) if self.messages else "")
            if self.plain and not recorded and before_text and not before_text.endswith("\n"):
                text = "\n" + text  # a new line of the transcript (see the module doc)
            messages_now = self.messages + [{"role": "user", "content": text}]
            full = self.render(messages_now, True)
            if session.tokens and full.startswith(self.rendered):
                ids = eng.encode(full[len(self.rendered):])
            else:  # first turn, or a new start from the whole text (kept apart until the turn succeeds)
                restart = bool(session.tokens)
                if restart:
                    session = session.empty_copy()
                ids = eng.encode(full)
        # a turn's reply is capped to the room the model's context leaves (as generate caps
        # --max-new-tokens); with none left the turn is refused, the conversation kept
        room = eng.context_length - len(session.tokens) - len(ids)
        if room < 1:
            if restart:
                session.close()
            held, ctx = len(session.tokens), eng.context_length
            if session.tokens and ctx - held <= 1:  # (not even a one-token message and its reply fit)
                self.say(f"[the conversation fills the model's context of {ctx} tokens: /rewind or /reset]")
            elif session.tokens and len(ids) < ctx:  # (the message alone leaves room)
                self.say(f"[the message is {len(ids)} tokens: the conversation holds {held} of the model's "
                         f"context of {ctx} tokens, which leaves {ctx - held - 1} for a message with room for a "
                         f"reply; shorten it, /rewind or /reset]")
            else:  # (the message is the whole prompt: /rewind or /reset cannot make room for it)
                what = "the message with the conversation before it, rendered anew," if restart else "the message"
                self.say(f"[{what} is {len(ids)} tokens: the model's context is {eng.context_length} tokens, "
                         f"with room for a reply; shorten it{' or /rewind' if restart else ''}]")
            return {}
        limit = min(session.max_new_tokens, room)
        if go_on and self._line is not None:  # the cut reply's continuation: on its line
            if not self._open:  # (a terminal: the prompt and the empty line came after it)
                self._redraw()
            reply = self._line
        else:
            self.end_line()
            reply = self._line = []
            self._shown, self._skip_break = 0, self.plain
            # on a terminal the typed line ends its row (the echo of its Enter); a pipe's has no echo
            self._typed = typed if self.plain and typed is not None and _is_terminal(self.out) else None
        turns, held = session.num_turns, len(session.tokens)

        def stream(new):
            reply.extend(new)
            self._show()

        before = (list(self.messages), self.rendered, self.cut)
        try:
            out = session.send(ids, on_tokens=stream, stop=self.stop or None, max_new_tokens=limit,
                               stop_skips_opening_break=self.plain and not go_on, cancel=cancel, params=params)
        except BaseException:
            if restart:  # the old conversation stays, whole
                session.close()
            elif session.num_turns > turns:  # failed mid-turn, the rounds before kept: the chat keeps them too
                self._record(before, messages_now, full, go_on, session.tokens[held + len(ids):], True)
            raise
        if restart:  # the old session is kept aside, parked: /rewind past this turn goes back to it
            self.session.park()
            self.previous.append((self.session, self.stack))
            self.session, self.stack = session, []
        reason = out.samples[0].stop_reason
        cut = reason in ("length", "cancelled")  # (stopped by a Ctrl-C: kept as a cut reply, which goes on)
        self._record(before, messages_now, full, go_on, out.tokens, cut)
        if reason == "length" and limit < session.max_new_tokens:  # the context, not --max-new-tokens, cut it
            self.say(f"[the reply reached the model's context of {eng.context_length} tokens: /rewind or /reset]")
        elif reason == "cancelled":
            self.say("[stopped: the reply so far is kept; an empty line continues it, /rewind drops it]")
        elif cut or self.plain:  # the line stays open: an empty line continues it there (the plain
            self._show()      # template's replies all go on, a stop string's or EOS's end too)
        else:
            self.end_line()
        return out.stats

    def _record(self, before, messages_now, full, go_on, tokens, cut) -> None:
        """The turn's reply into the chat's record (a continuation extends the reply)."""
        from hyspec.session import continuation

        eng, session = self.eng, self.session
        stops = eng._stops(session.stop_ids, session.ignore_eos)
        body = tokens[:-1] if (tokens and tokens[-1] in stops and not self.plain) else tokens
        # a continuation's text as the whole reply's text has it: a character cut in its bytes
        # at the end of the reply so far (recorded there as U+FFFD) is completed by this part
        # (the session's reply tokens: the earlier parts, then this one's)
        whole = session._reply if go_on else []
        prior = whole[: len(whole) - len(tokens)] if whole[len(whole) - len(tokens):] == list(tokens) else []
        drop, text = continuation(eng, prior, tokens)
        drop_body, content = (drop, text) if self.plain else continuation(eng, prior, body)
        if drop:
            full = full[:-drop]
        if go_on and messages_now and messages_now[-1]["role"] == "assistant":
            earlier = messages_now[-1]["content"]
            earlier = earlier[:-drop_body] if drop_body else earlier
            messages_now = messages_now[:-1] + [{"role": "assistant", "content": earlier + content}]
        else:
            messages_now = messages_now + [{"role": "assistant", "content": content}]
        self.stack.append(before)
        self.messages, self.rendered, self.cut = messages_now, full + text, cut

    def set_system(self, text: str) -> None:
        """Open the conversation (this one, still empty, and each after /reset) with a system
        message. The template must render it: one that refuses a system role (or renders
        nothing of it) is an error here, before the first turn."""
        if self.session.tokens or self.messages:
            raise ValueError("a system message opens a conversation: this one has begun")
        system = [{"role": "system", "content": text}]
        probe = [{"role": "user", "content": "hi"}]
        try:
            with_it, without = self.render(system + probe, True), self.render(probe, True)
        except ValueError as e:
            raise ValueError(f"--system: the chat template ({self.template_source}) refuses a system message: "
                             f"{e}") from None
        if text and with_it == without:
            raise ValueError(f"--system: the chat template ({self.template_source}) leaves a system message out")
        self.system, self.messages = system, list(system)

    # -- commands ----------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a /command; returns False for /quit."""
        from hyspec.session import Session

        cmd, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        path = os.path.expanduser(arg)  # (/save ~/chat.pt)
        if arg and cmd in ("/quit", "/exit", "/reset", "/stats", "/help", "/paste"):  # (not done with an argument ignored)
            raise ValueError(f"{cmd} takes no argument, got {arg!r}")
        if cmd in ("/quit", "/exit"):
            return False
        if cmd == "/rewind":
            if arg and not (arg.isascii() and arg.isdigit()):
                raise ValueError(f"/rewind takes a number of turns, got {arg!r}")
            asked = int(arg) if arg else 1
            self._rewind(asked)
            self.say(f"[rewound {asked} turn(s): {len(self.session.tokens)} tokens]")
        elif cmd == "/retry":
            self.retry(arg)
        elif cmd == "/reset":
            self.session.reset()
            self._close_previous()
            self.messages, self.rendered, self.cut, self.stack = list(self.system), "", False, []
            self.say("[reset]")
        elif cmd == "/stats":
            self.say("[stats] " + json.dumps(self.stats()))
        elif cmd == "/save":
            if not arg:
                raise ValueError("/save needs a file name")
            self.session.save(path, extra={"messages": self.messages, "rendered": self.rendered, "cut": self.cut,
                                          "stack": [[m, r, c] for m, r, c in self.stack]})
            self.say(f"[saved {len(self.session.tokens)} tokens to {arg}]")
        elif cmd == "/load":
            if not arg:
                raise ValueError("/load needs a file name")
            new = Session.load(self.eng, path)
            try:
                extra = new.extra
                messages, rendered = list(extra.get("messages", [])), str(extra.get("rendered", ""))
                stack = [(list(x[0]), str(x[1]), bool(x[2]) if len(x) > 2 else False)
                         for x in extra.get("stack", [])]
                cut = bool(extra.get("cut", False))
            except (AttributeError, TypeError, ValueError, KeyError, IndexError) as e:
                new.close()
                raise ValueError(f"{arg}: malformed chat record in the session file ({type(e).__name__})") from None
            self.session.close()
            self._close_previous()
            self.session = new
            self.messages, self.rendered, self.stack, self.cut = messages, rendered, stack, cut
            self.say(f"[loaded {len(new.tokens)} tokens from {arg}]")
        elif cmd == "/help":
            self.say(HELP)
        elif cmd == "/paste":  # (hyspec chat reads the lines itself: main)
            raise ValueError("/paste reads the lines typed after it: hyspec chat's own")
        else:
            self.say(f"[unknown command {cmd}; {HELP}]")
        return True

    def _rewind(self, n: int) -> None:
        """Back to the exact state before the last n turns (/rewind n), with the chat's record."""
        total = self.session.num_turns + sum(old.num_turns for old, _ in self.previous)
        if not 1 <= n <= total:  # (checked whole first: nothing changes)
            raise ValueError(f"cannot rewind {n} turn(s): the conversation has {total}" if n else
                             "/rewind needs a number of turns >= 1, got 0")
        while self.previous and n >= self.session.num_turns:  # back past a restart: the session before it
            n -= self.session.num_turns
            self.messages, self.rendered, self.cut = self.stack[0]  # the chat before the restarted turn
            self.session.close()
            self.session, self.stack = self.previous.pop()
        if n:
            self.session.rewind(n)
            if n <= len(self.stack):
                self.messages, self.rendered, self.cut = self.stack[-n]
                del self.stack[-n:]
            else:  # into turns this chat has no record of (a loaded session saved without one)
                self.messages, self.rendered, self.cut, self.stack = [], "", False, []

    def retry(self, arg: str = "", cancel=None) -> dict:
        """/retry [SEED]: the last user message again, for another reply. The turns since it
        was sent (its reply and the reply's continued parts) are undone, as /rewind undoes
        them, and the message is sent again as the record holds it, with a new seed (SEED, or
        a random one, shown so that /retry SEED draws that reply again). Sampling only: a
        greedy chat's reply would be the same. Returns the new turn's stats (as user)."""
        import secrets
        from dataclasses import replace

        from hyspec.sampling import SEED_MAX

        if arg and not (arg.isascii() and arg.isdigit() and int(arg) <= SEED_MAX):
            raise ValueError(f"/retry takes a seed, an integer in 0..{SEED_MAX}, got {arg!r}")
        params = self.session.params
        if params.greedy:
            raise ValueError("/retry draws another reply by sampling: this chat is greedy (temperature 0), "
                             "so the same message would get the same reply (--temperature T samples)")
        users = [i for i, m in enumerate(self.messages) if m.get("role") == "user"]
        if not users:
            raise ValueError("/retry: there is no message to send again")
        u = users[-1]
        # the turn that sent it: the last one whose record before it ends just before the message
        back = next((n for n, (before, _, _) in enumerate(reversed(self.stack), 1) if len(before) <= u), None)
        if back is None or len(self.stack[-back][0]) != u:
            raise ValueError("/retry: this chat has no record of the turn that sent the last message "
                             "(a session loaded without one): /rewind, then type it")
        text = self.messages[u]["content"]
        seed = int(arg) if arg else secrets.randbelow(SEED_MAX + 1)
        self._rewind(back)
        self.say(f"[retry: the last message again, seed {seed}]")
        return self.user(text, cancel=cancel, params=replace(params, seed=seed), recorded=True)

    def _close_previous(self) -> None:
        for old, _ in self.previous:
            old.close()
        self.previous = []

    def close(self) -> None:
        """Close the session and the ones kept aside for /rewind."""
        self.session.close()
        self._close_previous()

    def stats(self) -> dict:
        session = self.session
        last = session.last_stats or {}
        spec = last.get("spec")
        state = session.state()
        overall = session.telemetry.copy()  # the conversation's: with the sessions a restart kept aside
        for old, _ in self.previous:
            overall.merge(old.telemetry)
        return {
            "turns": session.num_turns + sum(old.num_turns for old, _ in self.previous),
            "context_tokens": len(session.tokens),
            "turn_tokens": last.get("generated_tokens")
            and session.tokens[len(session.tokens) - last["generated_tokens"]:],
            "turn_prefilled": (last.get("prompt_tokens", 0) - last.get("cached_tokens", 0)) if last else None,
            "turn_ttft_s": last.get("time_to_first_token_s"),
            "turn_acceptance": None if not spec else {k: spec[k] for k in ("acceptance_length", "acceptance_rate")},
            "overall_acceptance": (None if not overall.rounds else
                                   {"acceptance_length": overall.acceptance_length,
                                    "acceptance_rate": overall.acceptance_rate}),
            "store": self.eng.store.stats(),
            "state_digest": None if state is None else state.digest(),
        }


def display_width(text: str) -> int:
    """The terminal columns `text` takes: East Asian wide and fullwidth characters two,
    combining marks and zero-width characters none, others one."""
    width = 0
    for ch in text:
        if unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
            continue
        width += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return width


def _same_file(a, b) -> bool:
    """Whether two streams write to one file, pipe or terminal (2>&1)."""
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (AttributeError, ValueError, OSError):  # (no file descriptor: io.StringIO)
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _is_terminal(f) -> bool:
    try:
        return bool(f.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError, OSError):
        return False


def build_parser() -> argparse.ArgumentParser:
    from hyspec.cli.common import add_constraint_args, add_model_args, add_sampling_args, add_spec_args, parse_ids

    from hyspec.cli.common import HelpFormatter, OneLineParser

    p = OneLineParser(prog="hyspec chat", description="interactive chat with a kept session state; " + HELP,
                      formatter_class=HelpFormatter)  # (its --help showed no defaults, 128 tokens a reply among them)
    add_model_args(p)
    p.add_argument("--max-new-tokens", type=int, default=128, help="reply length limit per turn")
    p.add_argument("--stop-ids", type=parse_ids, default=None, help="extra stop token ids, comma-separated")
    p.add_argument("--ignore-eos", action="store_true",
                   help="a reply does not end at the checkpoint's EOS ids (only at --max-new-tokens, a --stop "
                        "or a stop id)")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="end a reply at the token that completes this text (repeat the flag for several); the "
                        "reply keeps the text, as the conversation does")
    p.add_argument("--chat-template", default=None, type=os.path.expanduser, metavar="FILE",
                   help="a Jinja chat template file to use instead of the checkpoint's")
    p.add_argument("--verbose", action="store_true",
                   help="after each reply, its figures on stderr as hyspec generate prints them (tokens, prefill, "
                        "decode tok/s; the speculative acceptance)")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="a system message that opens the conversation (and each one after /reset); with the "
                        "plain template its text opens the transcript")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="extra chat template variables, a JSON object, e.g. '{\"enable_thinking\": false}' "
                        "(the Qwen3 / Qwen3.5 templates' switch for answers without a thinking part)")
    add_sampling_args(p, recommended=True)  # (the checkpoint's generation_config.json values where no flag is given)
    add_spec_args(p, forced_rates=False)  # (the forced drafter needs a reference continuation: not in a chat)
    add_constraint_args(p)  # every reply must match (docs/constraints.md, "In sessions")
    return p


def main(argv=None, stdin=None, stdout=None) -> int:
    from hyspec.cli.common import check_spec_flags, constraint_from_args, load_engine, sampling_params, speed_lines
    from hyspec.speculative.loop import SpecOptions

    args = build_parser().parse_args(argv)
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    # a terminal / pipe whose encoding cannot hold what is typed or replied (PYTHONIOENCODING=ascii):
    # a reply's character the output cannot encode is shown as "?" (it ended the chat, the
    # conversation lost); a typed byte the input cannot decode is kept as a lone surrogate,
    # which the turn refuses in one line ("[error: character i is a lone surrogate ...]")
    for stream, errors in ((stdin, "surrogateescape"), (stdout, "replace")):
        if getattr(stream, "encoding", None) and hasattr(stream, "reconfigure"):
            try:
                stream.reconfigure(errors=errors)
            except (ValueError, OSError):  # (a closed or detached stream: left as it is)
                pass
    try:
        from hyspec.engine import stop_list

        params = sampling_params(args)  # (the flags checked before the model loads)
        stops = stop_list(args.stop or [])  # (before the model loads)
        spec = None
        if args.draft > 0:
            spec = SpecOptions(k=args.draft, rollback=args.rollback, p_min=args.p_min, adaptive=args.adaptive,
                               adaptive_floor=args.adaptive_floor, hidden=args.hidden)
        else:
            check_spec_flags(args)
        if args.chat_template is not None:
            read_template_file(args.chat_template, "--chat-template")  # before the model loads
        kwargs = {}
        if args.chat_template_kwargs is not None:
            try:
                kwargs = json.loads(args.chat_template_kwargs)
            except json.JSONDecodeError as e:
                raise ValueError(f"--chat-template-kwargs is not valid JSON ({e.msg})") from None
            reserved = {"messages", "add_generation_prompt"} & set(kwargs) if isinstance(kwargs, dict) else set()
            if not isinstance(kwargs, dict) or reserved:
                raise ValueError("--chat-template-kwargs must be a JSON object of template variables"
                                 + (f" other than {sorted(reserved)}" if reserved else ""))
        eng = load_engine(args)
        if eng.tokenizer is None:
            raise ValueError("chat needs a checkpoint with a tokenizer.json")
        if args.chat_template is not None:
            eng.use_chat_template(Path(args.chat_template))
        constraint = constraint_from_args(eng, args)
        if constraint is not None and eng.chat_template.thinks:
            # the replies think first (a probe turn shows it): the answers are constrained after </think>,
            # as Engine.prepare_chat does for one request
            constraint = eng.prepare_chat([{"role": "user", "content": "hi"}], template_kwargs=kwargs,
                                          constraint=constraint).constraint
        taken = {k: v for k, v in eng.sampling_defaults.items() if getattr(args, k) is None}
        if taken:  # the checkpoint's recommended sampling, where no flag says otherwise
            params = sampling_params(args, eng.sampling_defaults)
            print("[hyspec chat: the checkpoint's generation_config.json sampling: "
                  + ", ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in taken.items()) + "]", file=sys.stderr)
        session = eng.session(draft=args.draft, params=params, spec=spec, max_new_tokens=args.max_new_tokens,
                              stop_ids=args.stop_ids, ignore_eos=args.ignore_eos,
                              constraint=constraint)
        chat = Chat(eng, session, out=stdout)
        chat.template_kwargs = kwargs
        chat.stop = stops
        if args.system is not None:
            chat.set_system(args.system)
    except (ValueError, OSError, ImportError) as e:
        from hyspec.cli.dispatch import error_message  # a ParamError names the flag typed (--top-p)

        print(f"hyspec chat: error: {error_message(e)}", file=sys.stderr)
        return 2
    tty = hasattr(stdin, "isatty") and stdin.isatty()
    # on the process's own terminal, lines are read with the line editor (arrow keys, history;
    # a bare stdin.readline() sent the keys' escape sequences as text, and the reply drawn on
    # the typed line's row then overwrote their echo)
    edit = tty and stdin is sys.stdin and stdout is sys.stdout and _is_terminal(stdout)
    if edit:
        try:
            import readline  # noqa: F401  (input() edits lines once it is imported)
        except ImportError:  # (no readline on this platform: plain reads)
            edit = False
    note = " (a code model: type code, it continues)" if chat.plain and args.model is None else ""
    print(f"[hyspec chat: template {chat.template_source}{note}; {HELP}]", file=sys.stderr)
    def read_line(more: bool = False) -> str:
        """The next input line with its line break ("" at the end of input); on a terminal
        after the prompt ("... " for the lines of a /paste)."""
        mark = "... " if more else "> "
        if tty:  # (the output redirected to a file: the prompt goes to the terminal, not into the file)
            if not more:
                chat.prompt(marker=not edit and _is_terminal(stdout))
            elif not edit and _is_terminal(stdout):
                print(mark, end="", file=stdout, flush=True)
            if not edit and not _is_terminal(stdout):
                print(mark, end="", file=sys.stderr, flush=True)
        if edit:
            try:
                return input(mark) + "\n"
            except EOFError:  # Ctrl-D
                return ""
        return stdin.readline()

    while True:
        try:
            line = read_line()
        except KeyboardInterrupt:  # Ctrl-C at the prompt: the conversation stays (leave with /quit or Ctrl-D)
            chat.say("\n[Ctrl-C: /quit or Ctrl-D leaves]" if tty else "[Ctrl-C: /quit or Ctrl-D leaves]")
            continue
        if not line:
            if tty:  # Ctrl-D: the shell's prompt on a line of its own
                chat.say("")
            break
        line = line.rstrip("\n").removesuffix("\r")  # (a CRLF line end too)
        message = typed = None  # a message to send (None: a command)
        head, _, retry_arg = line.strip().partition(" ")
        retry = head == "/retry"  # (a command that sends: run as a turn, below)
        if line.rstrip() == "/paste":  # the lines up to one that is only /end (or the end of input): one message
            if tty:
                chat.say("[paste: the lines up to one that is only /end (or Ctrl-D) are one message]")
            block = []
            try:
                while True:
                    more = read_line(more=True)
                    if not more or more.rstrip("\r\n") == "/end":
                        break
                    block.append(more.rstrip("\n").removesuffix("\r"))
            except KeyboardInterrupt:
                chat.say("\n[Ctrl-C: the pasted lines are dropped]" if tty else "[Ctrl-C: the pasted lines are dropped]")
                continue
            if block in ([], [""]):  # (an empty message would continue the last reply)
                chat.say("[nothing pasted]")
                continue
            message = "\n".join(block)
        elif not line.startswith("/") or line.startswith("//"):  # "//": a message starting with "/"
            message, typed = (line[1:] if line.startswith("//") else line), (line if tty else None)
        try:
            if message is None and not retry:
                if not chat.command(line):
                    break
            else:
                # a first Ctrl-C during the reply stops it after the round in flight, kept (see
                # Chat.user); a second one raises KeyboardInterrupt at once
                with stop_on_ctrl_c({}) as pressed:
                    if retry:
                        stats = chat.retry(retry_arg.strip(), cancel=lambda: pressed["sigint"])
                    else:
                        stats = chat.user(message, typed=typed, cancel=lambda: pressed["sigint"])
                if args.verbose and stats:
                    # one screen, or stderr into the same file or pipe (2>&1): the figures under
                    # the reply, not glued to its line
                    if _is_terminal(stdout) or _same_file(stdout, sys.stderr):
                        chat.end_line()
                    for figures in speed_lines(stats):
                        print(figures, file=sys.stderr, flush=True)
        except KeyboardInterrupt:  # a Ctrl-C that stops a reply at once: the turn is undone, the chat goes on
            chat.say("[interrupted: the reply is dropped, the conversation is as before it]" if message is not None
                     else "[interrupted: the new reply is dropped, the conversation is as before the message]"
                     if retry else "[interrupted]")
        except (ValueError, OSError, RuntimeError) as e:
            chat.say(f"[error: {e}]")
    chat.end_line()
    if args.json:  # one JSON object at the end: the session's figures (as /stats prints them)
        print(json.dumps(chat.stats()), file=stdout, flush=True)
    chat.close()
    return 0
