"""Text side of the server: incremental detokenisation with stop strings. (Chat templates:
hyspec/chat_template.py, shared with `hyspec chat`.)

Nothing here touches the model; everything is pure and unit-testable."""

from __future__ import annotations

import copy


class StopMatcher:
    """Turns a growing list of generated token ids into text, detecting stop strings.

    feed(ids) consumes ids one at a time (one batch per round when there are no stop
    strings). Text is decoded incrementally: tokens whose text is final are committed, and
    only the last few are re-decoded, with a few tokens of left context so that decoders
    whose output depends on the neighbour (byte-level pieces of one character, leading
    spaces) give the same text as decoding everything at once. Each new piece of text is
    searched for every stop string, including matches that straddle token boundaries. On a
    match the text is cut at the start of the stop string (`include_stop`: at its end, vLLM's
    include_stop_str_in_output) and `stopped` is set; `n_tokens`
    is the number of ids consumed up to and including the one that completed the match
    (the rest of a round is discarded).

    `emittable()` is the text that may be streamed already: everything except a trailing
    part that could still become a stop string, and except a trailing incomplete UTF-8
    sequence (decoded as U+FFFD).

    `drop_ids`: ids that end generation (EOS / stop token ids): counted in n_tokens, never
    shown in the text.
    """

    def __init__(self, decode, stops: list[str] | None = None, drop_ids=(), skip_break: bool = False,
                 include_stop: bool = False):
        self.decode = decode
        self.include_stop = include_stop
        # skip_break: a line break that opens the searched text is no part of a match (hyspec
        # chat's plain template: the break that ends the line the user sent)
        self.skip_break = skip_break
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
        self._min_end = 0  # a match must end past this many characters of text (prime)
        self._primed: str | None = None  # primed text whose last character is undecided (see prime)

    def prime(self, ids) -> None:
        """Consume ids that come before what is searched (the earlier part of a reply that
        goes on): a stop string found later must end after their text (it may begin in it)."""
        stops, self.stops = self.stops, []
        self.feed(ids)
        self.stops = stops
        self._min_end = self._scan_from = self.settled_length()
        # an undecided tail: a character cut in its bytes (the next tokens complete it: a stop
        # string ending on it ends after the primed text; was: skipped as wholly in it), or a
        # real U+FFFD (its bytes EF BF BD), decided once the text is final (_decide_primed)
        self._primed = self.text if self._read < len(self._shown) else None

    def settled_length(self) -> int:
        """Characters of `text` that are final: without a trailing U+FFFD of an undecided tail."""
        if self._read < len(self._shown):
            return len(self.text.rstrip("\ufffd"))
        return len(self.text)

    @property
    def primed_end(self) -> int:
        """Where the text after the primed tokens begins (a character cut in their bytes is
        the later text's; a real U+FFFD that ended them is theirs)."""
        return self._min_end

    def _decide_primed(self) -> None:
        if self._primed is not None and self._read == len(self._shown):  # the text is final now
            if self.text.startswith(self._primed):  # its U+FFFD were real characters, the primed text's
                self._min_end = max(self._min_end, len(self._primed))
            self._primed = None

    @property
    def n_tokens(self) -> int:
        return len(self.ids)

    def clone(self) -> "StopMatcher":
        """An independent copy (to try tokens on without consuming them)."""
        other = copy.copy(self)
        other.ids, other._shown = list(self.ids), list(self._shown)
        return other

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
            self._decide_primed()
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
        best, cut = -1, -1
        hay = self.text
        if self._read < len(self._shown):  # an undecided tail: its U+FFFD may be a character's first
            hay = hay.rstrip("\ufffd")  # bytes, not text yet (a stop string must not match them)
        if self.skip_break and hay[self._min_end:self._min_end + 1] == "\n":
            start = max(start, self._min_end + 1)  # a match begins after the opening break
        for s in self.stops:
            i = hay.find(s, start)
            while 0 <= i and i + len(s) <= self._min_end:  # wholly in the primed text: not this one
                i = hay.find(s, i + 1)
            if i >= 0 and (best < 0 or i < best):
                best, cut = i, i + len(s) if self.include_stop else i
        if best >= 0:
            self.text = self.text[:cut]
            self.stopped = True
            return True
        self._scan_from = len(self.text)
        return False

    def emittable(self, final: bool = False) -> str:
        if final or self.stopped:
            return self.text
        text = self.text
        end = len(text)
        while end > 0 and text[end - 1] == "\ufffd":  # an incomplete character: not final yet
            end -= 1
        text = text[:end]
        hold = 0  # on what is final: the longest suffix that is a proper prefix of a stop string
        for s in self.stops:
            for L in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:L]):
                    hold = L
                    break
        return text[:len(text) - hold]
