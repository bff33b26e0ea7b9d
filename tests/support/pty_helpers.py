"""`umakit run` in a real pseudo-terminal (pexpect), for the chat tests."""

import io
import os
import re
import sys

EXE = os.path.join(os.path.dirname(sys.executable), "umakit")
PROMPT = ">>> "
FOOTER = re.compile(r"prefilled (\d+) new tok · reused (\d+) cached")


def spawn(pexpect, *args, term: str = "dumb", timeout: float = 60):
    """A chat at temperature 0 with ``args``, started and at its first prompt; ``child.banner`` is what it
    printed before its help line, ``child.logfile_read`` all the terminal showed."""
    child = pexpect.spawn(EXE, ["run", "--temp", "0", *args], encoding="utf-8", timeout=timeout,
                          dimensions=(40, 200), env={**os.environ, "TERM": term})
    child.logfile_read = io.StringIO()
    child.expect("/help for commands")
    child.banner = child.before
    child.expect_exact(PROMPT)
    return child


def say(child, text: str) -> tuple[int, int]:
    """Send one turn; (tokens prefilled anew, tokens reused from the cache), from its footer."""
    child.sendline(text)
    child.expect(FOOTER)
    new, reused = int(child.match.group(1)), int(child.match.group(2))
    child.expect_exact(PROMPT)
    return new, reused
