"""`umakit pull`: a Hub model fetched ahead of its first use (a repo's safetensors, or one GGUF file imported)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from umakit.errors import InvalidArgumentError, ModelNotFoundError


def pull(repo_id: str, filename: str | None = None,
         defer_copies: bool | Callable[[str | None], bool] = False,
         leave_layers: bool | Callable[[str | None], bool] = False) -> Path:
    """Download a Hub repo's model (config, tokenizer, safetensors) or, with ``filename``, one GGUF file of it and
    import it (``defer_copies``, ``leave_layers``: `files.resolve`'s); returns the directory umakit loads. An
    interrupted download resumes where it stopped (the Hub library keeps the partial file), and nothing is listed
    until it is whole."""
    from huggingface_hub import hf_hub_download

    from umakit.checkpoint import files

    if filename is None:
        return files.resolve(repo_id) if "/" in repo_id else _not_a_repo(repo_id)
    if not filename.endswith(".gguf"):
        raise InvalidArgumentError(f"{filename}: umakit pulls one file of a repo only when it is a .gguf")
    from huggingface_hub.utils import logging as hub_logging

    level = hub_logging.get_verbosity()
    hub_logging.set_verbosity_error()  # its retries' warnings are not the error (the library never prints)
    try:
        path = hf_hub_download(repo_id, filename)
    except Exception as e:  # the Hub library raises many unrelated types here
        raise ModelNotFoundError(f"could not download {repo_id}:{filename} ({type(e).__name__}: {e})") from e
    finally:
        hub_logging.set_verbosity(level)
    return files.resolve(path, defer_copies=defer_copies, leave_layers=leave_layers)


def _not_a_repo(name: str):
    raise InvalidArgumentError(f"{name}: give a Hub repo id (org/name), or org/name:FILE.gguf")
