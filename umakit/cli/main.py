"""The `umakit` command group.

Subcommands live in their own modules and are imported only when used, so
`umakit --help` and each command start fast. Library errors become a one-line
message and exit status 1 here, in one place; any other exception is a bug,
reported in one line with its traceback logged (`umakit.cli.crashlog`).
"""

from __future__ import annotations

import errno
import importlib
import sys
import traceback

import click

# command name -> "module:attribute"
COMMANDS = {
    "batch": "umakit.cli.batch_cmd:batch_cmd",
    "bench": "umakit.cli.bench_cmd:bench",
    "compare": "umakit.cli.compare_cmd:compare_cmd",
    "corpora": "umakit.cli.corpora_cmd:corpora_cmd",
    "eval": "umakit.cli.eval_cmd:eval_cmd",
    "generate": "umakit.cli.generate:generate",
    "import": "umakit.cli.import_cmd:import_cmd",
    "ls": "umakit.cli.models_cmd:ls_cmd",
    "ps": "umakit.cli.models_cmd:ps_cmd",
    "pull": "umakit.cli.models_cmd:pull_cmd",
    "rm": "umakit.cli.models_cmd:rm_cmd",
    "plan": "umakit.cli.plan_cmd:plan",
    "quantize": "umakit.cli.quantize_cmd:quantize_cmd",
    "run": "umakit.cli.run_cmd:run",
    "serve": "umakit.cli.serve_cmd:serve_cmd",
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)

    def invoke(self, ctx):
        from umakit.errors import UmakitError

        try:
            return super().invoke(ctx)
        except UmakitError as e:
            raise click.ClickException(str(e)) from e
        except KeyboardInterrupt:
            click.echo("\nInterrupted.", err=True)
            sys.exit(130)
        except (click.ClickException, click.exceptions.Exit, click.Abort):
            raise
        except OSError as e:
            if e.errno == errno.EPIPE:  # output piped into `head` and the like: click exits quietly
                raise
            raise internal_error(e) from e
        except Exception as e:
            raise internal_error(e) from e


def internal_error(e: Exception) -> click.ClickException:
    """A bug, not a user's mistake: one line naming it and its log (the traceback too with UMAKIT_DEBUG=1)."""
    from umakit.cli import crashlog

    if crashlog.debug():
        traceback.print_exception(type(e), e, e.__traceback__)
    return click.ClickException(crashlog.report(e))


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="umakit")
def main():
    """Local LLM inference for unified-memory machines."""


if __name__ == "__main__":
    main()
