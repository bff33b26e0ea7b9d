"""Killing a CLI process at a chosen moment, for the tests that it loses nothing."""

import os
import signal
import subprocess
import time

DEADLINE_S = 90


def kill_when(cmd: list, ready, waiting_for: str) -> None:
    """Run ``cmd`` (the repository importable), wait until ``ready()``, then SIGKILL it; it must die of that."""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + DEADLINE_S
        while not ready():
            if proc.poll() is not None:
                raise AssertionError(f"exited {proc.returncode} before {waiting_for}: {proc.stderr.read().decode()}")
            assert time.monotonic() < deadline, f"{waiting_for} never came"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
