"""`corral exec`: one command on every node, folded output, nothing left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import PEAK_RSS_KIB, RESET_PEAK_RSS

from corral.transport.fanout import HostResult
from corral.transport.gather import group_results

CORRAL = [sys.executable, "-m", "corral"]


def test_identical_answers_fold_under_a_host_set() -> None:
    results = [HostResult(host=f"node{i}", returncode=0, stdout="GPU 0: H100\n") for i in (1, 2, 3, 5)]
    results.insert(3, HostResult(host="node4", returncode=0, stdout="No devices found\n"))
    groups = group_results(results)
    assert [(g.label, g.stdout) for g in groups] == [
        ("node[1-3,5]", "GPU 0: H100\n"), ("node4", "No devices found\n")]


def test_exit_codes_split_groups() -> None:
    groups = group_results([HostResult(host="a1", returncode=0), HostResult(host="a2", returncode=1)])
    assert len(groups) == 2


def test_local_exec_and_exit_code(tmp_path: Path) -> None:
    res = subprocess.run(CORRAL + ["exec", "--json", "--", "echo hi; exit 3"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 3
    [row] = json.loads(res.stdout)["hosts"]
    assert row["stdout"] == "hi\n" and row["returncode"] == 3


def test_exec_starts_without_other_commands_imports(tmp_path: Path) -> None:
    # exec is benchmarked against pdsh: its start-up must not pay for what it
    # does not use (TOML, ssh -G's thread pool, GPU detection,
    # rich or asyncio).
    (tmp_path / "hosts").write_text("localhost\n")
    listing = tmp_path / "modules"
    code = ("import atexit, sys; "
            f"atexit.register(lambda: open({str(listing)!r}, 'w').write('\\n'.join(sys.modules))); "
            "from corral.cli import main; main(sys.argv[1:])")
    for fmt in (["--json"], []):
        res = subprocess.run([sys.executable, "-c", code, "exec", *fmt, "-c", "hosts", "--", "echo hi"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
        assert res.returncode == 0, res.stderr
        assert "hi" in res.stdout
        loaded = set(listing.read_text().split())
        # Folded output and the cluster notice are written without rich, and
        # the fan-out loop is selectors, not asyncio.
        assert not loaded & {"tomllib", "corral.inventory.tomlfile", "corral.inventory.sshconfig",
                             "corral.inventory.local", "concurrent.futures.thread", "tempfile",
                             "rich", "asyncio"}


@pytest.mark.sandbox
def test_exec_folds_sandbox_nodes(sandbox) -> None:
    odd = sandbox.nodes[2]
    res = subprocess.run(
        CORRAL + ["exec", "-c", str(sandbox.cluster_file), "--",
                  f'if [ "$(hostname)" = {odd} ]; then echo different; exit 4; else echo same; fi'],
        capture_output=True, text=True, timeout=60)
    assert res.returncode == 4
    others = [n for n in sandbox.nodes if n != odd]
    from corral.hostrange import fold
    assert f"----- {fold(others)} (3) -----\nsame\n" in res.stdout
    assert f"----- {odd} (1) (exit 4) -----\ndifferent\n" in res.stdout


@pytest.mark.sandbox
def test_unreachable_node_is_named_and_others_answer(sandbox, tmp_path: Path) -> None:
    ghost = sandbox.addresses[sandbox.nodes[0]].rsplit(".", 1)[0] + ".251"
    cluster = tmp_path / "c.toml"
    cluster.write_text(sandbox.cluster_file.read_text() + f'\n[[hosts]]\nname = "ghost"\naddress = "{ghost}"\n')
    res = subprocess.run(CORRAL + ["exec", "-c", str(cluster), "--json", "--", "hostname"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 3  # corral's "unreachable", not ssh's 255
    rows = {r["host"]: r for r in json.loads(res.stdout)["hosts"]}
    assert rows["ghost"]["returncode"] == 255 and all(rows[n]["returncode"] == 0 for n in sandbox.nodes)
    assert all(rows[n]["stdout"].strip() == n for n in sandbox.nodes)
    assert "unreachable" in rows["ghost"]["error"] or "refused" in rows["ghost"]["error"]


def test_exec_on_hosts_it_cannot_reach_exits_3_not_255(tmp_path: Path) -> None:
    # ssh's own 255 leaked out as exec's exit code; every other command says 3.
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 port=1\n127.0.0.2 port=1\n")
    res = subprocess.run(CORRAL + ["exec", "-c", str(hostfile), "--", "true"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 3, res.stderr
    assert "----- 127.0.0.[1-2] (2) (ssh failed) -----\nconnection refused" in res.stdout
    # a command's own code is still passed through, the largest of all hosts'
    res = subprocess.run(CORRAL + ["exec", "--", "exit 7"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 7, res.stderr


def _count(sandbox, pattern: str) -> int:
    return sum(sandbox.exec(n, ["sh", "-c", f"ps -eo args | grep -c '[{pattern[0]}]{pattern[1:]}' || true"]
                            ).stdout.strip() not in ("", "0") for n in sandbox.nodes)


@pytest.mark.sandbox
def test_timeout_and_ctrl_c_leave_nothing_on_nodes(sandbox) -> None:
    # A command that ignores SIGTERM, stopped by --timeout.
    res = subprocess.run(CORRAL + ["exec", "-c", str(sandbox.cluster_file), "--timeout", "1", "--",
                                   "trap '' TERM; sleep 41"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 124 and "did not finish within 1s" in res.stdout
    assert _count(sandbox, "sleep 41") == 0
    # Ctrl-C while every node runs a command.
    # (a tree: a background grandchild and a foreground one, both must go)
    proc = subprocess.Popen(CORRAL + ["exec", "-c", str(sandbox.cluster_file), "--",
                                      "sleep 420 & sh -c 'sleep 42'; wait"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while _count(sandbox, "sleep 42") < len(sandbox.nodes):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 130
    # what the nodes had answered is still shown, folded, with the stop said once
    assert "-----" in out and "interrupted; the command was stopped on every node" in err
    deadline = time.monotonic() + 10
    while _count(sandbox, "sleep 42"):
        assert time.monotonic() < deadline, "commands left running after Ctrl-C"
        time.sleep(0.2)


@pytest.mark.sandbox
def test_sigterm_and_head_sigkill_leave_nothing_on_nodes(sandbox) -> None:
    # SIGTERM (a scheduler, `timeout`) tears down like Ctrl-C ...
    for sig, code, pattern in ((signal.SIGTERM, 130, "sleep 43"), (signal.SIGKILL, -9, "sleep 44")):
        proc = subprocess.Popen(CORRAL + ["exec", "-c", str(sandbox.cluster_file), "--", pattern],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while _count(sandbox, pattern) < len(sandbox.nodes):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(sig)
        proc.wait(timeout=20)
        assert proc.returncode == code
        # ... and a SIGKILLed head's closed pipes reach every node's wrapper.
        deadline = time.monotonic() + 15
        while _count(sandbox, pattern):
            assert time.monotonic() < deadline, f"{pattern!r} left running after signal {sig}"
            time.sleep(0.2)


@pytest.mark.sandbox
def test_fanout_bounds_hosts_at_once_and_streams_lines(sandbox) -> None:
    # Each host prints when its command started and ended; with -f 2, no
    # more than two of the four may overlap.
    cmd = "date +%s.%N; sleep 1; date +%s.%N; printf 'no newline'; echo oops >&2"
    res = subprocess.run(CORRAL + ["exec", "-c", str(sandbox.cluster_file), "-f", "2", "--no-fold", "--", cmd], check=False,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    spans: dict[str, list[float]] = {}
    for line in res.stdout.splitlines():
        host, _, text = line.partition(": ")
        if text == "no newline":
            continue
        spans.setdefault(host, []).append(float(text))
    assert sorted(spans) == sorted(sandbox.nodes) and all(len(v) == 2 for v in spans.values())
    for host in sandbox.nodes:
        # an unterminated last line is still a line, and stderr is streamed too
        assert f"{host}: no newline\n" in res.stdout and f"{host}: oops\n" in res.stderr
    for t in [s for s, _ in spans.values()]:
        assert sum(s <= t < e for s, e in spans.values()) <= 2
    assert max(e for _, e in spans.values()) - min(s for s, _ in spans.values()) >= 2  # two waves


def test_library_call_off_the_main_thread(tmp_path: Path) -> None:
    # The library API needs no CLI and no main thread (no signal handlers then).
    import threading

    from corral.model import Cluster, Host
    from corral.transport.fanout import run_everywhere

    cluster = Cluster(hosts=(Host(name="localhost", local=True),), source="test")
    out: list = []
    t = threading.Thread(target=lambda: out.append(run_everywhere(cluster, "echo $((6*7)); exit 5")))
    t.start()
    t.join(30)
    [r] = out[0]
    assert (r.host, r.returncode, r.stdout, r.ok) == ("localhost", 5, "42\n", False)


def test_command_sees_none_of_the_wrappers_variables(tmp_path: Path) -> None:
    # Like `ssh host CMD`: no positional arguments, no wrapper state, stdin empty.
    res = subprocess.run(CORRAL + ["exec", "--json", "--", 'echo "[$#][$1][$s][$c][$w]"; cat; exit 7'],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    [row] = json.loads(res.stdout)["hosts"]
    assert (row["returncode"], row["stdout"]) == (7, "[0][][][][]\n")


def test_command_runs_in_the_login_shell_like_under_ssh(tmp_path: Path) -> None:
    # `ssh host CMD` runs CMD with the login shell ($SHELL -c): bash syntax and
    # `source venv/bin/activate` work, not only POSIX sh.
    env = dict(os.environ, SHELL="/bin/bash")
    res = subprocess.run(CORRAL + ["exec", "--json", "--", "echo {1..3}; [[ -d / ]] && source /dev/null && echo ok"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False, env=env)
    [row] = json.loads(res.stdout)["hosts"]
    assert (row["returncode"], row["stdout"]) == (0, "1 2 3\nok\n")


def test_command_runs_like_under_ssh_with_sigint_not_ignored(tmp_path: Path) -> None:
    # `ssh host CMD` starts CMD with default dispositions; a background job of
    # a non-interactive sh would have SIGINT and SIGQUIT ignored (Python then
    # never raises KeyboardInterrupt, `kill -INT` of its children does nothing).
    res = subprocess.run(CORRAL + ["exec", "--json", "--", "grep SigIgn /proc/self/status"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    [row] = json.loads(res.stdout)["hosts"]
    ignored = int(row["stdout"].split()[1], 16)
    assert row["returncode"] == 0 and not ignored & (1 << (signal.SIGINT - 1) | 1 << (signal.SIGQUIT - 1))


def test_timeout_stops_a_command_that_obeys_sigterm_at_once(tmp_path: Path) -> None:
    # The grace before SIGKILL is a ceiling, not a wait: a command gone on
    # SIGTERM ends the host's answer right away (it used to take 2 s more),
    # and the wrapper's own "Terminated" is not the command's output.
    marker = tmp_path / "cleaned"
    started = time.monotonic()
    res = subprocess.run(CORRAL + ["exec", "--json", "--timeout", "1", "--",
                                   f"trap 'echo bye > {marker}; exit 3' TERM; sleep 48 & wait"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    elapsed = time.monotonic() - started
    [row] = json.loads(res.stdout)["hosts"]
    assert res.returncode == 124 and "did not finish within 1s" in row["error"]
    assert marker.read_text() == "bye\n"  # its TERM trap ran
    assert "Terminated" not in row["stderr"]
    assert elapsed < 2.8, f"teardown waited the whole grace: {elapsed:.1f}s"
    assert subprocess.run(["pgrep", "-f", "sleep 48"], capture_output=True).returncode == 1


def test_wrapper_outside_its_own_session_stops_its_descendants(tmp_path: Path) -> None:
    # When neither the wrapper nor its parent leads the session (a ForceCommand,
    # sudo, a login shell that forks twice), the session is not the command's
    # to kill: the wrapper falls back to its own descendants, and only them.
    from corral.transport.fanout import remote_argv

    bystander = subprocess.Popen(["sleep", "49"])  # same session, not the wrapper's
    try:
        argv = ["sh", "-c", 'sh -c "$@"; echo done', "sh", *remote_argv("sleep 50 & sh -c 'sleep 51'")[2:]]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 10
        while subprocess.run(["pgrep", "-f", "sleep 51"], capture_output=True).returncode:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert proc.stdin is not None
        proc.stdin.close()  # the channel closes
        assert proc.stdout is not None
        assert proc.stdout.read() == "done\n" and proc.wait(10) == 0
        deadline = time.monotonic() + 5
        while subprocess.run(["pgrep", "-f", "sleep 5[01]"], capture_output=True).returncode == 0:
            assert time.monotonic() < deadline, "the wrapper's descendants survived"
            time.sleep(0.1)
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()


def test_sshs_fallback_when_a_node_refuses_another_session_is_not_output() -> None:
    # A node's sshd with a low MaxSessions refuses a second session on the
    # shared connection; ssh says so and opens its own, and the command runs:
    # those two lines are not the command's, and would split the node from
    # the others' identical output (seen on the sandbox with `MaxSessions 1`).
    from corral.model import Cluster, Host
    from corral.transport.fanout import run_everywhere

    noise = ("mux_client_request_session: session request failed: Session open refused by peer",
             "ControlSocket /root/.cache/corral/ssh/6389e284/d585f already exists, disabling multiplexing")
    command = "; ".join(f"echo '{line}' >&2" for line in noise) + "; echo out; echo a real error >&2"
    seen = []
    [res] = run_everywhere(Cluster(hosts=(Host(name="localhost", local=True),)), command,
                           on_line=lambda host, stream, line: seen.append((stream, line)))
    assert res.returncode == 0
    assert res.stdout == "out\n" and res.stderr == "a real error\n"
    assert sorted(seen) == [("err", "a real error"), ("out", "out")]


@pytest.mark.parametrize("shell", ["dash", "bash", "zsh", "fish", "tcsh"])
def test_a_command_reaches_any_login_shell_as_under_ssh(shell: str) -> None:
    # sshd runs the line with the node user's login shell, `$SHELL -c LINE`;
    # the wrapper then runs the command with it again.  A multi-line command
    # failed on a tcsh node ("Unmatched '''."; csh takes no newline inside
    # quotes), and fish halved the backslashes inside single quotes: what the
    # command ran was not what `ssh host CMD` runs.
    import shutil

    from corral.model import Cluster, Host
    from corral.transport.fanout import remote_argv
    from corral.transport.ssh import SSHTransport

    path = shutil.which(shell)
    if path is None:
        pytest.skip(f"{shell} is not installed")
    command = "echo one\nprintf '%s|' 'a\\\\\\\\b' 'c\\d' \"it's\"\n\necho two\n"
    cluster = Cluster(hosts=(Host(name="gpu1"),))
    line = SSHTransport(cluster, multiplex=False).argv(cluster.hosts[0], remote_argv(command))[-1]
    env = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8", "SHELL": path}

    def login(cmd: str) -> tuple[int, str, str]:
        proc = subprocess.Popen([path, "-c", cmd], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
        out, err = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
        proc.stdin.close()  # type: ignore[union-attr]  # the channel stays open while the command runs
        return proc.wait(10), out, err

    under_ssh = login(command)
    assert under_ssh[0] == 0 and under_ssh[1].startswith("one\n") and under_ssh[1].endswith("two\n")
    assert login(line) == under_ssh


# ---- what a node prints is untrusted ------------------------------------------------------

#: A command that writes the clipboard (OSC 52), sets the window title (OSC 0)
#: and prints a colour, on stdout and on stderr.
HOSTILE = (r"printf '\033]52;c;cHduZWQ=\007\033]0;owned\007\033[31mred\033[0m ok\n'; "
           r"printf '\033]0;err-title\033\\\033[32mgreen\033[0m err\n' >&2")


@pytest.mark.parametrize("fmt", [[], ["--no-fold"]])
def test_terminal_controls_from_a_node_never_reach_the_terminal(fmt: list[str], tmp_path: Path) -> None:
    res = subprocess.run(CORRAL + ["exec", *fmt, "--", HOSTILE], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    shown = res.stdout + res.stderr
    assert "\x1b]" not in shown and "owned" not in shown and "err-title" not in shown
    # Colours pass, as under pdsh.
    assert "\x1b[31mred\x1b[0m ok" in res.stdout and "\x1b[32mgreen\x1b[0m err" in shown


def test_json_keeps_a_nodes_text_escaped(tmp_path: Path) -> None:
    res = subprocess.run(CORRAL + ["exec", "--json", "--", HOSTILE], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, check=False)
    assert "\x1b" not in res.stdout  # JSON escapes it: \u001b
    [row] = json.loads(res.stdout)["hosts"]
    assert row["stdout"].startswith("\x1b]52;c;cHduZWQ=\x07") and row["stderr"].startswith("\x1b]0;err-title")


def test_endless_output_keeps_a_bounded_head_in_memory(tmp_path: Path) -> None:
    # pdsh-like, the head kept all of it: 200 MB of output took the head
    # past 600 MB (bytes, joined, decoded).  Now 1 MiB per stream is kept.
    from corral.frames import cut_marker
    from corral.transport.fanout import MAX_OUTPUT

    code = """if True:
        import json
        RESET_PEAK
        from corral.transport.fanout import run_everywhere
        from corral.model import Cluster, Host
        cmd = "head -c 200M /dev/zero | tr '\\\\0' a; echo done >&2"
        [r] = run_everywhere(Cluster(hosts=(Host(name="localhost", local=True),), source="test"), cmd)
        print(json.dumps({"stdout": r.stdout, "stderr": r.stderr, "cut": r.stdout_cut, "rc": r.returncode,
                          "peak_kib": PEAK_KIB}))
    """.replace("RESET_PEAK", RESET_PEAK_RSS).replace("PEAK_KIB", PEAK_RSS_KIB)
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    total = 200 * 1024 * 1024
    assert out["rc"] == 0 and out["stderr"] == "done\n"
    assert out["cut"] == total - MAX_OUTPUT
    assert out["stdout"] == "a" * MAX_OUTPUT + cut_marker(total - MAX_OUTPUT) + "\n"
    assert out["peak_kib"] < 150 * 1024  # the output was 200 MiB


def test_the_cut_is_said_in_folded_json_and_live_output(tmp_path: Path) -> None:
    from corral.frames import MAX_LINE, cut_marker
    from corral.transport.fanout import MAX_OUTPUT

    mib = 1024 * 1024
    cmd = (r"head -c 3M /dev/zero | tr '\0' a; echo; echo end; "
           r"head -c 2M /dev/zero | tr '\0' z >&2")

    def run(*fmt: str) -> subprocess.CompletedProcess:
        res = subprocess.run(CORRAL + ["exec", *fmt, "--", cmd], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120, check=False)
        assert res.returncode == 0, res.stderr[-2000:]
        return res

    [row] = json.loads(run("--json").stdout)["hosts"]
    assert (row["stdout_cut"], row["stderr_cut"]) == (3 * mib + 5 - MAX_OUTPUT, 2 * mib - MAX_OUTPUT)
    assert row["stdout"] == "a" * MAX_OUTPUT + cut_marker(3 * mib + 5 - MAX_OUTPUT) + "\n"
    assert row["stderr"] == "z" * MAX_OUTPUT + cut_marker(2 * mib - MAX_OUTPUT) + "\n"

    folded = run().stdout
    assert folded.count("a") == MAX_OUTPUT and folded.count("z") == MAX_OUTPUT
    assert cut_marker(3 * mib + 5 - MAX_OUTPUT) in folded and cut_marker(2 * mib - MAX_OUTPUT) in folded

    # Live, every line is shown, each cut at MAX_LINE.
    live = run("--no-fold")
    host = row["host"]
    assert live.stdout.splitlines() == [f"{host}: " + "a" * MAX_LINE + cut_marker(3 * mib - MAX_LINE),
                                        f"{host}: end"]
    assert live.stderr.splitlines()[-1] == f"{host}: " + "z" * MAX_LINE + cut_marker(2 * mib - MAX_LINE)


@pytest.mark.sandbox
def test_nodes_over_ssh_reach_the_terminal_bounded_and_without_controls(sandbox) -> None:
    from corral.frames import cut_marker
    from corral.transport.fanout import MAX_OUTPUT

    cmd = HOSTILE + r"; head -c 3M /dev/zero | tr '\0' a"
    res = subprocess.run(CORRAL + ["exec", "-c", str(sandbox.cluster_file), "--", cmd], check=False,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    shown = res.stdout + res.stderr
    assert "\x1b]" not in shown and "owned" not in shown and "\x1b[31mred" in shown
    # Every node said the same, cut at the same place: one group.
    said = len(b"\x1b]52;c;cHduZWQ=\x07\x1b]0;owned\x07\x1b[31mred\x1b[0m ok\n") + 3 * 1024 * 1024
    assert res.stdout.count("-----\n") == 1 and res.stdout.count(cut_marker(said - MAX_OUTPUT)) == 1


def test_progress_is_reported_while_hosts_are_still_running(monkeypatch) -> None:
    """Hundreds of nodes take seconds: the caller hears how far it is."""
    from corral.model import Cluster, Host
    from corral.transport import fanout
    from corral.transport.fanout import run_everywhere

    monkeypatch.setattr(fanout, "PROGRESS_S", 0.2)
    hosts = tuple(Host(name=f"n{i}", local=True) for i in range(3))
    seen: list[tuple[int, int]] = []
    results = run_everywhere(Cluster(hosts=hosts, source="test"), "sleep 1", on_progress=lambda d, t: seen.append((d, t)))
    assert all(r.returncode == 0 for r in results)
    assert seen and all(t == 3 and 0 <= d < 3 for d, t in seen), seen
