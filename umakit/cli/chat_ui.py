"""The interactive side of `umakit run`: input, slash commands, streaming output."""

from __future__ import annotations

import select
import signal
import sys
from dataclasses import fields

import click

from umakit.chat import ChatSession, TurnInfo
from umakit.errors import UmakitError

from .format import decode_line, size

HELP = """\
/help               this list
/reset              clear the conversation and the cache
/system TEXT        set the system prompt (empty: remove it); starts a new conversation
/set NAME VALUE     change a setting: temp, top_p, top_k, min_p, repetition_penalty, max_tokens, seed
/stats              totals for this session
/save FILE          write the transcript (messages, settings, stats) as JSON
/load FILE          restore a transcript and prefill it
/exit               quit (also Ctrl-D; Ctrl-C stops a reply)
A line ending in \\ continues on the next line; a pasted block is one message."""

SETTABLE = {"temp": "temperature", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
            "min_p": "min_p", "repetition_penalty": "repetition_penalty"}


class Interrupt:
    """Ctrl-C during a reply sets a flag instead of raising inside the engine."""

    def __init__(self):
        self.hit = False

    def __enter__(self):
        self.hit = False
        self._old = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def _on_sigint(self, *_):
        self.hit = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGINT, self._old)


def footer(info: TurnInfo, stats) -> str:
    parts = [f"prefilled {info.new_tokens} new tok", f"reused {info.reused_tokens} cached",
             f"TTFT {stats.ttft_s:.2f} s", decode_line(stats)]
    return " · ".join(parts)


def read_message(prompt: str) -> str | None:
    """One user message: continuation lines with a trailing backslash, and pasted
    blocks (lines already waiting on stdin) joined. None at end of input."""
    lines = []
    line = input(prompt)
    while True:
        if line.endswith("\\"):
            lines.append(line[:-1])
            line = input("... ")
            continue
        lines.append(line)
        if not _more_waiting():
            return "\n".join(lines)
        line = input("")


def _more_waiting() -> bool:
    try:
        return bool(select.select([sys.stdin], [], [], 0.05)[0])
    except (OSError, ValueError):
        return False


class Repl:
    def __init__(self, session: ChatSession, color: bool = True, show_stats: bool = True):
        self.session = session
        self.color = color
        self.show_stats = show_stats

    def style(self, text: str, **kw) -> str:
        return click.style(text, **kw) if self.color else text

    # -- one reply ------------------------------------------------------------------
    def reply(self, text: str) -> None:
        with Interrupt() as stop:
            self._reply(text, stop)

    def _reply(self, text: str, stop: Interrupt) -> None:
        def ready(info: TurnInfo):
            if info.dropped_turns:
                click.echo(self.style(f"(context full: dropped the {info.dropped_turns} oldest turn(s), "
                                      "kept the system prompt, re-prefilling)", dim=True), err=True)
            self._info = info

        stats = None
        for chunk in self.session.send(text, on_ready=ready, should_stop=lambda: stop.hit):
            click.echo(chunk.text, nl=False)
            sys.stdout.flush()
            stats = chunk.stats or stats
        click.echo()
        if stop.hit:
            click.echo(self.style("(reply stopped; it stays in the history, marked as cut)", dim=True), err=True)
        elif stats is not None and self.show_stats:
            click.echo(self.style(footer(self._info, stats), dim=True), err=True)

    # -- commands ---------------------------------------------------------------------
    def command(self, line: str) -> bool:
        """Run a slash command; False means exit."""
        name, _, arg = line[1:].partition(" ")
        arg = arg.strip()
        s = self.session
        if name in ("exit", "quit"):
            return False
        if name == "help":
            click.echo(HELP)
        elif name == "reset":
            s.reset()
            click.echo("(conversation and cache cleared)")
        elif name == "system":
            s.set_system(arg)
            s.reset()
            click.echo(f"(system prompt {'set' if arg else 'removed'}; new conversation)")
        elif name == "stats":
            t = s.totals
            click.echo(f"turns {t.turns} · prefilled {t.prefilled_tokens} tok · reused {t.reused_tokens} tok · "
                       f"generated {t.generated_tokens} tok · cache {s.cache.offset} tok = {size(s.cache_bytes)} · "
                       f"weights {size(s.model.info.weights.total_bytes)} · peak mem {size(t.peak_memory_bytes)}")
        elif name == "save":
            if not arg:
                raise click.UsageError("usage: /save FILE")
            s.save(arg)
            click.echo(f"(saved {len(s.messages)} messages to {arg})")
        elif name == "load":
            if not arg:
                raise click.UsageError("usage: /load FILE")
            n = s.load(arg)
            click.echo(f"(loaded {len(s.messages)} messages from {arg}; prefilled {n} tokens)")
        elif name == "set":
            parts = arg.split(None, 1)
            if len(parts) == 2:
                self._set(*parts)
            else:
                click.echo("usage: /set NAME VALUE")
        else:
            click.echo(f"unknown command /{name}; /help lists the commands")
        return True

    def _set(self, key: str, value: str) -> None:
        s = self.session.settings
        try:
            if key in SETTABLE:
                field = SETTABLE[key]
                kind = {f.name: f.type for f in fields(s.sampling)}[field]
                s.sampling = s.sampling.with_overrides(**{field: int(value) if kind == "int" else float(value)})
            elif key == "max_tokens":
                s.max_tokens = max(1, int(value))
            elif key == "seed":
                s.seed = None if value == "none" else int(value)
            else:
                click.echo(f"unknown setting {key}; try temp, top_p, top_k, min_p, repetition_penalty, max_tokens, seed")
                return
        except ValueError as e:
            click.echo(f"bad value for {key}: {e}")
            return
        click.echo(f"({key} = {value})")

    # -- loops --------------------------------------------------------------------------
    def interactive(self) -> None:
        _enable_line_editing()
        prompt = self.style(">>> ", bold=True)
        while True:
            try:
                text = read_message(prompt)
            except (EOFError, KeyboardInterrupt):
                click.echo()
                return
            if not text.strip():
                continue
            try:
                if text.startswith("/"):
                    with Interrupt():  # a stray Ctrl-C must not kill a /save half-way
                        if not self.command(text.strip()):
                            return
                else:
                    self.reply(text)
            except (UmakitError, click.UsageError) as e:
                click.echo(f"Error: {e}", err=True)

    def piped(self, stream) -> None:
        """One message per input line; each reply followed by a blank line."""
        for line in stream:
            text = line.rstrip("\n")
            if text.strip():
                self.reply(text)
                click.echo()


def _enable_line_editing() -> None:
    try:
        import readline  # noqa: F401  (arrow keys and history for input())
    except ImportError:  # Windows without pyreadline
        return
    from umakit.home import umakit_home

    umakit_home().mkdir(parents=True, exist_ok=True)
    history = str(umakit_home() / "chat_history")
    try:
        readline.read_history_file(history)
    except OSError:
        pass
    import atexit

    atexit.register(lambda: _save_history(readline, history))


def _save_history(readline, path: str) -> None:
    try:
        readline.write_history_file(path)
    except OSError:
        pass
