"""The chat survives whatever a user does: Ctrl-C at any moment of a turn, and any bad slash command.

In-process (a tiny model, `Repl.run_one`): every bad command is one ``Error:``
line and the session goes on; a bug is one line with a log; an error that ends
the chat saves its transcript first. In a real pseudo-terminal (the default
model): Ctrl-C right after Enter, during a multi-thousand-token prefill and
during the reply each return to the prompt within 0.5 s, and the next turn
sees the earlier history.
"""

import json
import os
import re
import time

import pytest

from support import pty_helpers
from support.markers import requires_default_model
from support.pty_helpers import PROMPT, say
from umakit.generate.chat import ChatSession, ChatSettings
from umakit.cli import chat_ui
from umakit.generate.sampling import SamplingParams

WORDS = "apple river stone cloud music paper garden window silver orange".split()


def make_repl(model):
    session = ChatSession(model, ChatSettings(max_tokens=4, sampling=SamplingParams(temperature=0)))
    return chat_ui.Repl(session, color=False, show_stats=False)


def bad_commands(tmp_path):
    junk = tmp_path / "junk.json"
    junk.write_bytes(bytes(range(256)))
    shapes = {"list.json": [1, 2], "nan.json": '{"messages": [], "settings": {"sampling": {"temperature": NaN}}}',
              "roles.json": {"messages": [{"role": "wizard", "content": "x"}]},
              "types.json": {"messages": [], "settings": {"max_tokens": "many"}}}
    for name, data in shapes.items():
        (tmp_path / name).write_text(data if isinstance(data, str) else json.dumps(data))
    (tmp_path / "file").write_text("x")
    return [
        ("/save", "usage: /save FILE"), (f"/save {tmp_path}", "is a directory"),
        (f"/save {tmp_path}/file/t.json", "cannot write"), ("/save /proc/umakit-none/t.json", "cannot write"),
        ("/load", "usage: /load FILE"), (f"/load {tmp_path}", "is a directory"),
        (f"/load {junk}", "not UTF-8 text"), (f"/load {tmp_path}/missing.json", "no such transcript"),
        (f"/load {tmp_path}/list.json", "not an object with messages"),
        (f"/load {tmp_path}/nan.json", "temperature must be a finite number"),
        (f"/load {tmp_path}/roles.json", "a role of system, user, assistant"),
        (f"/load {tmp_path}/types.json", "max_tokens must be an integer"),
        ("/set", "usage: /set NAME VALUE"), ("/set temp", "usage: /set NAME VALUE"),
        ("/set temp nan", "finite"), ("/set temp inf", "finite"), ("/set temp -1", ">= 0"),
        ("/set temp hot", "must be a number"), ("/set top_p 2", "top_p must be in"),
        ("/set top_k 1.5", "must be an integer"), ("/set max_tokens 0", "at least 1"),
        ("/set max_tokens many", "must be an integer"), ("/set seed 99999999999999999999999", "seed must be in"),
        ("/set seed x", "must be an integer"), ("/set colour red", "unknown setting colour"),
        ("/frobnicate", "unknown command /frobnicate"),
    ]


def test_every_bad_command_is_one_error_line(tiny_model, tmp_path, capsys):
    repl = make_repl(tiny_model)
    assert repl.run_one("The quick brown")
    before = [dict(m) for m in repl.session.messages]
    settings = repl.session.settings.to_dict()
    capsys.readouterr()
    for line, message in bad_commands(tmp_path):
        assert repl.run_one(line), line  # the session goes on
        out, err = capsys.readouterr()
        errors = [x for x in (out + err).splitlines() if x.startswith("Error:")]
        assert len(errors) == 1 and message in errors[0], (line, out, err)
        assert "Traceback" not in out + err
    assert repl.session.messages == before and repl.session.settings.to_dict() == settings
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "junk.json", "list.json", "nan.json",
                                                          "roles.json", "types.json"]
    assert repl.run_one("fox jumps")
    assert len(repl.session.messages) == 4


def test_a_bug_in_a_turn_is_logged_and_the_session_goes_on(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path))
    repl = make_repl(tiny_model)
    repl.run_one("The quick brown")
    real = repl.session.model.stream_tokens

    def broken(*a, **kw):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(repl.session.model, "stream_tokens", broken)
    capsys.readouterr()
    assert repl.run_one("fox jumps")
    err = capsys.readouterr().err
    m = re.fullmatch(r"Error: internal error \(TypeError: unsupported operand\); details in (\S+)\n", err)
    assert m, err
    assert "Traceback" in open(m.group(1)).read() and os.path.dirname(m.group(1)) == str(tmp_path / "logs")
    monkeypatch.setattr(repl.session.model, "stream_tokens", real)
    assert len(repl.session.messages) == 2  # the failed turn was taken back
    assert repl.run_one("fox jumps") and len(repl.session.messages) == 4


def test_an_error_that_ends_the_chat_saves_the_transcript(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("UMAKIT_HOME", str(tmp_path))
    monkeypatch.setattr(chat_ui, "_enable_line_editing", lambda: False)
    lines = iter(["The quick brown"])

    def read(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise OSError(5, "Input/output error") from None  # the terminal went away

    monkeypatch.setattr(chat_ui, "read_message", read)
    repl = make_repl(tiny_model)
    with pytest.raises(OSError):
        repl.interactive()
    err = capsys.readouterr().err
    path = re.search(r"conversation saved to (\S+); /load \1 brings it back", err).group(1)
    assert os.path.dirname(path) == str(tmp_path / "sessions")
    again = make_repl(tiny_model)
    again.session.load(path)
    assert again.session.messages == repl.session.messages and len(again.session.messages) == 2


def test_prompt_escapes_are_marked_for_readline():
    styled = "\x1b[1m>>> \x1b[0m"
    assert chat_ui.readline_prompt(styled) == "\001\x1b[1m\002>>> \001\x1b[0m\002"
    assert chat_ui.readline_prompt(">>> ") == ">>> "


# -- in a real terminal, on the default model ------------------------------------------------------------

def pty(test):
    return pytest.mark.slow(requires_default_model(test))


@pytest.fixture(scope="module")
def pexpect():
    pexpect = pytest.importorskip("pexpect")
    import umakit

    umakit.resolve_model(None)  # import the GGUF once, outside the timed interactions
    return pexpect


def spawn(pexpect, *args, term="dumb"):
    return pty_helpers.spawn(pexpect, "--max-tokens", "8", *args, term=term)


def interrupt(child, *notices):
    """Ctrl-C; the seconds until the prompt is back, after one of ``notices``."""
    start = time.monotonic()
    child.sendintr()
    child.expect([re.escape(n) for n in notices])
    child.expect_exact(PROMPT)
    return time.monotonic() - start


def saved(child, path):
    child.sendline(f"/save {path}")
    child.expect_exact("(saved")
    child.expect_exact(PROMPT)
    return json.loads(path.read_text())["messages"]


def finish(pexpect, child):
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pty
def test_ctrl_c_right_after_enter(pexpect, tmp_path):
    child = spawn(pexpect, term="xterm")
    say(child, "My name is Zed.")
    child.sendline("/set max_tokens 2000")  # so no reply can finish before the Ctrl-C lands
    child.expect_exact(PROMPT)
    for i in range(3):
        child.sendline(f"Tell me a long story number {i}.")
        child.expect_exact(f"number {i}.\r\n")  # Enter was taken: the turn is starting
        # the signal may land before readline took the line: the prompt then says how to quit, and stays
        assert interrupt(child, "(cancelled)", "(stopped before the reply", "(reply stopped",
                         "(Ctrl-D or /exit quits)") < 0.5
    child.sendline("/set max_tokens 8")
    child.expect_exact(PROMPT)
    new, reused = say(child, "What is my name?")
    assert reused > 0  # the first turn is still in the cache
    messages = saved(child, tmp_path / "t.json")
    assert messages[0]["content"] == "My name is Zed." and messages[-2]["content"] == "What is my name?"
    screen = child.logfile_read.getvalue()
    assert "\x1b[1m>>> " in screen  # a bold prompt ...
    assert "\x01" not in screen and "\x02" not in screen  # ... whose zero-width markers readline took, not the screen
    finish(pexpect, child)


@pty
def test_ctrl_c_during_a_long_prefill(pexpect, tmp_path):
    child = spawn(pexpect)
    say(child, "My name is Zed.")
    lines = [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(50)) for i in range(60)]
    for line in lines:  # 3,000 words, one message: each line ends in a backslash
        child.send(line + " \\\r")
        child.expect_exact("... ")
    child.send("That is all.\r")
    child.expect_exact("That is all.\r\n")
    time.sleep(1.0)  # well into the prefill, far from its end
    assert interrupt(child, "(stopped before the reply") < 0.5
    child.sendline("/stats")
    child.expect(r"turns 1 · prefilled (\d+) tok")
    assert 30 < int(child.match.group(1)) < 3000  # part of the long message was prefilled, not all of it
    child.expect_exact(PROMPT)
    new, reused = say(child, "What is my name?")
    assert reused > 20 and new < 40  # the first turn came from the cache; the dropped message is gone
    messages = saved(child, tmp_path / "t.json")
    assert [m["content"] for m in messages[::2]] == ["My name is Zed.", "What is my name?"]
    finish(pexpect, child)


@pty
def test_ctrl_c_during_the_reply(pexpect, tmp_path):
    child = spawn(pexpect, "--max-tokens", "2000")
    say(child, "My name is Zed.")
    child.sendline("Write a very long story about a dragon who loves libraries.")
    child.expect_exact("libraries.\r\n")
    child.expect(r"\w+ \w+ \w+ \w+")  # the reply is streaming
    assert interrupt(child, "(reply stopped") < 0.5
    child.sendline("/set max_tokens 8")
    child.expect_exact(PROMPT)
    new, reused = say(child, "What is my name?")
    assert reused > 40  # both earlier turns, the cut reply included, came from the cache
    messages = saved(child, tmp_path / "t.json")
    assert len(messages) == 6 and messages[3]["content"].endswith(" [cut]")
    finish(pexpect, child)


@pty
def test_bad_commands_leave_the_session_alive(pexpect, tmp_path):
    child = spawn(pexpect)
    say(child, "My name is Zed.")
    for line, message in bad_commands(tmp_path):
        child.sendline(line)
        child.expect_exact(PROMPT)
        out = child.before
        assert out.count("Error:") == 1 and message in out and "Traceback" not in out, (line, out)
    new, reused = say(child, "What is my name?")
    assert reused > 20
    finish(pexpect, child)
