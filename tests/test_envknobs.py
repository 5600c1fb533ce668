"""The HYSPEC_* ablation knobs (hyspec.envknobs): one reading of a switch or a number
everywhere, and a bad value refused with its variable's name before a model loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hyspec import envknobs
from hyspec.cli.dispatch import main

ROOT = Path(__file__).resolve().parents[1] / "hyspec"


@pytest.mark.parametrize("raw, want", [("1", True), ("on", True), (" TRUE ", True), ("yes", True),
                                        ("0", False), ("off", False), ("False", False), ("no", False),
                                        ("", True), (None, True)])
def test_a_switch_takes_the_usual_spellings(monkeypatch, raw, want) -> None:
    if raw is None:
        monkeypatch.delenv("HYSPEC_COMMIT_KERNEL", raising=False)
    else:
        monkeypatch.setenv("HYSPEC_COMMIT_KERNEL", raw)
    assert envknobs.switch("HYSPEC_COMMIT_KERNEL") is want


def test_three_state_and_off_by_default_switches(monkeypatch) -> None:
    monkeypatch.delenv("HYSPEC_PDL", raising=False)
    monkeypatch.delenv("HYSPEC_ATTN_CHUNKED", raising=False)
    assert envknobs.switch("HYSPEC_PDL") is None and envknobs.switch("HYSPEC_ATTN_CHUNKED") is False
    monkeypatch.setenv("HYSPEC_PDL", "off")
    assert envknobs.switch("HYSPEC_PDL") is False


@pytest.mark.parametrize("raw", ["2", "maybe", "o n", "1.0"])
def test_a_bad_switch_names_its_variable(monkeypatch, raw) -> None:
    monkeypatch.setenv("HYSPEC_SERVE_SCHEDULER", raw)
    with pytest.raises(ValueError, match=r"HYSPEC_SERVE_SCHEDULER=.*not a switch"):
        envknobs.switch("HYSPEC_SERVE_SCHEDULER")
    with pytest.raises(ValueError, match="HYSPEC_SERVE_SCHEDULER"):
        envknobs.check()


def test_numbers(monkeypatch) -> None:
    monkeypatch.delenv("HYSPEC_FAST_PREFILL", raising=False)
    assert envknobs.number("HYSPEC_FAST_PREFILL") == 64
    monkeypatch.setenv("HYSPEC_FAST_PREFILL", " 0 ")
    assert envknobs.number("HYSPEC_FAST_PREFILL") == 0
    for bad in ("x", "-1", "1.5", "0x10"):
        monkeypatch.setenv("HYSPEC_FAST_PREFILL", bad)
        with pytest.raises(ValueError, match=r"HYSPEC_FAST_PREFILL=.*integer >= 0"):
            envknobs.number("HYSPEC_FAST_PREFILL")
    monkeypatch.delenv("HYSPEC_FAST_PREFILL")
    monkeypatch.setenv("HYSPEC_GDN_DECODE_BLOCKS", "0")  # (at least one Dv block per program)
    with pytest.raises(ValueError, match=r"HYSPEC_GDN_DECODE_BLOCKS=.*integer >= 1"):
        envknobs.check()


def test_every_knob_the_code_reads_is_registered() -> None:
    """Each switch(...) / number(...) / choice(...) in hyspec/ names a registered knob, and
    no HYSPEC_* ablation knob is read from os.environ past hyspec.envknobs (a knob read there
    would skip the check at start)."""
    read = {}
    for f in ROOT.rglob("*.py"):
        text = f.read_text()
        for kind, name in re.findall(r'\b(switch|number|choice)\("(HYSPEC_\w+)"', text):
            read.setdefault(name, kind)
        for name in re.findall(r'environ(?:\.get\(|\[)\s*"(HYSPEC_\w+)"', text):
            assert name in ("HYSPEC_PROFILE_ENGINE", "HYSPEC_LAUNCHER_PID", "HYSPEC_GIT_COMMIT",
                            "HYSPEC_GIT_DIRTY", "HYSPEC_PDL_SKIP") or f.name == "cli.py" and name == "HYSPEC_PDL", \
                f"{f}: {name} read past hyspec.envknobs"  # (bench/cli.py records the raw value)
    assert read, "no knob reader found"
    for name, kind in read.items():
        assert name in {"switch": envknobs.SWITCHES, "number": envknobs.NUMBERS, "choice": envknobs.CHOICES}[kind]
    assert set(read) == set(envknobs.SWITCHES) | set(envknobs.NUMBERS) | set(envknobs.CHOICES)


def test_choices_and_the_pdl_families(monkeypatch) -> None:
    monkeypatch.setenv("HYSPEC_TALL_ACT", "Fused")
    assert envknobs.choice("HYSPEC_TALL_ACT") == "fused"
    monkeypatch.setenv("HYSPEC_TALL_ACT", "fuse")  # (before: read as split, in silence)
    with pytest.raises(ValueError, match=r"HYSPEC_TALL_ACT='fuse' is not one of split, fused"):
        envknobs.check()
    monkeypatch.delenv("HYSPEC_TALL_ACT")
    monkeypatch.setenv("HYSPEC_PDL_SKIP", "matmul,atention")
    with pytest.raises(ValueError, match=r"HYSPEC_PDL_SKIP: unknown kernel families \['atention'\]"):
        envknobs.check()


def test_the_cli_and_engine_load_refuse_a_bad_knob_before_loading(monkeypatch, capsys) -> None:
    monkeypatch.setenv("HYSPEC_GDN_WARPS", "four")
    assert main(["generate", "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "HYSPEC_GDN_WARPS='four'" in err and "Traceback" not in err
    from hyspec import Engine

    with pytest.raises(ValueError, match="HYSPEC_GDN_WARPS"):
        Engine.load()
    with pytest.raises(SystemExit) as e:  # a help text is still shown
        main(["generate", "--help"])
    assert e.value.code == 0 and "--max-new-tokens" in capsys.readouterr().out


def test_the_server_scheduler_switch_reads_false_as_off(monkeypatch) -> None:
    from hyspec.server.worker import scheduler_module

    monkeypatch.setenv("HYSPEC_SERVE_SCHEDULER", "false")
    assert scheduler_module() is None  # (before: anything but "0" was on)
    monkeypatch.setenv("HYSPEC_SERVE_SCHEDULER", "1")
    assert scheduler_module() is not None
