"""Internal errors: one line naming the bug and its log, the traceback in ``$UMAKIT_HOME/logs/``; Ctrl-C is exit 130."""

import os
import re
import signal
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from support.markers import requires_default_model
from umakit.cli import crashlog
from umakit.cli import main as cli_main
from umakit.errors import InvalidArgumentError

EXE = os.path.join(os.path.dirname(sys.executable), "umakit")
LINE = re.compile(r"Error: internal error \(TypeError: unsupported operand type\(s\) for \+: 'int' and 'str'\); "
                  r"details in (\S+)")


@click.command("boom")
@click.option("--kind", default="bug")
def boom(kind):
    if kind == "bug":
        return 1 + "x"  # a genuine internal error: TypeError
    if kind == "user":
        raise InvalidArgumentError("--kind is wrong")
    raise KeyboardInterrupt


@pytest.fixture
def run(monkeypatch, tmp_path):
    monkeypatch.setitem(cli_main.COMMANDS, "boom", f"{__name__}:boom")
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("UMAKIT_DEBUG", raising=False)

    def invoke(*args):
        return CliRunner().invoke(cli_main.main, ["boom", *args])

    return invoke


def test_internal_error_is_one_line_and_a_log(run, tmp_path):
    result = run()
    assert result.exit_code == 1
    assert result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and LINE.fullmatch(lines[0]), lines
    path = LINE.fullmatch(lines[0]).group(1)
    assert os.path.dirname(path) == str(tmp_path / "home" / "logs")
    log = open(path).read()
    assert "Traceback" in log and "TypeError" in log and "1 + \"x\"" in log and "command:" in log
    assert not [p for p in os.listdir(tmp_path / "home" / "logs") if p.endswith(".tmp")]


def test_umakit_debug_shows_the_traceback(run, monkeypatch):
    monkeypatch.setenv("UMAKIT_DEBUG", "1")
    result = run()
    assert result.exit_code == 1
    assert "Traceback (most recent call last)" in result.stderr and 'return 1 + "x"' in result.stderr
    assert result.stderr.splitlines()[-1].startswith("Error: internal error (TypeError: ")


def test_unusable_home_still_gives_one_line(run, tmp_path, monkeypatch):
    home = tmp_path / "a-file"
    home.write_text("not a directory")
    monkeypatch.setenv("UMAKIT_HOME", str(home))
    result = run()
    assert result.exit_code == 1 and "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert re.fullmatch(r"Error: internal error \(TypeError: .+\); the log could not be written: cannot use .+",
                        lines[0])


def test_user_errors_and_ctrl_c_are_not_internal(run, tmp_path):
    result = run("--kind", "user")
    assert (result.exit_code, result.stderr) == (1, "Error: --kind is wrong\n")
    result = run("--kind", "interrupt")
    assert result.exit_code == 130 and result.stderr.strip() == "Interrupted."
    assert not (tmp_path / "home" / "logs").exists()


def test_logs_are_pruned(tmp_path, monkeypatch):
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path))
    monkeypatch.setattr(crashlog, "KEEP_LOGS", 3)
    paths = []
    for i in range(5):
        try:
            raise ValueError(f"number {i}\nsecond line")
        except ValueError as e:
            paths.append(crashlog.write(e))
            assert crashlog.summary(e) == f"ValueError: number {i}"
    assert sorted(os.listdir(tmp_path / "logs")) == [p.name for p in paths[-3:]]


def test_summary_is_one_short_line():
    assert crashlog.summary(KeyError()) == "KeyError"
    assert len(crashlog.summary(RuntimeError("x" * 1000))) == crashlog.SUMMARY_CHARS


@pytest.mark.slow
@requires_default_model
def test_ctrl_c_in_generate_exits_130_without_a_traceback():
    import umakit

    umakit.resolve_model(None)
    # greedy counting never reaches an end of text: 2000 tokens take seconds even at 200 tok/s, so the
    # signal lands mid-reply (a sampled story could end before it, as it did once CI decoded that fast)
    proc = subprocess.Popen([EXE, "generate", "--raw", "--temp", "0", "-p", "1, 2, 3, 4, 5, 6, 7, 8,",
                             "--max-tokens", "2000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.read(20)  # the reply is streaming
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.strip().splitlines() == ["Interrupted."], err
