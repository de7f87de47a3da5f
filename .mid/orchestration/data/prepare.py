"""Tokenize a corpus into memory-mappable token shards that training reads with `data=tokenized data.path=OUT`.

    python -m orchestration.data.prepare --input DIR_OR_FILES... --tokenizer tok.json --out OUT [--val-fraction 0.01]

Each document becomes its tokens followed by the tokenizer's end-of-document id. A document goes to the validation
split when the first 8 bytes of the sha256 of its UTF-8 text, read as an integer, fall below val_fraction * 2**64: a
pure function of the text, so the split holds whole documents and does not depend on the order, the number of
processes or the machine. OUT then holds train_NNNNN.bin and val_NNNNN.bin (raw little-endian uint16 ids when the
vocabulary fits, else uint32) and manifest.json (docs/data.md describes its fields). Files are tokenized by
--workers processes into OUT/.parts/, one part per input file, each with a completion marker: an interrupted run
started again with the same arguments continues from the parts already done, and the result is the same bytes.
manifest.json is written last: its presence means the corpus is complete.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from orchestration.data.shard_digest import record_verified
from orchestration.data.sources import (
    DEFAULT_EXCLUDE,
    DEFAULT_INCLUDE,
    Source,
    SourceError,
    find_sources,
    read_documents,
)
from orchestration.data.tokenizer import Tokenizer, TokenizerError, load_tokenizer

LOG = logging.getLogger("orchestration.data.prepare")

MANIFEST_FILE = "manifest.json"
PARTS_DIR = ".parts"
SETTINGS_FILE = "settings.json"
FORMAT = "elastic-fp8-token-shards"
FORMAT_VERSION = 1
SPLITS = ("train", "val")
# Documents encoded per call of the tokenizer: large enough for its batch encoding to pay off, small enough to keep
# a process's memory bounded by a few MB of text.
ENCODE_BATCH = 256


class PrepareError(ValueError):
    """A preparation that cannot go on; the message says what to change."""


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocabularies up to 65536 entries), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def in_validation(text: str, val_fraction: float) -> bool:
    """Whether a document belongs to the validation split: a pure function of its text."""
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < val_fraction * 2**64


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:05d}.bin"


@dataclass(frozen=True)
class UnitTask:
    """One input file to tokenize into OUT/.parts/."""

    index: int
    path: str
    size: int
    text_field: str
    val_fraction: float
    dtype: str
    parts_dir: str
    skip_bad_files: bool


def part_files(parts_dir: Path, index: int) -> tuple[Path, Path, Path]:
    """The train and validation token files of one input and its completion marker (written last)."""
    stem = parts_dir / f"{index:06d}"
    return stem.with_suffix(".train.bin"), stem.with_suffix(".val.bin"), stem.with_suffix(".done.json")


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


_TOKENIZER: Tokenizer | None = None


def _init_process(tokenizer_spec: str, eos_token: str | None) -> None:
    global _TOKENIZER
    _TOKENIZER = load_tokenizer(tokenizer_spec, eos_token)


def tokenize_unit(task: UnitTask) -> dict[str, Any]:
    """Tokenize one input file into its part files and write its completion marker; returns the marker's content."""
    tokenizer = _TOKENIZER
    assert tokenizer is not None, "_init_process loads the tokenizer first"
    dtype = np.dtype(task.dtype)
    meta: dict[str, Any] = {"index": task.index, "path": task.path, "bytes": task.size, "skipped": None,
                            "documents": {s: 0 for s in SPLITS}, "tokens": {s: 0 for s in SPLITS}, "empty": 0}
    pieces: dict[str, list[np.ndarray]] = {s: [] for s in SPLITS}
    try:
        texts = list(read_documents(Source(Path(task.path), task.size), task.text_field))
    except SourceError as exc:
        if not task.skip_bad_files:
            raise
        texts, meta["skipped"] = [], str(exc)
    eos = np.array([tokenizer.eos_id], dtype=dtype)
    for lo in range(0, len(texts), ENCODE_BATCH):
        batch = [t for t in texts[lo:lo + ENCODE_BATCH] if t]
        meta["empty"] += min(ENCODE_BATCH, len(texts) - lo) - len(batch)
        for text, ids in zip(batch, tokenizer.encode_batch(batch), strict=True):
            split = "val" if in_validation(text, task.val_fraction) else "train"
            pieces[split] += [np.asarray(ids, dtype=dtype), eos]
            meta["documents"][split] += 1
            meta["tokens"][split] += len(ids) + 1
    train_file, val_file, marker = part_files(Path(task.parts_dir), task.index)
    for split, path in (("train", train_file), ("val", val_file)):
        _write_atomic(path, np.concatenate(pieces[split]).astype("<" + dtype.str[1:]).tobytes() if pieces[split]
                      else b"")
    _write_atomic(marker, json.dumps(meta, sort_keys=True).encode())
    return meta


class Progress:
    """One line on stderr: files and MB done, tokens, tokens/s. Redrawn in place on a terminal, else a line every
    few seconds (logs stay short)."""

    def __init__(self, total_files: int, total_bytes: int):
        self.total_files, self.total_bytes = total_files, total_bytes
        self.files = self.bytes = self.tokens = 0
        self.t0 = time.monotonic()
        self.last = 0.0
        self.tty = sys.stderr.isatty()

    def add(self, meta: dict[str, Any], counted: bool) -> None:
        self.files += 1
        self.bytes += meta["bytes"]
        if counted:  # parts from an earlier, interrupted run count as done but not towards the rate
            self.tokens += sum(meta["tokens"].values())
        now = time.monotonic()
        if now - self.last >= (0.2 if self.tty else 5.0) or self.files == self.total_files:
            self.last = now
            self.draw(now)

    def rate(self) -> float:
        return self.tokens / max(time.monotonic() - self.t0, 1e-9)

    def draw(self, now: float) -> None:
        line = (f"prepare: {self.files}/{self.total_files} files  {self.bytes / 1e6:,.1f}/{self.total_bytes / 1e6:,.1f}"
                f" MB  {self.tokens:,} tokens  {self.tokens / max(now - self.t0, 1e-9):,.0f} tokens/s")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tty:
            print(file=sys.stderr, flush=True)


def run_units(tasks: list[UnitTask], done: dict[int, dict[str, Any]], workers: int, tokenizer_spec: str,
              eos_token: str | None, progress: Progress) -> None:
    """Tokenize the tasks not in `done` (index -> marker), with `workers` processes (1: this process)."""
    pending = [t for t in tasks if t.index not in done]
    for meta in done.values():
        progress.add(meta, counted=False)
    if workers <= 1 or len(pending) <= 1:
        _init_process(tokenizer_spec, eos_token)
        for task in pending:
            done[task.index] = tokenize_unit(task)
            progress.add(done[task.index], counted=True)
        return
    # spawn, not fork: the tokenizers library's thread pool does not survive a fork of a process that used it.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_init_process,
                             initargs=(tokenizer_spec, eos_token)) as pool:
        # A bounded window of submitted tasks: an error stops the run after the files in flight, not after all.
        queue = iter(pending)
        in_flight = {pool.submit(tokenize_unit, t) for t in [next(queue) for _ in range(min(len(pending),
                                                                                                  2 * workers))]}
        try:
            while in_flight:
                finished, in_flight = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in finished:
                    meta = future.result()
                    done[meta["index"]] = meta
                    progress.add(meta, counted=True)
                    task = next(queue, None)
                    if task is not None:
                        in_flight.add(pool.submit(tokenize_unit, task))
        except BaseException:
            for future in in_flight:
                future.cancel()
            raise


def assemble_split(split: str, metas: list[dict[str, Any]], parts_dir: Path, out: Path, dtype: np.dtype,
                   shard_tokens: int) -> dict[str, Any]:
    """Concatenate the parts of one split, in input order, into shards of at most `shard_tokens` tokens, cut between
    input files (one input larger than that makes a shard of its own). Returns the split's manifest entry."""
    groups: list[list[dict[str, Any]]] = []
    size = 0
    for meta in metas:
        n = meta["tokens"][split]
        if n == 0:
            continue
        if not groups or size + n > shard_tokens:
            groups.append([])
            size = 0
        groups[-1].append(meta)
        size += n
    shards = []
    for index, group in enumerate(groups):
        path = out / shard_name(split, index)
        tmp = path.with_name(path.name + ".tmp")
        digest = hashlib.sha256()
        with tmp.open("wb") as f:
            for meta in group:
                data = part_files(parts_dir, meta["index"])[SPLITS.index(split)].read_bytes()
                digest.update(data)
                f.write(data)
        os.replace(tmp, path)
        tokens = sum(m["tokens"][split] for m in group)
        assert path.stat().st_size == tokens * dtype.itemsize, f"{path}: size does not match its parts"
        shards.append({"file": path.name, "tokens": tokens, "documents": sum(m["documents"][split] for m in group),
                       "sha256": digest.hexdigest()})
    return {"tokens": sum(s["tokens"] for s in shards), "documents": sum(s["documents"] for s in shards),
            "shards": shards}


def settings_of(args: argparse.Namespace, tokenizer: Tokenizer, sources: list[Source]) -> dict[str, Any]:
    """What decides the output bytes: a resumed or repeated run must have the same."""
    return {"format": FORMAT, "version": FORMAT_VERSION,
            "tokenizer": {"kind": tokenizer.kind, "path": tokenizer.path, "sha256": tokenizer.sha256,
                          "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
                          "eos_token": tokenizer.eos_token},
            "dtype": token_dtype(tokenizer.vocab_size).name, "val_fraction": args.val_fraction,
            "text_field": args.text_field, "shard_tokens": args.shard_tokens, "skip_bad_files": args.skip_bad_files,
            "sources": [{"path": str(s.path), "bytes": s.size} for s in sources]}


def differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    out = []
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            if key == "sources":
                a, b = {s["path"]: s["bytes"] for s in saved.get(key, [])}, {s["path"]: s["bytes"] for s in now[key]}
                changed = sorted(p for p in set(a) | set(b) if a.get(p) != b.get(p))
                example = f", e.g. {changed[0]}" if changed else " (their order)"
                out.append(f"sources ({len(changed)} files added, removed or resized{example})")
            else:
                out.append(f"{key} (saved {saved.get(key)!r}, now {now.get(key)!r})")
    return out


def prepare(args: argparse.Namespace) -> dict[str, Any]:
    """The whole preparation; returns the manifest. Raises PrepareError / SourceError / TokenizerError."""
    if not 0 <= args.val_fraction < 1:
        raise PrepareError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
    if args.shard_tokens < 1:
        raise PrepareError(f"--shard-tokens must be >= 1, got {args.shard_tokens}")
    tokenizer = load_tokenizer(args.tokenizer, args.eos_token)
    sources = find_sources(args.input, tuple(args.include), tuple(args.exclude))
    settings = settings_of(args, tokenizer, sources)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} is a file; give a directory")
    manifest_path = out / MANIFEST_FILE
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        diff = differences(manifest["settings"], settings)
        if diff:
            raise PrepareError(f"{out} already holds a corpus prepared with other settings: {'; '.join(diff)}. "
                               "Choose another --out, or delete it to prepare it again")
        LOG.info("%s is already prepared with these settings (manifest.json); nothing to do", out)
        shutil.rmtree(out / PARTS_DIR, ignore_errors=True)
        return manifest
    parts_dir = out / PARTS_DIR
    parts_dir.mkdir(parents=True, exist_ok=True)
    settings_path = parts_dir / SETTINGS_FILE
    if settings_path.is_file():
        diff = differences(json.loads(settings_path.read_text()), settings)
        if diff:
            raise PrepareError(f"{out} holds an interrupted preparation with other settings: {'; '.join(diff)}. "
                               "Run it again with its settings, choose another --out, or delete it")
    else:
        _write_atomic(settings_path, json.dumps(settings, indent=1, sort_keys=True).encode())

    dtype = token_dtype(tokenizer.vocab_size)
    tasks = [UnitTask(i, str(s.path), s.size, args.text_field, args.val_fraction, dtype.name, str(parts_dir),
                      args.skip_bad_files) for i, s in enumerate(sources)]
    done: dict[int, dict[str, Any]] = {}
    for task in tasks:
        marker = part_files(parts_dir, task.index)[2]
        if marker.is_file():
            done[task.index] = json.loads(marker.read_text())
    if done:
        LOG.info("continuing an interrupted preparation: %d of %d files already tokenized", len(done), len(tasks))
    progress = Progress(len(tasks), sum(s.size for s in sources))
    try:
        run_units(tasks, done, args.workers, args.tokenizer, args.eos_token, progress)
    finally:
        progress.close()
    metas = [done[t.index] for t in tasks]

    for meta in metas:
        if meta["skipped"]:
            LOG.warning("skipped: %s", meta["skipped"])
    n_docs = {s: sum(m["documents"][s] for m in metas) for s in SPLITS}
    if n_docs["train"] == 0:
        raise PrepareError(f"the inputs hold no document for training ({len(sources)} files, "
                           f"{sum(m['empty'] for m in metas)} empty documents, {n_docs['val']} in validation): "
                           "pass inputs with text, or lower --val-fraction")
    if args.val_fraction > 0 and n_docs["val"] == 0:
        raise PrepareError(f"no document of the {n_docs['train']} fell into the validation split at --val-fraction "
                           f"{args.val_fraction}: raise it (or pass 0 for no validation split)")
    splits = {s: assemble_split(s, metas, parts_dir, out, dtype, args.shard_tokens) for s in SPLITS}
    manifest = {
        "format": FORMAT, "version": FORMAT_VERSION, "settings": settings,
        "tokenizer": settings["tokenizer"], "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
        "dtype": dtype.name, "splits": splits,
        "sources": [{"path": m["path"], "bytes": m["bytes"], "documents": sum(m["documents"].values()),
                     "tokens": sum(m["tokens"].values())} for m in metas if not m["skipped"]],
        "skipped_sources": [{"path": m["path"], "reason": m["skipped"]} for m in metas if m["skipped"]],
        "empty_documents": sum(m["empty"] for m in metas),
    }
    manifest_bytes = json.dumps(manifest, indent=1, sort_keys=True).encode() + b"\n"
    _write_atomic(manifest_path, manifest_bytes)
    # The digests were computed from the bytes written: the first training start need not hash them again.
    record_verified(out, manifest, hashlib.sha256(manifest_bytes).hexdigest())
    shutil.rmtree(parts_dir)
    elapsed = time.monotonic() - progress.t0
    LOG.info("wrote %s: %s train tokens (%d documents, %d shards), %s validation tokens (%d documents); "
             "%.1f s, %s tokens/s", out, f"{splits['train']['tokens']:,}", splits["train"]["documents"],
             len(splits["train"]["shards"]), f"{splits['val']['tokens']:,}", splits["val"]["documents"], elapsed,
             f"{progress.rate():,.0f}")
    return manifest


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m orchestration.data.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True,
                        help="files, directories (searched for --include) or glob patterns: .txt and other text "
                             "files (one document each), .jsonl (one per line), .parquet (one per row)")
    parser.add_argument("--tokenizer", required=True,
                        help="a Hugging Face tokenizer.json (python -m orchestration.data.train_tokenizer makes one) "
                             "or 'bytes'")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--val-fraction", type=float, default=0.01,
                        help="share of documents held out for evaluation, chosen by a hash of their text")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    parser.add_argument("--text-field", default="text", help="field of .jsonl lines / column of .parquet files")
    parser.add_argument("--include", nargs="+", default=list(DEFAULT_INCLUDE),
                        help="patterns of the files read from directory inputs")
    parser.add_argument("--exclude", nargs="+", default=list(DEFAULT_EXCLUDE),
                        help="names (or patterns) of directories not searched below directory inputs, e.g. "
                             "site-packages")
    parser.add_argument("--eos-token", default=None,
                        help="the tokenizer's end-of-document token (default: the first it has of <|endoftext|>, "
                             "<|end_of_text|>, DeepSeek's end of sentence, </s>, <eos>)")
    parser.add_argument("--shard-tokens", type=int, default=1 << 28,
                        help="most tokens per shard file (shards are cut between input files)")
    parser.add_argument("--skip-bad-files", action="store_true",
                        help="leave out input files that cannot be read (listed in the manifest) instead of stopping")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        prepare(args)
    except (PrepareError, SourceError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print(f"interrupted: run the same command again to continue ({args.out}/{PARTS_DIR} keeps the files done)",
              file=sys.stderr, flush=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
