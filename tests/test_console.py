"""The run console: prefixes, progress bars as status lines, no flood."""

from __future__ import annotations

import io

import pytest

from corral.run.console import RunConsole, parse_ranks


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_prefixes() -> None:
    out = io.StringIO()
    one = RunConsole(multi_host=False, out=out)
    one.line("vm", 1, "log", "hello")
    one.line("vm", None, "err", "torchrun says")
    many = RunConsole(multi_host=True, out=out)
    many.line("node2", 3, "log", "hi")
    assert out.getvalue().splitlines() == ["[r1] hello", "[vm] torchrun says", "[node2/r3] hi"]


def test_progress_on_a_terminal_is_one_redrawn_status_line() -> None:
    out = TTY()
    con = RunConsole(multi_host=False, out=out, color=False)
    con.status("vm", 0, "0%|")
    con.status("vm", 1, "rank1 0%")  # not selected (--ranks defaults to 0): never shown
    con.line("vm", 0, "log", "epoch done")
    con.close()
    text = out.getvalue()
    assert "rank1" not in text
    # drawn as a footer, erased before the next line, erased again at close
    assert text == "[r0] 0%|\n" + "\x1b[1F\x1b[J" + "[r0] epoch done\n"
    # a finished line replaced the bar, so close() had nothing left to erase


def test_a_ranks_cursor_movement_cannot_garble_the_screen() -> None:
    """tqdm(position=local_rank) moves the cursor up a line; colours pass."""
    out = TTY()
    con = RunConsole(multi_host=False, out=out, color=False, status_ranks=None)
    con.status("vm", 1, "\x1b[A\x1b[1mrank 1\x1b[0m 10%|#")
    con.line("vm", 1, "log", "\x1b[2Kdone\x1b[A")
    con.close()
    text = out.getvalue()
    assert "\x1b[A" not in text and "\x1b[2K" not in text
    assert "[r1] \x1b[1mrank 1\x1b[0m 10%|#" in text and "[r1] done\n" in text


def test_status_updates_are_throttled_on_a_terminal() -> None:
    out = TTY()
    con = RunConsole(multi_host=False, out=out, color=False)
    for i in range(500):
        con.status("vm", 0, f"{i}%")
    assert out.getvalue().count("[r0]") < 50  # redraws at most every 0.1 s


def test_progress_without_a_terminal_does_not_flood() -> None:
    out = io.StringIO()
    con = RunConsole(multi_host=False, out=out)
    for i in range(1000):
        con.status("vm", 0, f"{i}/1000")
    assert len(out.getvalue().splitlines()) == 1  # one line per 15 s at most


def test_parse_ranks() -> None:
    assert parse_ranks("0") == {0}
    assert parse_ranks("0-2,7") == {0, 1, 2, 7}
    assert parse_ranks("all") is None
    with pytest.raises(ValueError):
        parse_ranks("a-b")


def test_colour_follows_the_terminal_and_no_color_force_color_term(monkeypatch) -> None:
    from corral import ui

    for var in ("NO_COLOR", "FORCE_COLOR", "TERM"):
        monkeypatch.delenv(var, raising=False)
    assert ui.paint("x", "red", stream=io.StringIO()) == "x"          # not a terminal
    assert ui.paint("x", "bold", "red", stream=TTY()) == "\x1b[31m\x1b[1mx\x1b[0m"
    assert RunConsole(multi_host=True, out=TTY()).color
    monkeypatch.setenv("TERM", "dumb")
    assert ui.paint("x", "red", stream=TTY()) == "x" and not RunConsole(multi_host=True, out=TTY()).color
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert ui.paint("x", "dim", stream=io.StringIO()) == "\x1b[2mx\x1b[0m"
    monkeypatch.delenv("FORCE_COLOR")
    monkeypatch.delenv("TERM")
    monkeypatch.setenv("NO_COLOR", "1")
    assert ui.paint("x", "red", stream=TTY()) == "x" and not RunConsole(multi_host=True, out=TTY()).color


def test_a_ranks_terminal_controls_never_reach_the_terminal_but_its_colours_do() -> None:
    """OSC 0 sets the window title, OSC 52 writes the clipboard: a rank's
    output must not do either on the machine corral runs on."""
    out = TTY()
    con = RunConsole(multi_host=False, out=out, color=False, status_ranks=None)
    con.line("vm", 0, "log", "a\x1b]0;pwned title\x07b\x1b]52;c;ZWNobyBwd25lZA==\x1b\\c")
    con.line("vm", 0, "log", "\x1b[31mred\x1b[0m\tdone\r \x1bP+q544e\x1b\\\x9b2J\x9d52;c;eA==\x9c\x1bc\x07\x08!")
    con.status("vm", 1, "\x1b]0;bar title\x0710%")
    con.message("node: killed 1 process(es) (\x1b]52;c;eA==\x07python)")
    con.line("vm", 0, "log", "unterminated \x1b]52;c;ZWNobyBwd25lZA==")
    con.close()
    text = out.getvalue()
    for seq in ("\x1b]", "\x1bP", "\x9b", "\x9d", "\x1bc", "\x07", "\x08", "pwned", "ZWNo", "eA=="):
        assert seq not in text, (seq, text)
    assert "[r0] abc\n" in text and "[r0] \x1b[31mred\x1b[0m\tdone\r !\n" in text
    assert "[r1] 10%" in text and "(python)" in text and "[r0] unterminated \n" in text
