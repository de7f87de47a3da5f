"""Input files of a corpus and the documents they hold.

A .jsonl file holds one document per line (a JSON object with a text field), a .parquet file one per row (a string
column), and any other file is one document of UTF-8 text. Directories are searched recursively for the include
patterns; files, directories and globs may be mixed. The order is fixed (each input's files sorted, duplicates
dropped) so the same inputs always give the same documents in the same order.
"""

from __future__ import annotations

import fnmatch
import glob as globlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# What a directory input contributes (a file named explicitly is always read, whatever its extension).
DEFAULT_INCLUDE = ("*.txt", "*.md", "*.rst", "*.py", "*.jsonl", "*.parquet")
# Directories below a directory input that are never searched (their names, or glob patterns of them).
DEFAULT_EXCLUDE = ("__pycache__", ".git")


class SourceError(ValueError):
    """Bad input; the message names the file (and line or column) and what to change."""


@dataclass(frozen=True)
class Source:
    path: Path
    size: int

    @property
    def format(self) -> str:
        return {".jsonl": "jsonl", ".parquet": "parquet"}.get(self.path.suffix, "text")


def find_sources(inputs: list[str], include: tuple[str, ...] = DEFAULT_INCLUDE,
                 exclude: tuple[str, ...] = DEFAULT_EXCLUDE) -> list[Source]:
    """The files named by `inputs` (files, directories, globs), in a fixed order; below a directory input, files
    matching `include` outside directories named by `exclude`. Raises SourceError for an input that matches nothing
    and for an empty result."""
    seen: set[Path] = set()
    sources: list[Source] = []
    for spec in inputs:
        path = Path(spec)
        if path.is_file():
            found = [path]
        elif path.is_dir():
            found = sorted({p for pattern in include for p in path.rglob(pattern)
                            if p.is_file() and not _excluded(p.relative_to(path).parts[:-1], exclude)})
        elif globlib.has_magic(spec):
            found = sorted(Path(p) for p in globlib.glob(spec, recursive=True) if Path(p).is_file())
        else:
            raise SourceError(f"input {spec!r} does not exist: pass files, directories or glob patterns")
        if not found:
            raise SourceError(f"input {spec!r} matches no file (directories are searched for {', '.join(include)})")
        for p in found:
            resolved = p.resolve()
            if resolved not in seen:
                seen.add(resolved)
                sources.append(Source(resolved, resolved.stat().st_size))
    if not sources:
        raise SourceError("no input files: pass --input with files, directories or glob patterns")
    return sources


def _excluded(directories: tuple[str, ...], exclude: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for name in directories for pattern in exclude)


def read_documents(source: Source, text_field: str = "text") -> Iterator[str]:
    """The documents of one file, in order. Raises SourceError naming the file (and line) on anything unreadable."""
    if source.format == "jsonl":
        yield from _jsonl_documents(source.path, text_field)
    elif source.format == "parquet":
        yield from _parquet_documents(source.path, text_field)
    else:
        yield _read_text(source.path)


def _read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SourceError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason}); convert it or leave it out "
                          "(--skip-bad-files)") from None


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    for number, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SourceError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
        if not isinstance(record, dict) or text_field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise SourceError(f"{path}:{number}: no field {text_field!r} (has {keys}); set --text-field")
        text = record[text_field]
        if not isinstance(text, str):
            raise SourceError(f"{path}:{number}: field {text_field!r} is {type(text).__name__}, not a string")
        yield text


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise SourceError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises its own ArrowInvalid / OSError family
        raise SourceError(f"cannot read {path} as parquet: {exc}") from None
    columns = table.schema_arrow.names
    if text_field not in columns:
        raise SourceError(f"{path}: no column {text_field!r} (has {columns}); set --text-field")
    for batch in table.iter_batches(columns=[text_field]):
        for row, text in enumerate(batch.column(0).to_pylist()):
            if text is None:
                continue
            if not isinstance(text, str):
                raise SourceError(f"{path}: column {text_field!r} holds {type(text).__name__}, not strings "
                                  f"(row {row} of a batch)")
            yield text
