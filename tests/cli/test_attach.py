"""`umakit generate` and `umakit run` attached to a running `umakit serve`: the same text as in-process, the
server's figures, Ctrl-C in a chat, and one `Error:` line when the server goes away mid-reply."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.serve_helpers import ServerProcess, start_server

pexpect = pytest.importorskip("pexpect")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(None, ["--backend", "torch", "--peak-bandwidth", "100", "--keep-alive", "-1"], tmp_path_factory)
    yield srv
    srv.stop()


def generate(*args, **kw):
    return subprocess.run([sys.executable, "-m", "umakit.cli.main", "generate", *args], capture_output=True,
                          text=True, timeout=120, **kw)


def test_attached_generate_gives_the_in_process_text(server, tiny_dir):
    args = ["-m", str(tiny_dir("llama")), "-p", "The quick", "--temp", "0", "--max-tokens", "12"]
    here = generate(*args, "--no-server")
    there = generate(*args, "--server", server.url)
    assert here.returncode == there.returncode == 0, there.stderr
    assert there.stdout == here.stdout
    assert f"served by {server.url}" in there.stderr and "served by" not in here.stderr
    raw = generate(*args, "--raw", "--regex", "[0-9]{3}", "--server", server.url)
    assert raw.returncode == 0 and raw.stdout.strip().isdigit() and len(raw.stdout.strip()) == 3
    # what only this process can do (here an engine option) loads the model here, server or not
    local = generate(*args, "--backend", "torch", "--server", server.url)
    assert local.stdout == here.stdout and "served by" not in local.stderr


def test_a_server_that_goes_away_mid_reply_is_one_error_line(tiny_dir, tmp_path):
    home = tmp_path / "home"
    srv = ServerProcess(None, ["--backend", "torch", "--peak-bandwidth", "100"], tmp_path / "server.log",
                        env={"UMAKIT_HOME": str(home)})
    try:
        srv.wait_healthy()
        proc = subprocess.Popen([sys.executable, "-m", "umakit.cli.main", "generate", "-m", str(tiny_dir("llama")),
                                 # a reply that cannot end early: 400 letters before an end-of-sequence is allowed
                                 "-p", "The quick", "--max-tokens", "480", "--raw", "--regex", "[a-z]{400}",
                                 "--server", srv.url],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout.read(1)  # the reply has started
        srv.proc.kill()
        out, err = proc.communicate(timeout=60)
    finally:
        srv.stop()
    lines = err.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("Error: the server at "), err
    assert "went away" in lines[0] and "Traceback" not in err


# -- `umakit run` attached ------------------------------------------------------------------------------------


def run_piped(*args, lines: str):
    return subprocess.run([sys.executable, "-m", "umakit.cli.main", "run", "--temp", "0", *args], input=lines,
                          capture_output=True, text=True, timeout=180)


def test_attached_chat_gives_the_in_process_replies(server, tiny_dir):
    args = ["--max-tokens", "10", str(tiny_dir("llama"))]
    lines = "The quick brown fox\nAnd then?\n"
    here = run_piped(*args, "--no-server", lines=lines)
    there = run_piped(*args, "--server", server.url, lines=lines)
    assert here.returncode == there.returncode == 0, there.stderr
    assert there.stdout == here.stdout and there.stdout.count("\n\n") == 2  # two turns, the same text
    # --max-context is this process's own: the model loads here (its banner is not printed when piped, so
    # the server's request count tells)
    before = _requests(server)
    local = run_piped(*args, "--max-context", "256", "--server", server.url, lines=lines)
    assert local.stdout == here.stdout and _requests(server) == before


def test_a_prompt_argument_is_answered_once_with_the_piped_text_after_it(server, tiny_dir):
    """`umakit run MODEL PROMPT`: one reply, generate's, and the process ends; text piped in joins the prompt
    after a blank line; attached to a server, the same reply."""
    model = str(tiny_dir("llama"))

    def generated(prompt):
        out = subprocess.run([sys.executable, "-m", "umakit.cli.main", "generate", model, prompt, "--temp", "0",
                              "--max-tokens", "10", "--no-server", "--json"], capture_output=True, text=True,
                             timeout=180)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["text"]

    once = run_piped(model, "The quick brown fox", "--max-tokens", "10", "--no-server", lines="")
    assert once.returncode == 0, once.stderr
    assert once.stdout == generated("The quick brown fox") + "\n"
    piped = run_piped(model, "Go on:", "--max-tokens", "10", "--no-server", lines="the lazy dog\n")
    assert piped.stdout == generated("Go on:\n\nthe lazy dog") + "\n"
    there = run_piped(model, "Go on:", "--max-tokens", "10", "--server", server.url, lines="the lazy dog\n")
    assert there.returncode == 0 and there.stdout == piped.stdout, there.stderr


def test_attached_chat_drops_the_oldest_turns_as_in_process(server, tiny_dir):
    """The model's context (512 tokens) fills by the third turn: both drop the same turns, from the server's
    count of the prompt, and reply the same."""
    args = ["--max-tokens", "40", str(tiny_dir("llama"))]
    lines = "".join(f"{i} " + "the quick brown fox jumps over the lazy dog " * 16 + "\n" for i in range(5))
    here = run_piped(*args, "--no-server", lines=lines)
    there = run_piped(*args, "--server", server.url, lines=lines)
    assert here.returncode == there.returncode == 0, there.stderr
    assert "context full" in here.stderr and there.stderr == here.stderr
    assert there.stdout == here.stdout


def _requests(server) -> float:
    import httpx

    from support.serve_helpers import read_metrics

    metrics = read_metrics(httpx.get(f"{server.url}/metrics", timeout=10).text)
    return sum(v for k, v in metrics.items() if k.startswith("umakit_requests_total"))


def spawn_attached(*args):
    from support import pty_helpers

    return pty_helpers.spawn(pexpect, *args, timeout=120)


def test_attached_chat_in_a_terminal_reuses_the_servers_cache_and_survives_ctrl_c(server, tiny_dir, tmp_path):
    from support.pty_helpers import PROMPT, say

    child = spawn_attached("--max-tokens", "600", "--server", server.url, str(tiny_dir("llama")))
    assert "served by " + server.url in child.banner
    child.sendline("Tell me a long story.")
    child.expect_exact("story.\r\n")
    child.expect(r"\S+ \S+ \S+")  # the reply is streaming
    child.sendintr()
    child.expect("reply stopped")
    child.expect_exact(PROMPT)
    child.sendline("/set max_tokens 6")
    child.expect_exact(PROMPT)
    new, reused = say(child, "Thanks!")
    # the stopped reply's cache stayed in the server's prompt cache (nothing else could have put this prompt there;
    # a random model's reply does not re-tokenize to the same tokens, so only its prompt is reused here)
    assert reused > 10 and new > 0
    child.sendline("/stats")
    child.expect(r"turns 2 .* served by " + server.url)
    child.expect_exact(PROMPT)
    saved = tmp_path / "chat.json"
    child.sendline(f"/save {saved}")
    child.expect_exact("saved 4 messages")
    child.expect_exact(PROMPT)
    child.sendintr()  # at an empty prompt: how to quit, and the chat goes on
    child.expect_exact("(Ctrl-D or /exit quits)")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    import json

    messages = json.loads(saved.read_text())["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 2 and messages[1]["content"].endswith("[cut]")


def test_a_chat_whose_server_goes_away_says_so_and_keeps_its_history(tiny_dir, tmp_path):
    from support.pty_helpers import PROMPT

    srv = ServerProcess(None, ["--backend", "torch", "--peak-bandwidth", "100"], tmp_path / "server.log",
                        env={"UMAKIT_HOME": str(tmp_path / "home")})
    try:
        srv.wait_healthy()
        child = spawn_attached("--max-tokens", "600", "--server", srv.url, str(tiny_dir("llama")))
        child.sendline("Tell me a long story.")
        child.expect_exact("story.\r\n")
        child.expect(r"\S+ \S+ \S+")
        srv.proc.kill()
        child.expect(r"Error: the server at \S+ went away mid-reply")
        child.expect_exact(PROMPT)
        child.sendline("And then?")
        child.expect(r"Error: the server at \S+ did not take the request")
        child.expect_exact(PROMPT)
        saved = tmp_path / "chat.json"
        child.sendline(f"/save {saved}")
        child.expect_exact("saved 2 messages")  # the first turn, its reply cut; the refused one taken back
        child.sendline("/exit")
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0 and "Traceback" not in child.logfile_read.getvalue()
    finally:
        srv.stop()
