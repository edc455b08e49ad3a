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


def test_a_batch_of_lines_is_cleaned_line_by_line() -> None:
    """A batch (the lines of one read) is written at once, but an OSC left
    open in one line must not swallow the next ones, and a clean batch is
    written as it came."""
    out = TTY()
    con = RunConsole(multi_host=True, out=out, color=False, status_ranks=None)
    con.line_batch("vm", 0, "log", ["a", "b"])
    con.line_batch("vm", 1, "log", ["open \x1b]52;c;ZWNo", "next", "\x1b[31mred\x1b[0m\x07"])
    con.close()
    assert out.getvalue() == "[vm/r0] a\n[vm/r0] b\n[vm/r1] open \n[vm/r1] next\n[vm/r1] \x1b[31mred\x1b[0m\n"


def test_a_terminal_that_stops_reading_neither_stops_the_job_nor_loses_a_line(tmp_path) -> None:
    """``corral run ... | less`` left unscrolled (or a frozen terminal): the
    head used to block writing to it, stopped pinging, and the agent stopped
    the job after 10 s of silence.  Now the run goes on, every line is in the
    rank's log, and the terminal gets the lines it missed summarised."""
    import subprocess
    import sys
    import time

    (tmp_path / "talk.py").write_text(
        "import time\n"
        "for i in range(1200):\n"  # past stdout's pipe (64 KiB), not past the agent's: it keeps going
        "    print(f'line {i} ' + 'z' * 60, flush=True)\n"
        "time.sleep(13)\n"
        "print('FINAL', flush=True)\n")
    proc = subprocess.Popen([sys.executable, "-m", "corral", "run", "--launcher", "command", sys.executable,
                             "talk.py"], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(16)  # nobody reads: stdout's pipe is full after the first ~900 lines
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    assert "head silent" not in out + err
    assert out.rstrip().endswith("[r0] FINAL"), out[-1000:]
    [log] = list(tmp_path.glob("runs/*/*/rank0.log"))
    assert log.read_text().count("\n") == 1201


@pytest.mark.parametrize("batch", [1, 10])
def test_what_a_stalled_terminal_missed_is_counted_and_each_ranks_last_lines_shown(batch: int) -> None:
    """The run loop never waits on the terminal, and the queue for it is
    bounded; lines that come as a batch (``lines``) are held back alike."""
    import os
    import threading
    import time

    from corral.run import console as console_mod

    r, w = os.pipe()
    out = os.fdopen(w, "w")
    con = RunConsole(multi_host=True, out=out, color=False)
    con.logs_hint = "runs/X"
    t0 = time.monotonic()
    total = 0
    for i in range(0, 60000, batch):  # ~9 MB for a terminal that reads nothing
        for rank in (0, 1):
            texts = [f"rank {rank} step {j} " + "q" * 60 for j in range(i, i + batch)]
            if batch == 1:
                con.line("node1", rank, "log", texts[0])
            else:
                con.line_batch("node1", rank, "log", texts)
            total += batch
    assert time.monotonic() - t0 < 30  # it never blocked (a blocked write would hang here)
    assert con._writer.backlog <= console_mod.BACKLOG_BYTES + 200 * batch
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.extend(iter(lambda: os.read(r, 1 << 16), b"")))
    reader.start()
    con.message("done")
    con.close()
    out.close()
    reader.join()
    text = b"".join(got).decode()
    lines = text.splitlines()
    [marker] = [ln for ln in lines if "not shown here" in ln]
    shown = sum(ln.startswith("[node1/r") for ln in lines)
    hidden = int(marker.split()[1].replace(",", ""))
    assert "every line is in runs/X" in marker
    assert shown + hidden == total + 2 * console_mod.TAIL_LINES  # every line shown or counted; the tails repeat
    after = lines[lines.index(marker) + 1:]
    assert after[:3] == [f"[node1/r0] rank 0 step {i} " + "q" * 60 for i in (59997, 59998, 59999)]
    assert after[3:6] == [f"[node1/r1] rank 1 step {i} " + "q" * 60 for i in (59997, 59998, 59999)]
    assert len(after) == 6 and "corral: done" in lines  # corral's own lines are never held back


def test_a_closed_pipe_ends_the_console_output_not_the_caller() -> None:
    import os

    r, w = os.pipe()
    out = os.fdopen(w, "w")
    os.close(r)  # `corral run ... | head -1` after head has exited
    con = RunConsole(multi_host=False, out=out, color=False)
    for i in range(1000):
        con.line("vm", 0, "log", f"line {i}")
    con.close()  # no BrokenPipeError reaches the run
