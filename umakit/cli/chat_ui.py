"""The interactive side of `umakit run`: input, slash commands, streaming output.

Nothing typed here ends the session but ``/exit`` or Ctrl-D: a failed command
or turn is one ``Error:`` line and the prompt comes back. Ctrl-C during a turn
(just after Enter, in the prefill, in the reply) returns to the prompt with
the conversation intact, and at an empty prompt it says how to quit: a Ctrl-C
meant to stop a reply can land before the line was taken, and must not end
the chat.
"""

from __future__ import annotations

import contextlib
import re
import select
import signal
import sys
import traceback
from pathlib import Path

import click

from umakit.cli import crashlog
from umakit.cli.remote_chat import RemoteChat, Served
from umakit.core import validate
from umakit.generate.chat import ChatSession, Stopped, TurnInfo
from umakit.serve.replies import CONTENT, Piece, ReplyParser, Thinking
from umakit.errors import InvalidArgumentError, UmakitError

from umakit.cli.format import decode_line, size

HELP = """\
/help               this list
/reset              clear the conversation and the cache
/system TEXT        set the system prompt (empty: remove it); starts a new conversation
/set NAME VALUE     change a setting: temp, top_p, top_k, min_p, repetition_penalty, max_tokens, seed
/think on|off       a reasoning model thinks first, or not (its thinking shows dimmed)
/stats              totals for this session
/save FILE          write the transcript (messages, settings, stats) as JSON
/load FILE          restore a transcript and prefill it
/exit               quit (also Ctrl-D; Ctrl-C stops a reply, and never quits)
A line ending in \\ continues on the next line; a pasted block is one message."""

QUIT_HINT = "(Ctrl-D or /exit quits)"  # what Ctrl-C at an empty prompt says, instead of quitting
SETTABLE = {"temp": "temperature", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
            "min_p": "min_p", "repetition_penalty": "repetition_penalty"}
SETTINGS = "temp, top_p, top_k, min_p, repetition_penalty, max_tokens, seed"
_ESCAPE = re.compile(r"(\x1b\[[0-9;?]*[A-Za-z])")


class Cancelled(Exception):
    """Ctrl-C after a message's first line was entered: the message is not sent."""


class Ended(BaseException):
    """The terminal closed (SIGHUP) or the process was asked to stop (SIGTERM) mid-chat.

    Not an `Exception`, so no handler in the chat takes it for one failed line or command."""


def _ended(signum, _frame):
    raise Ended(f"the chat was ended by {signal.Signals(signum).name}")


# Signals that end a chat from outside; each first saves the conversation (SIGHUP does not exist on Windows).
ENDING_SIGNALS = tuple(s for s in (getattr(signal, "SIGHUP", None), signal.SIGTERM) if s is not None)


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
    """The line after a reply: what was prefilled and reused, and how fast (a server's own figures, attached)."""
    parts = [f"prefilled {info.new_tokens} new tok", f"reused {info.reused_tokens} cached",
             f"TTFT {stats.ttft_s:.2f} s", stats.line if isinstance(stats, Served) else decode_line(stats)]
    return " · ".join(parts)


def session_stats(s) -> str:
    """/stats: the session's totals, and what holds the conversation (this process's cache, or a server)."""
    t = s.totals
    line = (f"turns {t.turns} · prefilled {t.prefilled_tokens} tok · reused {t.reused_tokens} tok · "
            f"generated {t.generated_tokens} tok")
    if isinstance(s, RemoteChat):
        return f"{line} · served by {s.url}"
    return (f"{line} · cache {s.cache.offset} tok = {size(s.cache_bytes)} · "
            f"weights {size(s.model.info.weights.total_bytes)} · peak mem {size(t.peak_memory_bytes)}")


def readline_prompt(prompt: str) -> str:
    """``prompt`` with each escape sequence between \\001 and \\002, which readline and libedit read as
    "takes no room": without them line editing miscounts the prompt's width and redraws long lines wrong."""
    return _ESCAPE.sub("\001\\1\002", prompt)


def read_message(prompt: str) -> str | None:
    """One user message: continuation lines with a trailing backslash, and pasted
    blocks (lines already waiting on stdin) joined.

    Ctrl-C at an empty prompt raises KeyboardInterrupt (the chat says how to quit); with text typed, or
    once the first line is entered, it raises `Cancelled` instead (the message
    is dropped, the session goes on).
    """
    try:
        line = input(prompt)
    except KeyboardInterrupt:
        # readline keeps the line it was editing, or had just accepted when the
        # signal came between Enter and input() returning.
        if _line_buffer().strip():
            raise Cancelled from None
        raise
    try:
        lines = []
        while True:
            if line.endswith("\\"):
                lines.append(line[:-1])
                line = input("... ")
                continue
            lines.append(line)
            if not _more_waiting():
                return "\n".join(lines)
            line = input("")
    except KeyboardInterrupt:
        raise Cancelled from None


def _line_buffer() -> str:
    readline = sys.modules.get("readline")
    return readline.get_line_buffer() if readline is not None else ""


def _more_waiting() -> bool:
    try:
        return bool(select.select([sys.stdin], [], [], 0.05)[0])
    except (OSError, ValueError):
        return False


class Repl:
    def __init__(self, session: ChatSession | RemoteChat, color: bool = True, show_stats: bool = True):
        self.session = session
        self.color = color
        self.show_stats = show_stats

    def style(self, text: str, **kw) -> str:
        return click.style(text, **kw) if self.color else text

    def notice(self, text: str) -> None:
        click.echo(self.style(text, dim=True), err=True)

    # -- one reply ------------------------------------------------------------------
    def reply(self, text: str) -> None:
        with Interrupt() as stop:
            self._reply(text, stop)

    def reply_once(self, text: str) -> None:
        """`umakit run MODEL PROMPT`'s one reply: Ctrl-C ends the process, as it ends `generate`, not the reply."""
        self._reply(text, Interrupt())  # never entered: its flag stays down, and Ctrl-C raises KeyboardInterrupt

    def _reply(self, text: str, stop: Interrupt) -> None:
        self._info = TurnInfo()

        def ready(info: TurnInfo):
            if info.dropped_turns:
                self.notice(f"(context full: dropped the {info.dropped_turns} oldest turn(s), "
                            "kept the system prompt, re-prefilling)")
            self._info = info

        stats = None
        markers = self.session.thinking_markers
        parser = None
        for chunk in self.session.send(text, on_ready=ready, should_stop=lambda: stop.hit):
            if markers is not None and parser is None:
                parser = ReplyParser(Thinking(*markers, open=self.session.opens_thinking))
            self._show(parser.feed(chunk.text) if parser is not None else [Piece(CONTENT, chunk.text)])
            stats = chunk.stats or stats
        if parser is not None:
            self._show(parser.finish())
        if self._info.cancelled:
            self.notice("(stopped before the reply; the message was dropped)")
            return
        click.echo()
        if stop.hit:
            self.notice("(reply stopped; it stays in the history, marked as cut)")
        elif stats is not None and self.show_stats:
            self.notice(footer(self._info, stats))

    def _show(self, pieces) -> None:
        for p in pieces:
            click.echo(p.text if p.kind == CONTENT else self.style(p.text, dim=True), nl=False)
        sys.stdout.flush()

    # -- commands ---------------------------------------------------------------------
    def command(self, line: str, stop: Interrupt | None = None) -> bool:
        """Run a slash command; False means exit. A bad command raises `UmakitError`."""
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
            click.echo(session_stats(s))
        elif name == "save":
            s.save(_path(arg, "/save FILE"))
            click.echo(f"(saved {len(s.messages)} messages to {arg})")
        elif name == "load":
            n = s.load(_path(arg, "/load FILE"), should_stop=(lambda: stop.hit) if stop else lambda: False)
            click.echo(f"(loaded {len(s.messages)} messages from {arg}" + (f"; prefilled {n} tokens)" if n else ")"))
        elif name == "think":
            if arg not in ("on", "off"):
                raise InvalidArgumentError("usage: /think on|off")
            if not s.thinking_switch:
                raise InvalidArgumentError("this model's chat template has no thinking switch")
            s.settings.thinking = arg == "on"
            click.echo(f"(thinking {arg})")
        elif name == "set":
            parts = arg.split(None, 1)
            if len(parts) != 2:
                raise InvalidArgumentError(f"usage: /set NAME VALUE, with NAME one of {SETTINGS}")
            self._set(*parts)
        else:
            raise InvalidArgumentError(f"unknown command /{name}; /help lists the commands")
        return True

    def _set(self, key: str, value: str) -> None:
        s = self.session.settings
        if key in SETTABLE:
            field = SETTABLE[key]
            s.sampling = s.sampling.with_overrides(**{field: validate.parse_setting(field, value)})
        elif key == "max_tokens":
            s.max_tokens = validate.max_tokens(_int(key, value))
        elif key == "seed":
            s.seed = None if value == "none" else validate.seed(_int(key, value))
        else:
            raise InvalidArgumentError(f"unknown setting {key}; try {SETTINGS}")
        click.echo(f"({key} = {value})")

    # -- loops --------------------------------------------------------------------------
    def interactive(self) -> None:
        prompt = self.style(">>> ", bold=True)
        if _enable_line_editing():
            prompt = readline_prompt(prompt)
        with self.rescuing():
            while True:
                try:
                    text = read_message(prompt)
                except Cancelled:
                    self.notice("(cancelled)")
                    continue
                except KeyboardInterrupt:  # never ends the chat: a Ctrl-C meant for a reply can land here
                    click.echo()
                    self.notice(QUIT_HINT)
                    continue
                except EOFError:
                    click.echo()
                    return
                except UnicodeDecodeError as e:
                    click.echo(f"Error: that input is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                               f"{e.start}); nothing was sent", err=True)
                    continue
                if text.strip() and not self.run_one(text):
                    return

    def run_one(self, text: str) -> bool:
        """One message or slash command; every failure is one ``Error:`` line. False means exit."""
        try:
            if text.startswith("/"):
                with Interrupt() as stop:  # a stray Ctrl-C must not kill a /save half-way
                    return self.command(text.strip(), stop)
            self.reply(text)
        except KeyboardInterrupt:  # Ctrl-C in the instant before a turn's own handler took over
            self.notice("(cancelled)")
        except Stopped as e:
            self.notice(f"({e})")
        except (UmakitError, click.UsageError) as e:
            click.echo(f"Error: {e}", err=True)
        except Exception as e:  # a bug: reported and logged, and the conversation goes on
            self.session.resync()  # the cache may be in doubt: the next turn prefills every message again
            if crashlog.debug():
                traceback.print_exc()
            click.echo(f"Error: {crashlog.report(e)}", err=True)
        return True

    def piped(self, stream) -> bool:
        """One message per line of ``stream`` (bytes, UTF-8); each reply followed by a blank line.

        A line that fails is one ``Error:`` line and the next ones still run; False if any failed.
        """
        ok = True
        with self.rescuing():
            for n, raw in enumerate(stream, 1):
                try:
                    text = validate.decode_utf8(raw, f"line {n} of the input").rstrip("\n")
                    if text.strip():
                        self.reply(text)
                        click.echo()
                except UmakitError as e:
                    click.echo(f"Error: {e}" if str(e).startswith("line ") else f"Error: line {n}: {e}", err=True)
                    ok = False
        return ok

    @contextlib.contextmanager
    def rescuing(self):
        """If an error ends the chat anyway, save its transcript first and say where (``/load`` brings it back).

        Closing the terminal or a SIGTERM ends it the same way: saved first."""
        old = {s: signal.signal(s, _ended) for s in ENDING_SIGNALS}
        try:
            yield
        except (Exception, Ended) as e:
            if self.session.messages:
                try:
                    path = self.session.rescue()
                except UmakitError as e:
                    self.notice(f"(could not save the conversation: {e})")
                else:
                    self.notice(f"(conversation saved to {path}; /load {path} brings it back)")
            if isinstance(e, Ended):
                raise UmakitError(str(e)) from None  # one Error: line, as for any reason a command stops
            raise
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)


def _path(arg: str, usage: str) -> Path:
    if not arg:
        raise InvalidArgumentError(f"usage: {usage}")
    return Path(arg).expanduser()


def _int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise InvalidArgumentError(f"{name} must be an integer, got {value!r}") from None


def _enable_line_editing() -> bool:
    """Turn on readline (arrow keys, history kept in $UMAKIT_HOME); True when it is in use."""
    try:
        import readline
    except ImportError:  # Windows without pyreadline
        return False
    from umakit.core.home import home_dir

    try:
        history = str(home_dir() / "chat_history")
    except OSError:  # an unusable $UMAKIT_HOME: line editing without a saved history
        return True
    try:
        readline.read_history_file(history)
    except OSError:
        pass
    import atexit

    atexit.register(lambda: _save_history(readline, history))
    return True


def _save_history(readline, path: str) -> None:
    try:
        readline.write_history_file(path)
    except OSError:
        pass
