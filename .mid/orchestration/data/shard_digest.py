"""Token shards are used only after their sha256 matched the corpus manifest's.

Hashing every shard at every start would cost a large corpus minutes (docs/data.md gives the measured throughput),
and the samples are windows drawn over the whole training stream, so the first steps already read from nearly every
shard: verifying in the background ahead of use would still have to finish before the first step. So each shard is
verified once, and a marker file beside the manifest (VERIFIED_FILE) records, per shard, the digest that matched
and the file's identity when it was hashed: size, mtime_ns, ctime_ns and inode. A later start re-hashes a shard only
when one of those changed. ctime is what catches an edit that kept the size and put the old mtime back (touch -d,
rsync -t, os.utime): the kernel sets ctime on every write and every utime, and no user-space call can set it back.
A copy of the corpus (new inodes) or a filesystem without ctime is hashed once again.

The marker is written by orchestration.data.prepare (it computed the digests from the bytes it wrote) and after a
verification; where the corpus directory is read-only, every start hashes the shards it has no marker for.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

VERIFIED_FILE = "shards.verified.json"
CHUNK_BYTES = 8 << 20  # hashlib releases the GIL for buffers this large: threads hash on separate cores


class ShardDigestError(ValueError):
    """A shard whose bytes do not match the manifest's digest."""


def file_identity(path: Path) -> list[int]:
    """What changes whenever a file's bytes may have changed: size, mtime_ns, ctime_ns, inode."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb", buffering=0) as f:
        while chunk := f.read(CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def manifest_shards(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """Every shard entry of the manifest (file, tokens, sha256), training split first."""
    return [shard for split in ("train", "val") for shard in manifest["splits"][split]["shards"]]


def read_marker(root: Path, manifest_sha256: str) -> dict[str, Any]:
    """file -> {"identity": [...], "sha256": ...} of the shards verified for this manifest ({} if none)."""
    try:
        marker = json.loads((root / VERIFIED_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(marker, dict) or marker.get("manifest_sha256") != manifest_sha256:
        return {}
    shards = marker.get("shards")
    return shards if isinstance(shards, dict) else {}


def write_marker(root: Path, manifest_sha256: str, shards: dict[str, Any]) -> None:
    """Record verified shards (temp file + rename). A read-only corpus directory is not an error: it costs a hash
    at each start, said once here."""
    tmp = root / f".{VERIFIED_FILE}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps({"manifest_sha256": manifest_sha256, "shards": shards}, indent=1, sort_keys=True))
        os.replace(tmp, root / VERIFIED_FILE)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        log.warning("cannot record the verified shards in %s (%s): the shards will be hashed again at the next "
                    "start", root / VERIFIED_FILE, exc)


def record_verified(root: Path, manifest: dict[str, Any], manifest_sha256: str) -> None:
    """Mark every shard of a corpus whose digests were just computed from its bytes (prepare's own output)."""
    write_marker(root, manifest_sha256, {s["file"]: {"identity": file_identity(root / s["file"]),
                                                      "sha256": s["sha256"]} for s in manifest_shards(manifest)})


@dataclass(frozen=True)
class Verification:
    hashed: int  # shards hashed now
    hashed_bytes: int
    trusted: int  # shards the marker vouched for (identity unchanged)
    seconds: float


def verify_shards(root: Path, manifest: dict[str, Any], manifest_sha256: str,
                  threads: int | None = None) -> Verification:
    """Check every shard against the manifest's sha256, hashing only those the marker cannot vouch for. Raises
    ShardDigestError naming the first mismatching shard and both digests (and how many others mismatch)."""
    t0 = time.perf_counter()
    marker = read_marker(root, manifest_sha256)
    verified: dict[str, Any] = {}
    todo: list[tuple[dict[str, Any], list[int]]] = []
    for shard in manifest_shards(manifest):
        identity = file_identity(root / shard["file"])  # taken before hashing: a change while hashing shows next time
        entry = marker.get(shard["file"])
        if entry and entry.get("identity") == identity and entry.get("sha256") == shard["sha256"]:
            verified[shard["file"]] = entry
        else:
            todo.append((shard, identity))
    if todo:
        workers = max(1, min(len(todo), threads or os.cpu_count() or 1))
        with ThreadPoolExecutor(workers, thread_name_prefix="shard-sha256") as pool:
            found = list(pool.map(lambda item: file_sha256(root / item[0]["file"]), todo))
        bad = [(shard, digest) for (shard, _), digest in zip(todo, found) if digest != shard["sha256"]]
        for (shard, identity), digest in zip(todo, found):
            if digest == shard["sha256"]:
                verified[shard["file"]] = {"identity": identity, "sha256": digest}
        write_marker(root, manifest_sha256, verified)  # the good ones stay vouched for; a bad one never is
        if bad:
            shard, digest = bad[0]
            others = f" ({len(bad) - 1} other shards mismatch too)" if len(bad) > 1 else ""
            raise ShardDigestError(f"shard {root / shard['file']} has sha256 {digest}, the manifest says "
                                   f"{shard['sha256']}{others}: it changed after the corpus was prepared; nothing "
                                   "was trained on it. Restore the prepared directory from its copy, or prepare the "
                                   "corpus again")
    hashed_bytes = sum(root.joinpath(s["file"]).stat().st_size for s, _ in todo)
    return Verification(hashed=len(todo), hashed_bytes=hashed_bytes, trusted=len(verified) - len(todo),
                        seconds=time.perf_counter() - t0)
