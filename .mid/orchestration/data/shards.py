"""Reading a prepared corpus (orchestration.data.prepare): the manifest, memory-mapped shards, training windows and
the fixed validation sequences.

Sample i is a window of seq_len + 1 tokens of the training split, seen as one stream (its shards end to end), that
starts at an offset drawn from a generator seeded with (seed, i): the same pure function of the index as the byte
stream (orchestration.data.byte_stream), so a constant global batch, exact-once samples across resizes and restarts,
and rollback's skipped windows carry over unchanged. sample_location gives the (shard, offset) the window starts at.
Validation sequences are consecutive, non-overlapping windows from the start of the validation split: the same
sequences for every run of the corpus, whatever the world size.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from orchestration.data.prepare import FORMAT, FORMAT_VERSION, MANIFEST_FILE, SPLITS
from orchestration.data.shard_digest import ShardDigestError, verify_shards


class CorpusError(ValueError):
    """A prepared corpus that cannot be used; the message names the file and what to do."""


def load_manifest(root: Path) -> dict[str, Any]:
    """The manifest of a prepared corpus, checked against its shard files (present, of the recorded size)."""
    path = root / MANIFEST_FILE
    if not root.is_dir():
        raise CorpusError(f"data.path {root} is not a directory; prepare a corpus with python -m "
                          "orchestration.data.prepare --out DIR and set data.path=DIR")
    if not path.is_file():
        hint = (" (its .parts/ holds an interrupted preparation: run the prepare command again to finish it)"
                if (root / ".parts").is_dir() else "")
        raise CorpusError(f"{root} has no {MANIFEST_FILE}{hint}; prepare the corpus with python -m "
                          "orchestration.data.prepare --out DIR")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CorpusError(f"cannot read {path}: {exc}; prepare the corpus again") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise CorpusError(f"{path} is not a version-{FORMAT_VERSION} {FORMAT} manifest (format "
                          f"{manifest.get('format')!r}, version {manifest.get('version')!r}); prepare the corpus "
                          "again with this version")
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in SPLITS:
        for shard in manifest["splits"][split]["shards"]:
            file = root / shard["file"]
            expected = shard["tokens"] * itemsize
            if not file.is_file() or file.stat().st_size != expected:
                found = f"{file.stat().st_size} bytes" if file.is_file() else "missing"
                raise CorpusError(f"shard {file} is {found}, the manifest says {expected} bytes: copy the whole "
                                  "prepared directory again, or prepare it again")
    return manifest


def manifest_digest(root: Path) -> str:
    """sha256 of manifest.json: names the corpus, its tokenizer and its split (a resume must find the same)."""
    return hashlib.sha256((root / MANIFEST_FILE).read_bytes()).hexdigest()


def corpus_identity(manifest: dict[str, Any], digest: str) -> dict[str, Any]:
    """What a checkpoint records of its corpus, so a refused resume can say what differs."""
    return {"manifest_sha256": digest, "tokenizer_sha256": manifest["tokenizer"]["sha256"],
            "tokenizer_path": manifest["tokenizer"]["path"], "vocab_size": manifest["vocab_size"],
            "train_tokens": manifest["splits"]["train"]["tokens"], "val_tokens": manifest["splits"]["val"]["tokens"]}


def window_start(global_index: int, seed: int, seq_len: int, total_tokens: int) -> int:
    """Where sample `global_index`'s window of seq_len + 1 tokens starts in a stream of `total_tokens` (every token
    reachable: starts in [0, total_tokens - seq_len - 1])."""
    rng = np.random.default_rng([seed, global_index])
    return int(rng.integers(0, total_tokens - seq_len))


def sample_location(global_index: int, seed: int, seq_len: int, shard_tokens: list[int]) -> tuple[int, int]:
    """(shard, offset in it) where sample `global_index`'s window starts; the window may run into the next shards."""
    ends = np.cumsum(shard_tokens).tolist()
    start = window_start(global_index, seed, seq_len, ends[-1])
    shard = bisect.bisect_right(ends, start)
    return shard, start - (ends[shard - 1] if shard else 0)


class TokenStream:
    """The shards of one split, memory-mapped and read as one stream of token ids."""

    def __init__(self, root: Path, split: dict[str, Any], dtype: str):
        self.shard_tokens = [s["tokens"] for s in split["shards"]]
        self.files = [root / s["file"] for s in split["shards"]]
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.starts = [0, *np.cumsum(self.shard_tokens).tolist()]
        self.total = self.starts[-1]
        self._maps: dict[int, np.memmap] = {}

    def _shard(self, index: int) -> np.memmap:
        if index not in self._maps:  # opened when first read: a rank maps only the shards its samples touch
            self._maps[index] = np.memmap(self.files[index], dtype=self.dtype, mode="r")
        return self._maps[index]

    def read(self, shard: int, offset: int, length: int) -> np.ndarray:
        """`length` ids from (shard, offset) on, continuing into the next shards; int64."""
        out = np.empty(length, dtype=np.int64)
        filled = 0
        while filled < length:
            piece = self._shard(shard)[offset:offset + length - filled]
            out[filled:filled + len(piece)] = piece
            filled += len(piece)
            shard, offset = shard + 1, 0
        return out

    def read_at(self, position: int, length: int) -> np.ndarray:
        shard = bisect.bisect_right(self.starts, position) - 1
        return self.read(shard, position - self.starts[shard], length)


class TokenizedDataset:
    """Training samples and validation sequences of a prepared corpus (the byte stream's interface)."""

    window_rule = 2  # the byte stream's current rule (every token reachable); the only one a prepared corpus has

    def __init__(self, root: Path, seq_len: int, seed: int):
        self.root = root
        self.manifest = load_manifest(root)
        self.digest = manifest_digest(root)
        self.identity = corpus_identity(self.manifest, self.digest)
        self.vocab_size = int(self.manifest["vocab_size"])
        self.seq_len, self.seed = seq_len, seed
        self.train = TokenStream(root, self.manifest["splits"]["train"], self.manifest["dtype"])  # maps lazily
        self.val = TokenStream(root, self.manifest["splits"]["val"], self.manifest["dtype"])
        try:  # before any token is read (shard_digest.py: once per shard, re-hashed when its file changed)
            self.verification = verify_shards(root, self.manifest, self.digest)
        except ShardDigestError as exc:
            raise CorpusError(str(exc)) from None
        if self.train.total < seq_len + 1:
            raise CorpusError(f"{root}: the training split has {self.train.total} tokens, fewer than data.seq_len + 1 "
                              f"= {seq_len + 1}; lower data.seq_len or prepare more text")
        self.fingerprint = self.digest[:16] + f"-{self.train.total}"

    def sample(self, global_index: int) -> torch.Tensor:
        shard, offset = sample_location(global_index, self.seed, self.seq_len, self.train.shard_tokens)
        return torch.from_numpy(self.train.read(shard, offset, self.seq_len + 1))

    def batch(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets for global samples [start, end)."""
        rows = torch.stack([self.sample(i) for i in range(start, end)])
        return rows[:, :-1], rows[:, 1:]

    def validation_capacity(self) -> int:
        """How many validation sequences the split holds."""
        return max(0, (self.val.total - 1) // self.seq_len)

    def validation_batch(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of validation sequences [start, end): sequence j is tokens [j * seq_len, (j + 1) *
        seq_len] of the validation split."""
        if end > self.validation_capacity():
            raise CorpusError(f"{self.root}: the validation split holds {self.validation_capacity()} sequences of "
                              f"{self.seq_len} tokens, asked for {end}; lower data.eval_sequences or prepare with a "
                              "larger --val-fraction")
        rows = torch.stack([torch.from_numpy(self.val.read_at(j * self.seq_len, self.seq_len + 1))
                            for j in range(start, end)])
        return rows[:, :-1], rows[:, 1:]
