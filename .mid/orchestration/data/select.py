"""Which data a job reads (the conf/data group), checked before Ray starts, and the model vocabulary it needs.

`resolve_data` runs when the config is loaded (orchestration.validation.validate): for data=tokenized it reads the
manifest (errors name data.path and what to do), records its sha256 in data.manifest_sha256 (config.yaml, W&B and
the resume check see it), checks a data.tokenizer given against the manifest's, and sizes the vocabulary: a debug
model takes the tokenizer's size rounded up to a multiple the FP8 head accepts; any other model must already have
room for every id. `build_datasets` is the worker side: the training samples and the validation set.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Any

from orchestration.config import DATA_KINDS, ConfigError, JobConfig
from orchestration.data.byte_stream import VOCAB_SIZE as BYTE_VOCAB_SIZE

log = logging.getLogger(__name__)

def _fail(key: str, message: str) -> None:
    raise ConfigError(f"{key}: {message}")


def resolve_data(job: JobConfig) -> None:
    """Check the data settings and fill what they decide (data.manifest_sha256, a debug model's vocab_size).
    Raises ConfigError naming the key. Idempotent."""
    d = job.data
    if d.name not in DATA_KINDS:
        _fail("data.name", f"'{d.name}' is not one of {DATA_KINDS} (pick the group: data=stdlib or data=tokenized)")
    if d.eval_sequences < 1:
        _fail("data.eval_sequences", f"must be >= 1, got {d.eval_sequences} (train.eval_every=0 turns evaluation off)")
    if d.name == "stdlib":
        # Checked, not filled: a byte-stream run's model.overrides stay as given (a resume compares them).
        fit_model_vocab(job, BYTE_VOCAB_SIZE, "the byte-level data", fill=False)
        if d.tokenizer != "bytes":
            _fail("data.tokenizer", f"data=stdlib reads raw bytes (data.tokenizer=bytes), got {d.tokenizer!r}: to train "
                  "with a tokenizer, prepare a corpus (python -m orchestration.data.prepare --tokenizer ...) and use "
                  "data=tokenized data.path=DIR")
        if d.manifest_sha256 is not None:
            _fail("data.manifest_sha256", "is set for data=tokenized only; leave it out")
        return
    from orchestration.data.shards import CorpusError, load_manifest, manifest_digest

    if not d.path or not os.path.isabs(d.path):
        _fail("data.path", f"data=tokenized needs the absolute path of a prepared corpus (python -m "
              f"orchestration.data.prepare --out DIR), got {d.path!r}")
    root = Path(d.path)
    try:
        manifest = load_manifest(root)
    except CorpusError as exc:
        raise ConfigError(f"data.path: {exc}") from None
    digest = manifest_digest(root)
    if d.manifest_sha256 is None:
        d.manifest_sha256 = digest
    elif d.manifest_sha256 != digest:
        _fail("data.manifest_sha256", f"{root}/manifest.json has sha256 {digest}, not {d.manifest_sha256}: another "
              "corpus than the one named; drop data.manifest_sha256 or point data.path at that corpus")
    if d.tokenizer is not None:
        want = manifest["tokenizer"]["sha256"]
        try:
            have = hashlib.sha256(Path(d.tokenizer).read_bytes()).hexdigest()
        except OSError as exc:
            raise ConfigError(f"data.tokenizer: cannot read {d.tokenizer}: {exc.strerror or exc}") from None
        if have != want:
            _fail("data.tokenizer", f"{d.tokenizer} (sha256 {have[:12]}...) is not the tokenizer {root} was prepared "
                  f"with ({manifest['tokenizer']['path']}, sha256 {want[:12]}...): set data.tokenizer=null or "
                  "prepare the corpus with this tokenizer")
    fit_model_vocab(job, int(manifest["vocab_size"]), f"the tokenizer of data.path={root}")
    val_sequences = max(0, (manifest["splits"]["val"]["tokens"] - 1) // d.seq_len)
    if job.train.eval_every > 0 and val_sequences < d.eval_sequences:
        if val_sequences == 0:
            _fail("data.eval_sequences", f"the validation split of {root} holds no sequence of data.seq_len={d.seq_len} "
                  "tokens: prepare the corpus with a larger --val-fraction, lower data.seq_len, or set "
                  "train.eval_every=0")
        # A small held-out split is still worth evaluating on: all of it, said once here (config.yaml records it).
        log.warning("data.eval_sequences=%d: the validation split of %s holds %d sequences of %d tokens; evaluating "
                    "on all %d", d.eval_sequences, root, val_sequences, d.seq_len, val_sequences)
        d.eval_sequences = val_sequences


def fit_model_vocab(job: JobConfig, vocab_size: int, what: str, fill: bool = True) -> None:
    """With `fill`, a debug flavor without an explicit model.overrides.vocab_size takes `vocab_size` rounded up to a
    multiple of 16 (the FP8 head's GEMM sizes); a model whose vocabulary is smaller than the data's ids is refused."""
    from models.registry import MODEL_FLAVORS
    from orchestration.data.tokenizer import padded_vocab_size

    flavor = MODEL_FLAVORS.get(job.model.name)
    if flavor is None:
        return  # validate names the unknown model
    overrides: dict[str, Any] = job.model.overrides
    if fill and flavor.name.startswith("debug_") and "vocab_size" not in overrides:
        overrides["vocab_size"] = padded_vocab_size(vocab_size)
    model_vocab = int(overrides.get("vocab_size", flavor.args.vocab_size))
    if model_vocab < vocab_size:
        _fail("model.overrides.vocab_size", f"model {job.model.name} has vocab_size={model_vocab}, below the "
              f"{vocab_size} token ids of {what}; set model.overrides.vocab_size to at least {vocab_size} "
              f"({padded_vocab_size(vocab_size)}, a multiple of 16, if the FP8 output head is on) or use a smaller "
              "tokenizer")


def build_datasets(job: JobConfig) -> tuple[Any, Any | None]:
    """(training samples, validation set or None) for the worker: a TokenizedDataset serves both; the byte stream
    holds out the files after its first data.max_files (None when there are none, e.g. a one-file source)."""
    d = job.data
    if d.name == "tokenized":
        from orchestration.data.shards import TokenizedDataset

        dataset = TokenizedDataset(Path(d.path), d.seq_len, d.seed)
        if d.manifest_sha256 is not None and dataset.digest != d.manifest_sha256:
            raise ValueError(f"this worker's data.path={d.path} holds another corpus (manifest sha256 "
                             f"{dataset.digest[:12]}...) than the driver saw ({d.manifest_sha256[:12]}...): give every "
                             "node the same prepared directory (e.g. on a shared filesystem)")
        return dataset, (dataset if dataset.val.total > 0 else None)
    from orchestration.data.byte_stream import ByteTextDataset, HeldOutBytes, collect_text_files, python_stdlib_dir

    source = python_stdlib_dir() if d.source == "python_stdlib" else Path(d.source)
    files = collect_text_files(source, d.glob, max_files=None)
    dataset = ByteTextDataset(files[:d.max_files], d.seq_len, d.seed)
    held_out = files[d.max_files:]
    return dataset, (HeldOutBytes(held_out, d.seq_len, d.eval_sequences) if held_out else None)
