"""Checkpoints that cannot be read or are all corrupt, on real files: permission bits enforced for a reader that
runs as root without the capabilities that override them (capsh drops CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH),
and retention with corrupt checkpoints in the directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orchestration.checkpoint.manager import CheckpointManager
from tests.conftest import REPO, repo_on_path

CAPSH = shutil.which("capsh")
DROP = "--drop=cap_dac_override,cap_dac_read_search"

# Run in a child process whose root user has no permission overrides: list, verify and plan retention like a
# resuming worker, print what it found.
READER = """
import json, sys
from orchestration.checkpoint.manager import CheckpointManager
events = []
manager = CheckpointManager(sys.argv[1], rank=0, world_size=1, create=False, clean_tmp=False,
                            event_sink=lambda name, payload: events.append([name, payload]))
info = manager.latest()
kept, deleted = manager.retention_plan()
print(json.dumps({"step": info.step if info else None, "events": events, "kept": kept, "deleted": deleted}))
"""


def _save(root: Path, steps, keep_last: int = 5) -> CheckpointManager:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    manager = CheckpointManager(root, keep_last=keep_last, keep_good=1, rank=0, world_size=1)
    for step in steps:
        manager.save(step, model, optimizer, None, {"step": step})
    return manager


def _read_without_overrides(root: Path) -> dict:
    proc = subprocess.run([CAPSH, DROP, "--", "-c", f'exec "{sys.executable}" -c "$0" "$1"', READER, str(root)],
                          check=False, capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=repo_on_path())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(os.geteuid() != 0 or CAPSH is None,
                    reason="needs root and capsh: the reader drops root's permission overrides (as non-root the "
                           "permission bits already apply; tests elsewhere cover corrupt files)")
@pytest.mark.parametrize("target", ["manifest", "directory", "shard"])
def test_unreadable_newest_checkpoint_falls_back_like_a_corrupt_one(tmp_path, target):
    root = tmp_path / "checkpoints"
    _save(root, [0, 5, 10])
    newest = root / "step_000010"
    path = {"manifest": newest / "manifest.json", "directory": newest,
            "shard": min((newest / "dcp").glob("*.distcp"))}[target]
    mode = path.stat().st_mode
    path.chmod(0)
    try:
        # The permission bits really stop this reader (else the test would pass without testing anything).
        readable = f"cat '{newest / 'manifest.json'}' > /dev/null && cat '{min((newest / 'dcp').glob('*.distcp'))}'"
        probe = subprocess.run([CAPSH, DROP, "--", "-c", readable + " > /dev/null"], check=False,
                               capture_output=True, text=True, timeout=30)
        assert probe.returncode != 0 and "Permission denied" in probe.stderr
        found = _read_without_overrides(root)
    finally:
        path.chmod(mode)
    assert found["step"] == 5
    corrupt = [payload for name, payload in found["events"] if name == "checkpoint_corrupt"]
    assert [c["step"] for c in corrupt] == [10] and "Permission denied" in corrupt[0]["reason"], corrupt
    assert found["deleted"] == []  # an unreadable checkpoint is not deleted, nor counted as a kept one


def test_corrupt_checkpoints_never_count_for_retention(tmp_path):
    """Every checkpoint corrupt, the run started over (checkpoint.resume=false): the new step 0 must survive
    retention although three newer corrupt directories exist, and they stay untouched (not deleted either)."""
    root = tmp_path / "checkpoints"
    _save(root, [10, 20, 30])
    for step in (10, 20, 30):
        shard = min((root / f"step_{step:06d}" / "dcp").glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    events: list = []
    manager = CheckpointManager(root, keep_last=2, keep_good=1, rank=0, world_size=1,
                                event_sink=lambda name, payload: events.append((name, payload["step"])))
    assert manager.latest() is None
    assert sorted(step for name, step in events if name == "checkpoint_corrupt") == [10, 20, 30]
    torch.manual_seed(1)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    manager.save(0, model, optimizer, None, {"step": 0})
    manager.mark_good(0)
    manager.save(1, model, optimizer, None, {"step": 1})
    manager.save(2, model, optimizer, None, {"step": 2})
    steps = sorted(int(p.name[5:]) for p in root.iterdir() if p.name.startswith("step_"))
    # keep_last=2 of the valid ones (2, 1) + the newest good (0); the corrupt 10, 20, 30 neither count nor go.
    assert steps == [0, 1, 2, 10, 20, 30], steps
    assert not [e for e in events if e[0] == "checkpoint_deleted"]


def test_a_failed_saves_cause_names_a_full_disk_whatever_write_hit_it():
    """The checkpoint_failed event's error: a full disk reads "No space left on device" also when torch's zip writer
    was first to hit it (its own text is "unexpected pos"); other errors are reported as they are."""
    import errno

    from orchestration.training.checkpointing import save_failure_cause

    zip_writer = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert save_failure_cause(zip_writer) == ("No space left on device: RuntimeError: [enforce fail at "
                                              "inline_container.cc:672] . unexpected pos 704 vs 598")
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert save_failure_cause(full) == "OSError: [Errno 28] No space left on device"
    wrapped = RuntimeError("save failed")
    wrapped.__cause__ = full
    assert save_failure_cause(wrapped) == "No space left on device: RuntimeError: save failed"
    assert save_failure_cause(ValueError("bad shard")) == "ValueError: bad shard"
