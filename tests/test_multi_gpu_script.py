"""benchmarks/multi_gpu.py end to end at debug sizes on CPU: 2 gloo workers through Ray, rank 1 killed (SIGKILL) after
the first checkpoint, the run resumed from it and finished; results written as the benchmarks write them.

Only the Ray launcher here: torchrun's own restart of the killed group (--max-restarts=1) failed in 1 of 3 runs at
these settings on the 2-core CI machine (no resume, the run ended at the kill step) and in 2 of 2 with
checkpoint.keep_last=1 (the new gloo group reached the previous attempt's address: connection refused) - an open bug
of the torchrun restart path, not of the script."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO

STEPS, FAULT_STEP, EVERY = 8, 5, 4


def test_multi_gpu_script_runs_through_ray_with_a_killed_worker(tmp_path, isolated_env, no_ray_leftovers):
    out, runs = tmp_path / "out", tmp_path / "runs"
    proc = subprocess.run([sys.executable, "benchmarks/multi_gpu.py", "--debug", "--gpus", "2", "--out", str(out),
                           "--run-root", str(runs), "--models", "llama3_8b", "--precisions", "fp8",
                           "--steps", str(STEPS), "--fault-step", str(FAULT_STEP), "--checkpoint-every", str(EVERY),
                           "--skip-steps", "0", "--timeout-s", "600", "--launchers", "ray", "--common", "train.log_every=1"],
                          check=False, cwd=REPO, env=isolated_env, capture_output=True, text=True, timeout=1300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "multi_gpu.json").read_text())
    assert result["gpus"] == 2 and result["debug"] is True and "torch" in result["env"]
    assert [r["launcher"] for r in result["runs"]] == ["ray"]
    for r in result["runs"]:
        assert r["returncode"] == 0 and r["status"] == "completed" and r["final_step"] == STEPS, r["name"]
        fault = r["fault"]
        assert fault["fired"] == [f"fault_kill_worker_rank1_step{FAULT_STEP}.fired"], fault
        assert fault["resumed_from"] == [EVERY], fault  # the checkpoint before the kill
        assert r["tokens_per_s_median"] > 0
        assert (out / r["name"] / "metrics.jsonl").exists() and not (out / r["name"] / "checkpoints").exists()
