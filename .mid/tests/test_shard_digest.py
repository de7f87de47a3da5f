"""Token shards are verified against the manifest's sha256 before their tokens are used
(orchestration/data/shard_digest.py): the adversarial case of 5000 token ids changed in place with the size kept is
refused naming the shard and both digests, also when the old mtime is put back; an intact corpus is hashed once
(prepare records its digests) and then trusted by file identity. A real corpus prepared by the command."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from orchestration.data.shard_digest import VERIFIED_FILE
from orchestration.data.shards import CorpusError, TokenizedDataset

REPO = Path(__file__).resolve().parent.parent
STDLIB = Path(sysconfig.get_paths()["stdlib"])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus") / "prepared"
    proc = subprocess.run([sys.executable, "-m", "orchestration.data.prepare", "--input", str(STDLIB / "json"),
                           str(STDLIB / "email"), "--tokenizer", "bytes", "--out", str(out), "--val-fraction", "0.1",
                           "--workers", "1", "--shard-tokens", "100000"], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture
def corpus(prepared, tmp_path) -> Path:
    """A private copy; the marker goes with it, so the copy is trusted only once its shards are hashed again."""
    copy = tmp_path / "corpus"
    shutil.copytree(prepared, copy)
    return copy


def change_ids_in_place(shard: Path, count: int, dtype: str) -> None:
    """Overwrite `count` token ids in the middle of the shard through the same file (size kept), as an editor or a
    bad copy would: a plain write, so the kernel moves mtime and ctime."""
    ids = np.fromfile(shard, dtype=dtype)
    start = len(ids) // 3
    ids[start:start + count] = (ids[start:start + count] + 1) % 200
    with shard.open("r+b") as f:
        f.write(ids.tobytes())


def test_prepare_records_its_digests_and_an_intact_corpus_is_hashed_once(prepared, corpus):
    manifest = json.loads((prepared / "manifest.json").read_text())
    n_shards = sum(len(manifest["splits"][s]["shards"]) for s in ("train", "val"))
    assert n_shards >= 3
    assert TokenizedDataset(prepared, 64, 0).verification.hashed == 0  # prepare's marker vouches for every shard
    first = TokenizedDataset(corpus, 64, 0).verification  # a copy: other inodes, hashed once
    assert (first.hashed, first.trusted) == (n_shards, 0)
    again = TokenizedDataset(corpus, 64, 0).verification
    assert (again.hashed, again.trusted) == (0, n_shards)


@pytest.mark.parametrize("restore_mtime", [False, True])
def test_shard_changed_in_place_with_its_size_is_refused_naming_both_digests(corpus, restore_mtime):
    manifest = json.loads((corpus / "manifest.json").read_text())
    TokenizedDataset(corpus, 64, 0)  # verified and marked
    entry = manifest["splits"]["train"]["shards"][1]
    shard = corpus / entry["file"]
    st = shard.stat()
    change_ids_in_place(shard, 5000, manifest["dtype"])
    if restore_mtime:
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_size == st.st_size and (shard.stat().st_mtime_ns == st.st_mtime_ns) == restore_mtime
    found = hashlib.sha256(shard.read_bytes()).hexdigest()
    with pytest.raises(CorpusError) as info:
        TokenizedDataset(corpus, 64, 0)
    message = str(info.value)
    assert message.startswith(f"shard {shard} has sha256 {found}, the manifest says {entry['sha256']}: "), message
    assert "nothing was trained on it" in message
    marker = json.loads((corpus / VERIFIED_FILE).read_text())
    assert entry["file"] not in marker["shards"]  # the changed shard is not vouched for any more
