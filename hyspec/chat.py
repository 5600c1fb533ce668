"""`hyspec chat`: an interactive terminal chat over a session (hyspec/session.py).

Each line you type is a user message; the reply streams as rounds commit. The
conversation's state is kept between turns, so a turn prefills only the new text.
Commands:
    /rewind [N]   back to the exact state before the last N turns (default 1)
    /reset        start over (same settings)
    /stats        this turn's and the session's acceptance, the prefix store, the state digest (JSON)
    /save FILE    write the session (state, rewind points, messages) to FILE
    /load FILE    continue a saved session (in this or any later process; its settings replace the flags)
    /quit         leave (end of input too)
An empty line continues the reply (sends nothing new; the pending token runs first).

The prompt text is the conversation rendered with the checkpoint's chat template
(hyspec/chat_template.py; the plain template when the checkpoint has none: the embedded
default model is a code model, so its chat is "type code, the model continues it"; each
line is sent with its newline). A turn sends only the text the template adds after what
the session already holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from hyspec.chat_template import load_template, render_template

HELP = "commands: /rewind [N]  /reset  /stats  /save FILE  /load FILE  /quit"


class Chat:
    def __init__(self, engine, session, model_dir, out=sys.stdout, err=sys.stderr) -> None:
        self.eng, self.session, self.out, self.err = engine, session, out, err
        self.template, self.template_source, self.special = load_template(model_dir)
        self.plain = self.template_source == "plain"
        self.messages: list[dict] = []
        self.rendered = ""  # the text the session's tokens stand for
        self.stack: list[tuple[list[dict], str]] = []  # (messages, rendered) before each turn

    def render(self, messages, gen: bool) -> str:
        return render_template(self.template, messages, gen, self.special)

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    # -- a turn ------------------------------------------------------------------------
    def user(self, text: str) -> dict:
        eng, session = self.eng, self.session
        if self.plain:
            messages_now = self.messages + [{"role": "user", "content": text + "\n"}] if text else list(self.messages)
        else:
            messages_now = self.messages + [{"role": "user", "content": text}]
        full = self.render(messages_now, True)
        if session.tokens and full.startswith(self.rendered):
            ids = eng.encode(full[len(self.rendered):])
        else:  # first turn, or the template re-renders the past differently: start from the whole text
            if session.tokens:
                session.reset()
                self.stack = []
            ids = eng.encode(full)
        turn: list[int] = []
        shown = [0]

        def stream(new):
            turn.extend(new)
            text = eng.decode(turn)
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
                return
            self.out.write(text[shown[0]:])
            self.out.flush()
            shown[0] = len(text)

        before = (list(self.messages), self.rendered)
        out = session.send(ids, on_tokens=stream)
        text = eng.decode(out.tokens)
        self.out.write(text[shown[0]:] + "\n")
        self.out.flush()
        stops = eng._stops(session.stop_ids, session.ignore_eos)
        body = out.tokens[:-1] if (out.tokens and out.tokens[-1] in stops and not self.plain) else out.tokens
        self.stack.append(before)
        self.messages = messages_now + [{"role": "assistant", "content": text if self.plain else eng.decode(body)}]
        self.rendered = full + text
        return out.stats

    # -- commands ----------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a /command; returns False for /quit."""
        from hyspec.session import Session

        cmd, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if cmd in ("/quit", "/exit"):
            return False
        if cmd == "/rewind":
            if arg and not arg.isdigit():
                raise ValueError(f"/rewind takes a number of turns, got {arg!r}")
            n = int(arg) if arg else 1
            self.session.rewind(n)
            self.messages, self.rendered = self.stack[-n]
            del self.stack[-n:]
            self.say(f"[rewound {n} turn(s): {len(self.session.tokens)} tokens]")
        elif cmd == "/reset":
            self.session.reset()
            self.messages, self.rendered, self.stack = [], "", []
            self.say("[reset]")
        elif cmd == "/stats":
            self.say("[stats] " + json.dumps(self.stats()))
        elif cmd == "/save":
            if not arg:
                raise ValueError("/save needs a file name")
            self.session.save(arg, extra={"messages": self.messages, "rendered": self.rendered,
                                          "stack": [[m, r] for m, r in self.stack]})
            self.say(f"[saved {len(self.session.tokens)} tokens to {arg}]")
        elif cmd == "/load":
            if not arg:
                raise ValueError("/load needs a file name")
            new = Session.load(self.eng, arg)
            self.session.close()
            self.session = new
            extra = new.extra
            self.messages, self.rendered = extra.get("messages", []), extra.get("rendered", "")
            self.stack = [(m, r) for m, r in extra.get("stack", [])]
            self.say(f"[loaded {len(new.tokens)} tokens from {arg}]")
        elif cmd == "/help":
            self.say(HELP)
        else:
            self.say(f"[unknown command {cmd}; {HELP}]")
        return True

    def stats(self) -> dict:
        session = self.session
        last = session.last_stats or {}
        spec = last.get("spec")
        state = session.state()
        return {
            "turns": session.num_turns, "context_tokens": len(session.tokens),
            "turn_tokens": last.get("generated_tokens")
            and session.tokens[len(session.tokens) - last["generated_tokens"]:],
            "turn_prefilled": (last.get("prompt_tokens", 0) - last.get("cached_tokens", 0)) if last else None,
            "turn_ttft_s": last.get("time_to_first_token_s"),
            "turn_acceptance": None if not spec else {k: spec[k] for k in ("acceptance_length", "acceptance_rate")},
            "overall_acceptance": (None if not session.telemetry.rounds else
                                   {"acceptance_length": session.telemetry.acceptance_length,
                                    "acceptance_rate": session.telemetry.acceptance_rate}),
            "store": self.eng.store.stats(),
            "state_digest": None if state is None else state.digest(),
        }


def build_parser() -> argparse.ArgumentParser:
    from hyspec.cli.common import add_constraint_args, add_model_args, add_sampling_args, add_spec_args

    from hyspec.cli.common import OneLineParser

    p = OneLineParser(prog="hyspec chat", description="interactive chat with a kept session state; " + HELP)
    add_model_args(p)
    p.add_argument("--max-new-tokens", type=int, default=128, help="reply length limit per turn")
    p.add_argument("--stop-ids", default=None, help="extra stop token ids, comma-separated")
    p.add_argument("--ignore-eos", action="store_true")
    add_sampling_args(p)
    add_spec_args(p)
    add_constraint_args(p)  # every reply must match (docs/constraints.md, "In sessions")
    return p


def main(argv=None, stdin=None, stdout=None) -> int:
    from hyspec.cli.common import check_spec_flags, constraint_from_args, load_engine, parse_ids
    from hyspec.engine import default_model_dir
    from hyspec.sampling import SamplingParams
    from hyspec.speculative.loop import SpecOptions

    args = build_parser().parse_args(argv)
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    try:
        params = SamplingParams(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SamplingParams)})
        spec = None
        if args.draft > 0:
            spec = SpecOptions(k=args.draft, rollback=args.rollback, p_min=args.p_min, adaptive=args.adaptive,
                               adaptive_floor=args.adaptive_floor, hidden=args.hidden)
        else:
            check_spec_flags(args)
        eng = load_engine(args)
        if eng.tokenizer is None:
            raise ValueError("chat needs a checkpoint with a tokenizer.json")
        session = eng.session(draft=args.draft, params=params, spec=spec, max_new_tokens=args.max_new_tokens,
                              stop_ids=parse_ids(args.stop_ids) if args.stop_ids else None, ignore_eos=args.ignore_eos,
                              constraint=constraint_from_args(eng, args))
        chat = Chat(eng, session, args.model or default_model_dir(), out=stdout)
    except (ValueError, OSError, ImportError) as e:
        from hyspec.cli.dispatch import error_message  # a ParamError names the flag typed (--top-p)

        print(f"hyspec chat: error: {error_message(e)}", file=sys.stderr)
        return 2
    tty = hasattr(stdin, "isatty") and stdin.isatty()
    note = " (a code model: type code, it continues)" if chat.plain and args.model is None else ""
    print(f"[hyspec chat: template {chat.template_source}{note}; {HELP}]", file=sys.stderr)
    while True:
        if tty:
            stdout.write("> ")
            stdout.flush()
        line = stdin.readline()
        if not line:
            break
        line = line.rstrip("\n")
        try:
            if line.startswith("/"):
                if not chat.command(line):
                    break
            else:
                chat.user(line)
        except (ValueError, OSError, RuntimeError) as e:
            print(f"[error: {e}]", file=stdout, flush=True)
    if args.json:  # one JSON object at the end: the session's figures (as /stats prints them)
        print(json.dumps(chat.stats()), file=stdout, flush=True)
    chat.session.close()
    return 0
