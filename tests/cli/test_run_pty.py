"""`umakit run` driven in a real pseudo-terminal, and in piped mode, on the default model."""

import json
import os
import re
import subprocess

import pytest

from support import pty_helpers
from support.markers import requires_default_model
from support.pty_helpers import EXE, PROMPT, say

pexpect = pytest.importorskip("pexpect")

pytestmark = [pytest.mark.slow, requires_default_model]


@pytest.fixture(scope="module", autouse=True)
def default_model_imported():
    """Import the GGUF once, outside the timed interactions."""
    import umakit

    umakit.resolve_model(None)


def spawn(*args):
    return pty_helpers.spawn(pexpect, *args, timeout=180)


def command(child, text):
    child.sendline(text)
    child.expect_exact(PROMPT)
    return child.before


def quit(child):
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_second_turn_prefills_only_new_tokens():
    child = spawn("--max-tokens", "12")
    new1, reused1 = say(child, "Hi!")
    new2, reused2 = say(child, "What is 2+2?")
    assert reused1 == 0 and new1 > 0
    assert reused2 > new1 - 1  # the whole first turn (at least its prompt) came from the cache
    assert new2 < reused2 + new2 and new2 < 40  # only the new turn's tokens were prefilled
    stats = command(child, "/stats")
    cached = int(re.search(r"cache (\d+) tok", stats).group(1))
    assert cached >= reused2 + new2
    command(child, "/reset")
    assert "cache 0 tok" in command(child, "/stats")
    new3, reused3 = say(child, "Hi!")
    assert (new3, reused3) == (new1, 0)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_reply_and_session_continues():
    child = spawn("--max-tokens", "2000")
    child.sendline("Write a very long story about a dragon who loves libraries.")
    child.expect_exact("libraries.\r\n")  # the echo of the input line
    child.expect(r"\w+ \w+ \w+")  # the reply has started streaming
    child.sendintr()
    child.expect("reply stopped")
    child.expect_exact(PROMPT)
    command(child, "/set max_tokens 8")
    new, reused = say(child, "Thanks!")
    assert reused > 0  # the cut reply stayed in the history and in the cache
    assert "unknown command /frobnicate" in command(child, "/frobnicate")
    child.sendintr()  # Ctrl-C at an empty prompt says how to quit, and does not
    child.expect_exact("(Ctrl-D or /exit quits)")
    child.expect_exact(PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_save_then_load_reproduces_history(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    child = spawn("--max-tokens", "10", "--system", "You are terse.")
    say(child, "Name a color.")
    say(child, "Name a fruit.")
    assert "saved 4 messages" in command(child, f"/save {first}")
    quit(child)

    child = spawn("--max-tokens", "10")
    out = command(child, f"/load {first}")
    assert re.search(r"loaded 4 messages .* prefilled \d+ tokens", out)
    new, reused = say(child, "Name an animal.")
    assert reused > new  # the restored history was prefilled by /load
    command(child, f"/save {second}")
    quit(child)
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    assert b["messages"][:4] == a["messages"] and b["settings"]["system"] == "You are terse."


def test_piped_mode_is_deterministic_and_plain():
    script = "What is the capital of France?\nAnd what is the capital of Germany?\n"
    outs = [subprocess.run([EXE, "run", "--temp", "0", "--max-tokens", "24"], input=script,
                           capture_output=True, text=True, timeout=300) for _ in range(2)]
    assert all(o.returncode == 0 for o in outs), outs[0].stderr
    assert outs[0].stdout == outs[1].stdout
    replies = outs[0].stdout.split("\n\n")
    assert replies[0] == first_reply("What is the capital of France?") and "Berlin" in replies[1]
    assert "\x1b[" not in outs[0].stdout and outs[0].stderr == ""  # no colours, no footers


def test_ctrl_c_during_a_one_shot_reply_ends_the_process_as_generate_does():
    """`umakit run PROMPT`'s Ctrl-C is generate's: "Interrupted." and exit code 130, not a chat's stopped turn."""
    import signal
    import time

    from umakit.checkpoint.default import packaged_gguf

    proc = subprocess.Popen([EXE, "run", str(packaged_gguf()), "Write a long story about the sea.", "--max-tokens",
                             "2000", "--no-server"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(6)  # loaded and replying
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err.strip().splitlines()[-1] == "Interrupted.", err
    assert out and "reply stopped" not in err and "Traceback" not in err


def first_reply(line: str) -> str:
    """What `umakit generate` answers ``line`` greedily: a chat's first reply, as the chat renders it.

    (The built-in model's greedy answer to the capital of France sits on a near tie of "The" and "L"
    in the CPU default's bfloat16 kernel inputs, so the test does not ask for "Paris".)"""
    out = subprocess.run([EXE, "generate", "-p", line, "--temp", "0", "--max-tokens", "24"], capture_output=True,
                         text=True, timeout=300, check=True)
    return out.stdout.rstrip("\n")


def test_chat_with_most_layers_streamed_from_host_memory():
    child = spawn("--max-tokens", "12", "--gpu-layers", "6", "--backend", "torch")
    assert re.search(r"6/30 layers on cpu, [\d.]+ MiB streamed per token", child.banner)
    new, reused = say(child, "Hi!")
    assert new > 0 and reused == 0
    quit(child)


def test_piped_bad_line_fails_alone():
    script = b"What is the capital of France?\n\xff\xfe not text\nAnd what is the capital of Germany?\n"
    out = subprocess.run([EXE, "run", "--temp", "0", "--max-tokens", "24"], input=script, capture_output=True,
                         timeout=300)
    assert out.returncode == 1
    assert out.stderr.decode().splitlines() == [
        "Error: line 2 of the input is not UTF-8 text: byte 0xff at offset 0 (invalid start byte); "
        "convert it to UTF-8 first"]
    replies = out.stdout.decode().split("\n\n")
    # the lines before and after the bad one ran
    assert replies[0] == first_reply("What is the capital of France?") and "Berlin" in replies[1]


def test_sigterm_or_a_closed_terminal_saves_the_conversation_first(tmp_path):
    import signal
    import time

    env = {**os.environ, "UMAKIT_HOME": os.environ.get("UMAKIT_HOME", str(tmp_path / "home"))}
    proc = subprocess.Popen([EXE, "run", "--temp", "0", "--max-tokens", "8"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        proc.stdin.write(b"My name is Zed.\n")
        proc.stdin.flush()
        reply = b""
        deadline = time.monotonic() + 120
        while not reply.endswith(b"\n\n") and time.monotonic() < deadline:  # a piped reply ends with a blank line
            reply += proc.stdout.read1(4096)
        assert reply.endswith(b"\n\n"), reply
        proc.send_signal(signal.SIGTERM)  # while the chat waits for the next line (stdin stays open)
        proc.wait(timeout=60)
        err = proc.stderr.read().decode()
    finally:
        proc.kill()
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "Error: the chat was ended by SIGTERM"
    saved = re.search(r"conversation saved to (\S+);", err)
    assert saved, err
    messages = json.loads(open(saved.group(1)).read())["messages"]
    assert messages[0] == {"role": "user", "content": "My name is Zed."} and messages[1]["role"] == "assistant"
