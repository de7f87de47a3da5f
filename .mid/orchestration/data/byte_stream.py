"""Deterministic byte-level text stream.

Sample i is a pure function of (seed, i): a window of seq_len + 1 bytes starting at an offset drawn from a
generator seeded with (seed, i). So any worker at any world size can produce exactly sample i, and resuming after a
resize consumes exactly the samples not yet consumed, none twice. Bytes need no tokenizer and are present on every
machine (the Python standard library's sources by default).
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import torch

VOCAB_SIZE = 256  # byte-level


def python_stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def collect_text_files(source: Path, glob: str, max_files: int | None) -> list[Path]:
    """The source's files matching `glob`, sorted, the first `max_files` of them (None: all)."""
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise FileNotFoundError(f"data source {source} does not exist; set data.source to a file or directory")
    # Sorted so every worker sees the same corpus in the same order; site-packages excluded (differs per machine).
    files = sorted(p for p in source.rglob(glob) if "site-packages" not in p.parts and p.is_file())
    if not files:
        raise FileNotFoundError(f"no files matching '{glob}' under {source}; set data.source or data.glob")
    return files[:max_files]


# How a sample index maps to a window start, recorded in every checkpoint (data_sampling): starts in
# [0, len - seq_len - 1], so every byte is reachable. A resume refuses a checkpoint that records another rule or
# none (orchestration/training/checkpointing.py), since sample i would read another window.
WINDOW_RULE = 2


class ByteTextDataset:
    vocab_size = VOCAB_SIZE
    window_rule = WINDOW_RULE

    def __init__(self, files: list[Path], seq_len: int, seed: int):
        chunks = [p.read_bytes() for p in files]
        self.corpus = np.frombuffer(b"\n".join(chunks), dtype=np.uint8)
        if len(self.corpus) < seq_len + 2:
            raise ValueError(f"corpus of {len(self.corpus)} bytes is shorter than data.seq_len + 2 = {seq_len + 2}")
        self.seq_len = seq_len
        self.seed = seed
        # Fingerprint so a resume can verify it reads the same corpus it was trained on.
        self.fingerprint = hashlib.sha256(self.corpus[: 1 << 20].tobytes()).hexdigest()[:16] + f"-{len(self.corpus)}"

    def sample(self, global_index: int) -> torch.Tensor:
        rng = np.random.default_rng([self.seed, global_index])
        # A window is seq_len + 1 bytes (inputs and next-byte targets); integers' upper bound is exclusive.
        last_start = len(self.corpus) - self.seq_len - 1
        start = int(rng.integers(0, last_start + 1))
        window = self.corpus[start : start + self.seq_len + 1]
        return torch.from_numpy(window.astype(np.int64))

    def batch(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-byte targets for global samples [start, end)."""
        rows = torch.stack([self.sample(i) for i in range(start, end)])
        return rows[:, :-1], rows[:, 1:]


class HeldOutBytes:
    """Validation sequences of the byte stream: consecutive, non-overlapping windows of seq_len + 1 bytes over the
    files past the training ones (data.max_files), joined as the training files are. Only the files the first
    `n_sequences` windows need are read."""

    def __init__(self, files: list[Path], seq_len: int, n_sequences: int):
        need = n_sequences * seq_len + 1
        chunks, size = [], 0
        for path in files:
            chunks.append(path.read_bytes())
            size += len(chunks[-1]) + 1
            if size >= need:
                break
        self.corpus = np.frombuffer(b"\n".join(chunks), dtype=np.uint8)
        self.seq_len = seq_len
        self.files = files[:len(chunks)]

    def validation_capacity(self) -> int:
        return max(0, (len(self.corpus) - 1) // self.seq_len)

    def validation_batch(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of validation sequences [start, end): sequence j is bytes [j * seq_len, (j + 1) *
        seq_len] of the held-out files."""
        if end > self.validation_capacity():
            raise ValueError(f"the held-out files ({len(self.files)} after data.max_files) hold "
                             f"{self.validation_capacity()} sequences of {self.seq_len} bytes, asked for {end}: lower "
                             "data.eval_sequences or data.max_files")
        rows = torch.stack([torch.from_numpy(self.corpus[j * self.seq_len:(j + 1) * self.seq_len + 1].astype(np.int64))
                            for j in range(start, end)])
        return rows[:, :-1], rows[:, 1:]
