"""hyspec.interrupt.stop_on_ctrl_c: the ask-then-insist Ctrl-C of chat, generate and train."""

import os
import signal

import pytest

from hyspec.interrupt import stop_on_ctrl_c


def test_first_press_asks_second_raises_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGINT)
    assert before is signal.default_int_handler  # (tests/conftest.py restores a background run's)
    with stop_on_ctrl_c({}) as pressed:
        assert pressed["sigint"] is False
        os.kill(os.getpid(), signal.SIGINT)
        assert pressed["sigint"] is True
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("other", ["ignored", "own handler"])
def test_another_handler_is_left_alone(other):
    """A process that ignores SIGINT (a background job) or handles it itself (the pipeline
    driver defers its Ctrl-C past an exchange with its stages) keeps its handler inside."""
    got = []
    handler = signal.SIG_IGN if other == "ignored" else (lambda *_: got.append(1))
    old = signal.signal(signal.SIGINT, handler)
    try:
        with stop_on_ctrl_c({}) as pressed:
            assert signal.getsignal(signal.SIGINT) is handler
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        assert pressed["sigint"] is False and got == ([] if other == "ignored" else [1, 1])
    finally:
        signal.signal(signal.SIGINT, old)
