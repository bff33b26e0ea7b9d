"""`umakit ls`, `umakit rm` and `umakit ps`: the models on this machine, and those a running server holds."""

from __future__ import annotations

import click

from umakit.cli.flags import HOST_ENV, server_option
from umakit.cli.format import size

SERVER_OPTION = server_option("The umakit server to ask")


def _table(rows: list[list[str]], right: set[int] = frozenset()) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     .rstrip() for r in rows)


@click.command("ls")
def ls_cmd():
    """List the models umakit can load from this machine: its imports (names `umakit run NAME` takes) and the
    Hugging Face cache's snapshots."""
    from umakit.checkpoint.inventory import local_models

    found = local_models()
    if not found:
        click.echo("No local models yet: `umakit import FILE.gguf`, or `umakit run org/name` downloads one.")
        return
    rows = [["NAME", "SIZE", "ARCH", "QUANTIZATION", "FROM"]]
    rows += [[m.name, size(m.bytes), m.architecture, m.quantization, "hub cache" if m.kind == "hub" else "import"]
             for m in found]
    click.echo(_table(rows, right={1}))


def _loaded(server_url: str) -> list[dict] | None:
    """The models a running umakit server lists (None when none answers)."""
    from umakit.cli import attach
    from umakit.errors import UmakitError

    try:
        listed = attach.get_json(server_url, "/v1/models", 1.0)
    except UmakitError:
        return None
    return listed.get("data", []) if isinstance(listed, dict) else None


@click.command("rm")
@click.argument("name")
@SERVER_OPTION
def rm_cmd(name, server_url):
    """Remove a local model (an import, or a Hub repo's cached snapshots), saying what and how much. A model a
    running server has loaded is refused."""
    from umakit.checkpoint.inventory import find, remove
    from umakit.errors import InvalidArgumentError, ModelNotFoundError

    model = find(name)
    if model is None:
        raise ModelNotFoundError(f"no local model named {name!r}; `umakit ls` lists them")
    for card in _loaded(server_url) or ():
        held = card.get("id")
        if card.get("loaded") and held in (model.name, str(model.path)):
            raise InvalidArgumentError(f"the server at {server_url} has {name} loaded; unload it first "
                                       "(a request with keep_alive 0) or stop the server")
    remove(name)
    click.echo(f"Removed {model.name} ({size(model.bytes)}, {model.path})")


@click.command("ps")
@SERVER_OPTION
def ps_cmd(server_url):
    """List the models a running umakit server has loaded."""
    from umakit.errors import UmakitError

    cards = _loaded(server_url)
    if cards is None:
        raise UmakitError(f"no umakit server answers at {server_url} (--server or ${HOST_ENV})")
    loaded = [c for c in cards if c.get("loaded")]
    if not loaded:
        click.echo(f"No model loaded at {server_url}.")
        return
    rows = [["NAME", "SIZE", "REQUESTS", "UNLOADS"]]
    for c in loaded:
        until = c.get("unloads_in_s")
        rows.append([c["id"], size(c.get("bytes", 0)), str(c.get("active_requests", 0)),
                     "never" if until is None else "after this request" if until == 0 and c.get("active_requests")
                     else f"in {until:.0f} s"])
    click.echo(_table(rows, right={1, 2}))


@click.command("pull")
@click.argument("source", metavar="REPO[:FILE]")
def pull_cmd(source):
    """Download a Hugging Face Hub model (its safetensors, config and tokenizer), or one GGUF file of a repo
    (org/name:file.gguf) and import it; an interrupted download resumes on the next pull."""
    from umakit import backends
    from umakit.checkpoint.pull import pull
    from umakit.checkpoint.files import size_on_disk

    repo, _, filename = source.partition(":")
    # as `umakit run` would load it
    def reads(model_type: str | None) -> bool:
        return backends.reads_exact_groups(model_type=model_type)

    path = pull(repo, filename or None, defer_copies=reads, leave_layers=reads)
    name = path.name if filename else repo
    click.echo(f"Pulled {source}: {size(size_on_disk(path))}; run it with: umakit run {name}")

