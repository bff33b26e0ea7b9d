"""`umakit generate` attached to a running `umakit serve`: the same text as in-process, the server's figures on
stderr, and one `Error:` line when the server goes away mid-reply."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from support.serve_helpers import ServerProcess, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(None, ["--backend", "torch", "--peak-bandwidth", "100", "--keep-alive", "-1"], tmp_path_factory)
    yield srv
    srv.stop()


def generate(*args, **kw):
    return subprocess.run([sys.executable, "-m", "umakit.cli.main", "generate", *args], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "UMAKIT_HOST": "http://127.0.0.1:9"}, **kw)


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
