"""Batch jobs as JSON Lines: the input checked line by line, results appended as they finish.

Input lines are ``{"id": ..., "prompt": "..."}`` or ``{"id": ..., "messages": [...]}``
plus optional per-item settings (checked by `umakit.generate.batch.make_request`).
Output lines are appended, flushed and synced one by one, so a crash loses
nothing that finished; a rerun skips the ids already in the output and cuts
off a line torn by the crash. The CLI holds the output's lock (`umakit.core.fsutil.locked`)
for the whole run, so two batches never append to one file at once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from umakit.errors import InvalidArgumentError
from umakit.core.fsutil import AppendFile, atomic_file, writing
from umakit.generate.stream import GenerationResult


@dataclass
class InputItem:
    line: int  # 1-based line number in the input file
    id: str | int
    fields: dict  # the line without its id: prompt or messages, and settings


@dataclass
class LineError:
    line: int
    message: str
    id: str | int | None = None

    def __str__(self) -> str:
        return f"line {self.line}: {self.message}"

    def to_dict(self) -> dict:
        return {"line": self.line, "id": self.id, "error": self.message}


def id_key(item_id) -> str:
    """How ids are compared: as JSON, so 1 and "1" are different ids."""
    return json.dumps(item_id, ensure_ascii=False)


def _parse_line(n: int, raw: bytes) -> InputItem | LineError:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return LineError(n, f"not UTF-8 text ({e.reason} at byte {e.start})")
    except json.JSONDecodeError as e:
        return LineError(n, f"not valid JSON: {e.msg} (column {e.colno})")
    if not isinstance(obj, dict):
        return LineError(n, f"expected a JSON object, got {type(obj).__name__}")
    if "id" not in obj:
        return LineError(n, "missing 'id'")
    item_id = obj.pop("id")
    if isinstance(item_id, bool) or not isinstance(item_id, (str, int)):
        return LineError(n, f"'id' must be a string or an integer, got {json.dumps(item_id)}")
    if "prompt" not in obj and "messages" not in obj:
        return LineError(n, "needs 'prompt' or 'messages'", item_id)
    return InputItem(n, item_id, obj)


def read_items(path: str | os.PathLike) -> tuple[list[InputItem], list[LineError]]:
    """Every well-formed item and every malformed line (blank lines are skipped).

    Duplicate ids are an error for the whole file: which result belongs to
    which line would be ambiguous, and resuming would skip the second one.
    """
    items: list[InputItem] = []
    errors: list[LineError] = []
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                if raw.strip():
                    parsed = _parse_line(n, raw)
                    (items if isinstance(parsed, InputItem) else errors).append(parsed)
    except OSError as e:
        raise InvalidArgumentError(f"cannot read {path}: {e.strerror or e}") from e
    lines: dict[str, list[int]] = {}
    for item in items:
        lines.setdefault(id_key(item.id), []).append(item.line)
    dups = [(k, v) for k, v in lines.items() if len(v) > 1]
    if dups:
        k, v = dups[0]
        more = f" (and {len(dups) - 1} more duplicated ids)" if len(dups) > 1 else ""
        raise InvalidArgumentError(
            f"{path}: id {k} appears on lines {', '.join(map(str, v))}{more}; ids must be unique"
        )
    return items, errors


def prepare_output(path: str | os.PathLike, key: str = "id") -> set[str]:
    """Keys (`id_key`) of the ids already in an output file (each line's ``key``: ``custom_id`` in OpenAI's
    batch output).

    A last line without its newline was torn by a crash mid-write: it is cut
    off, so its id runs again and the file stays valid JSON Lines.
    """
    path = Path(path)
    if not path.exists():
        return set()
    with writing(path):
        data = path.read_bytes()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            os.truncate(path, end)
    done = set()
    for raw in data[:end].splitlines():
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue  # not ours to judge; the id runs again
        if isinstance(record, dict) and key in record:
            done.add(id_key(record[key]))
    return done


def errors_path(output: str | os.PathLike) -> Path:
    """``results.jsonl`` -> ``results.errors.jsonl``, beside the output."""
    output = Path(output)
    stem = output.name[: -len(".jsonl")] if output.name.endswith(".jsonl") else output.name
    return output.with_name(stem + ".errors.jsonl")


def write_errors(path: str | os.PathLike, errors: list[LineError | dict]) -> None:
    """Write the errors file whole, a line each (a `LineError`, or a record already made: an OpenAI batch
    file's), or remove a stale one when there are none."""
    path = Path(path)
    if not errors:
        with writing(path):
            path.unlink(missing_ok=True)
        return
    with atomic_file(path, encoding="utf-8") as f:
        for e in errors:
            f.write(json.dumps(e if isinstance(e, dict) else e.to_dict(), ensure_ascii=False) + "\n")


def result_record(item_id, result: GenerationResult) -> dict:
    """One output line: the text, counts, finish reason and the item's own timing."""
    s = result.stats
    return {
        "id": item_id,
        "text": result.text,
        "finish_reason": result.finish_reason,
        "prompt_tokens": s.prompt_tokens,
        "generated_tokens": s.generated_tokens,
        "ttft_s": round(s.ttft_s, 4),
        "decode_s": round(s.decode_s, 4),
        "decode_tps": round(s.decode_tps, 2),
        "elapsed_s": round(s.ttft_s + s.decode_s, 4),
    }


class ResultWriter:
    """Appends one JSON line per result; each is synced before the next.

    A failed write (a full disk) is cut back to the last whole line and raised
    as a `WriteError`; an output this writer created and never wrote to is
    removed, so a failed run leaves no empty file.
    """

    def __init__(self, path: str | os.PathLike):
        self._f = AppendFile(path)

    def write(self, record: dict) -> None:
        self._f.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "ResultWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_paths(input_path: str | os.PathLike, output_path: str | os.PathLike) -> None:
    """Refuse an output (or its errors file) that is the input: resuming would read the input as results."""
    src = Path(input_path).resolve()
    for out in (Path(output_path), errors_path(output_path)):
        if out.resolve() == src or (out.exists() and src.exists() and os.path.samefile(out, src)):
            raise InvalidArgumentError(f"{out} is the input file {input_path}; write the results elsewhere")
    if Path(output_path).is_dir():
        raise InvalidArgumentError(f"{output_path} is a directory; give a file for the results")
