"""README.md and docs/*.md stay true to the CLI and to each other.

- every `umakit COMMAND ...` shown in a code block of README.md or docs/*.md names a real command, and every flag on
  that line is in the command's --help;
- every relative link resolves to a file (and a `#anchor` into a Markdown file to one of its headings);
- README.md stays a landing page (under 12,000 bytes) whose first example is the capital-of-France prompt;
- no page mentions what the docs must not (the retired light start, paths outside the repository).

Offline and fast: --help comes from click's CliRunner, no model is loaded.
"""

from __future__ import annotations

import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest
from click.testing import CliRunner

from umakit.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
README_LIMIT = 12_000
FIRST_EXAMPLE = 'umakit generate --prompt "What is the capital of France?" --temp 0'
FORBIDDEN = ("../shared", "UMAKIT_NO_LIGHT", "light_start")
SHELL_BREAKS = {"|", "||", "&&", ";"}
NOT_SHELL = {"python", "py", "json", "jsonc", "toml", "yaml", "text"}


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- reading Markdown ------------------------------------------------------------------------------------------


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, logical line) of the shell-like code: fenced blocks (except Python, JSON, ...) and indented
    lines outside them; a line ending in a backslash is joined with the next."""
    out: list[tuple[int, str]] = []
    fence: str | None = None  # the open fence's info string ("" for a bare fence), None outside one
    pending: tuple[int, str] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            pending = None
            continue
        in_code = (fence is not None and fence not in NOT_SHELL) or (fence is None and line.startswith("    "))
        if not in_code:
            pending = None
            continue
        if pending is not None:
            start, line = pending[0], pending[1] + " " + stripped
        else:
            start, line = number, stripped
        if line.endswith("\\"):
            pending = (start, line[:-1].rstrip())
            continue
        pending = None
        out.append((start, line))
    return out


def umakit_calls(line: str) -> list[list[str]]:
    """The argument lists of each `umakit ...` on a shell line (after `$ `, env assignments or `$(which umakit)`)."""
    if line.startswith("$ "):
        line = line[2:]
    try:
        tokens = shlex.split(line, comments=True)
    except ValueError:  # unbalanced quotes: not a command line
        return []
    calls, segment = [], []
    for token in [*tokens, "|"]:
        if token not in SHELL_BREAKS:
            segment.append(token)
            continue
        while segment and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", segment[0]):
            segment.pop(0)
        for i, token_ in enumerate(segment):
            if (i == 0 and token_ == "umakit") or (token_ == "umakit)" and i > 0 and segment[i - 1] == "$(which"):
                calls.append(segment[i + 1:])
                break
        segment = []
    return calls


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (underscores inside words kept, as in
    Q4_K_M), spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M)}


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of each Markdown link outside code."""
    out = []
    fence = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip().startswith("```"):
            fence = not fence
            continue
        if fence:
            continue
        line = re.sub(r"`[^`]*`", "", line)
        out += [(number, m.group(1)) for m in re.finditer(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", line)]
    return out


def relative_links() -> list[tuple[Path, int, str]]:
    return [(page, number, target) for page in PAGES for number, target in links(page)
            if not re.match(r"(https?|mailto):", target) and not target.startswith("#")]


def all_calls() -> list[tuple[Path, int, list[str]]]:
    return [(page, number, call) for page in PAGES for number, line in code_lines(page.read_text(encoding="utf-8"))
            for call in umakit_calls(line)]


# --- the CLI's own --help --------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def help_text(path: tuple[str, ...]) -> str | None:
    """`umakit PATH --help`, or None if PATH is not a command."""
    result = CliRunner().invoke(main, [*path, "--help"])
    return result.output if result.exit_code == 0 else None


def subcommands(help_: str) -> set[str]:
    section = help_.split("\nCommands:\n", 1)
    return set(re.findall(r"^  (\S+)", section[1], flags=re.M)) if len(section) == 2 else set()


def resolve_command(args: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """Split ARGS into the command path (`("corpora", "fetch")`) and what follows it."""
    path: tuple[str, ...] = ()
    rest = list(args)
    while rest and rest[0] in subcommands(help_text(path) or ""):
        path, rest = (*path, rest[0]), rest[1:]
    return path, rest


def flags(args: list[str]) -> list[str]:
    """The options among ARGS (`--temp`, `-p`), placeholders' brackets and `=value` removed."""
    out = []
    for arg in args:
        arg = arg.strip("[](){}")
        if re.fullmatch(r"--?[A-Za-z][\w-]*(=.*)?", arg):
            out.append(arg.split("=", 1)[0])
    return out


def mentions(help_: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_) is not None


# --- the tests -------------------------------------------------------------------------------------------------

CALLS = all_calls()


def test_examples_found():
    """The scanner sees the README's examples (a parser that finds nothing would pass everything)."""
    readme = [call for page, _, call in CALLS if page == README]
    assert {call[0] for call in readme if call} >= {"generate", "run", "serve", "batch", "plan"}


@pytest.mark.parametrize(
    "page, number, call", CALLS, ids=[f"{rel(p)}:{n}:umakit {' '.join(c)[:60]}" for p, n, c in CALLS])
def test_example_uses_real_command_and_flags(page, number, call):
    path, rest = resolve_command(call)
    where = f"{rel(page)}:{number}: umakit {' '.join(call)}"
    assert path, f"{where}: no such command {call[:1]}; umakit has {sorted(subcommands(help_text(()) or ''))}"
    help_ = help_text(path)
    unknown = [flag for flag in flags(rest) if not mentions(help_, flag)]
    assert not unknown, f"{where}: `umakit {' '.join(path)} --help` has no {unknown}"


LINKS = relative_links()


@pytest.mark.parametrize("page, number, target", LINKS, ids=[f"{rel(p)}:{n}:{t}" for p, n, t in LINKS])
def test_relative_link_resolves(page, number, target):
    file, _, anchor = target.partition("#")
    dest = (page.parent / file).resolve()
    assert dest.exists(), f"{rel(page)}:{number}: link to {target}, but {dest} does not exist"
    if anchor and dest.suffix == ".md":
        assert anchor in anchors(dest), f"{rel(page)}:{number}: {dest.name} has no heading for #{anchor}"


@pytest.mark.parametrize("page", PAGES, ids=[rel(p) for p in PAGES])
def test_in_page_anchors_resolve(page):
    missing = [t for _, t in links(page) if t.startswith("#") and t[1:] not in anchors(page)]
    assert not missing, f"{rel(page)}: no heading for {missing}"


def test_readme_is_a_landing_page():
    size = len(README.read_bytes())
    assert size < README_LIMIT, f"README.md is {size} bytes; move details into docs/ (limit {README_LIMIT})"


def test_readme_first_example():
    first = next(line for _, line in code_lines(README.read_text(encoding="utf-8")))
    assert first == FIRST_EXAMPLE


@pytest.mark.parametrize("page", PAGES, ids=[rel(p) for p in PAGES])
def test_no_forbidden_text(page):
    text = page.read_text(encoding="utf-8")
    found = [word for word in FORBIDDEN if word in text]
    assert not found, f"{rel(page)} mentions {found}"


# --- the helpers themselves ------------------------------------------------------------------------------------


def test_helpers_catch_what_they_should():
    text = "```sh\numakit generate -p hi \\\n    --bogus 1\n```\n\n    printf x | umakit run --temp 0\n"
    lines = code_lines(text)
    assert lines == [(2, "umakit generate -p hi --bogus 1"), (6, "printf x | umakit run --temp 0")]
    assert umakit_calls(lines[1][1]) == [["run", "--temp", "0"]]
    assert umakit_calls("torchrun --nproc_per_node 2 $(which umakit) generate -m M") == [["generate", "-m", "M"]]
    assert umakit_calls("UMAKIT_NO_WIRE=1 umakit batch -i a -o b  # note") == [["batch", "-i", "a", "-o", "b"]]
    assert umakit_calls("python benchmarks/x.py --umakit") == []
    assert flags(["--kv-bits", "8", "[--recipe", "default|mixed]", "-p", "-", "--x=1"]) == ["--kv-bits", "--recipe",
                                                                                             "-p", "--x"]
    path, rest = resolve_command(["generate", "-p", "hi", "--bogus"])
    assert path == ("generate",) and not mentions(help_text(path), "--bogus") and mentions(help_text(path), "-p")
    assert resolve_command(["corpora", "fetch", "wiki"])[0] == ("corpora", "fetch")
    assert resolve_command(["nope"])[0] == ()
    assert slug("## `umakit run`: chat".lstrip("# ")) == "umakit-run-chat"
