"""What verifying token shards against the manifest costs (orchestration/data/shard_digest.py), on this machine's CPU:

    python benchmarks/shard_hash.py --mib 512 --out benchmarks/results/shard_hash_cpu.json

sha256 of an in-memory buffer on one core (the hash alone), of shard files read through the page cache with one
thread and with one thread per core (the real verification, verify_shards), and the cost of a start whose shards
the verified-marker vouches for (a stat per shard). The files are written to --dir (default: a temporary directory)
and removed after.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import write_result
from orchestration.data.shard_digest import CHUNK_BYTES, verify_shards


def best_of(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="corpus size written and hashed")
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--out", default=None, help="write the result JSON (benchmarks/common.write_result) here")
    args = parser.parse_args(argv)
    t_start = time.time()
    cores = os.cpu_count() or 1
    chunk = os.urandom(CHUNK_BYTES)
    n_chunks = args.mib * (1 << 20) // CHUNK_BYTES

    def hash_memory() -> None:
        h = hashlib.sha256()
        for _ in range(n_chunks):
            h.update(chunk)

    memory_s = best_of(hash_memory, args.reps)
    total = n_chunks * CHUNK_BYTES
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        per_shard = n_chunks // args.shards
        shards = []
        for i in range(args.shards):
            path = root / f"train_{i:05d}.bin"
            h = hashlib.sha256()
            with path.open("wb") as f:
                for _ in range(per_shard):
                    f.write(chunk)
                    h.update(chunk)
            shards.append({"file": path.name, "tokens": per_shard * CHUNK_BYTES // 4, "sha256": h.hexdigest()})
        manifest = {"splits": {"train": {"shards": shards}, "val": {"shards": []}}}
        files_bytes = per_shard * CHUNK_BYTES * args.shards

        def verify(threads: int) -> None:
            (root / "shards.verified.json").unlink(missing_ok=True)
            result = verify_shards(root, manifest, "bench", threads=threads)
            assert result.hashed == args.shards

        one_thread_s = best_of(lambda: verify(1), args.reps)
        all_cores_s = best_of(lambda: verify(cores), args.reps)
        trusted_s = best_of(lambda: verify_shards(root, manifest, "bench"), args.reps)  # marker from the last run
    results = {
        "cores": cores, "mib": args.mib, "shards": args.shards,
        "sha256_memory_mb_per_s_per_core": round(total / memory_s / 1e6, 1),
        "verify_page_cache_1_thread_mb_per_s": round(files_bytes / one_thread_s / 1e6, 1),
        f"verify_page_cache_{cores}_threads_mb_per_s": round(files_bytes / all_cores_s / 1e6, 1),
        "verify_marker_trusted_s": round(trusted_s, 6),
        "seconds_per_tb_one_core": round(1e12 / (total / memory_s), 0),
    }
    print(json.dumps(results, indent=1))
    if args.out:
        write_result(args.out, benchmark="shard_hash", suite="cpu", command="python " + " ".join(sys.argv),
                     suite_command="", returncode=0, wall_s=time.time() - t_start, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
