"""benchmarks/multi_gpu.py end to end at debug sizes on CPU: 2 gloo workers through torchrun (--max-restarts=1) and
through Ray, rank 1 killed (SIGKILL) after the first checkpoint; each run restarts its worker group, resumes from that
checkpoint and finishes; results written as the benchmarks write them.

The torchrun leg needs orchestration.training.process_group.torchrun_store_prefix: torchrun keeps one TCPStore for
all the attempts of a launch, and without the attempt's own key prefix the restarted group read the killed group's
gloo addresses there ("connection refused") and the run ended at the kill step (4 of 5 runs with
checkpoint.keep_last=1 before the fix, 0 of 5 after)."""

from __future__ import annotations

import json
import subprocess
import sys

from orchestration.observability.events import read_jsonl
from tests.conftest import REPO

STEPS, FAULT_STEP, EVERY = 8, 5, 4


def test_multi_gpu_script_restarts_a_killed_worker_through_torchrun_and_ray(tmp_path, isolated_env,
                                                                             no_ray_leftovers):
    out, runs = tmp_path / "out", tmp_path / "runs"
    proc = subprocess.run([sys.executable, "benchmarks/multi_gpu.py", "--debug", "--gpus", "2", "--out", str(out),
                           "--run-root", str(runs), "--models", "llama3_8b", "--precisions", "fp8",
                           "--steps", str(STEPS), "--fault-step", str(FAULT_STEP), "--checkpoint-every", str(EVERY),
                           "--skip-steps", "0", "--timeout-s", "600", "--common", "train.log_every=1"],
                          check=False, cwd=REPO, env=isolated_env, capture_output=True, text=True, timeout=1300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "multi_gpu.json").read_text())
    assert result["gpus"] == 2 and result["debug"] is True and "torch" in result["env"]
    assert [r["launcher"] for r in result["runs"]] == ["torchrun", "ray"]
    for r in result["runs"]:
        assert r["returncode"] == 0 and r["status"] == "completed" and r["final_step"] == STEPS, r["name"]
        fault = r["fault"]
        assert fault["fired"] == [f"fault_kill_worker_rank1_step{FAULT_STEP}.fired"], fault
        assert fault["resumed_from"] == [EVERY], fault  # the checkpoint before the kill
        assert fault["restarts"] == 1 and fault["world_sizes_seen"] == [2], fault
        assert r["tokens_per_s_median"] > 0
        assert (out / r["name"] / "metrics.jsonl").exists() and not (out / r["name"] / "checkpoints").exists()
        # One run: one start and one end around two worker groups, the second one's loss of the first recorded.
        events = read_jsonl(out / r["name"] / "events.jsonl")
        names = [e["event"] for e in events if e.get("worker_rank", 0) == 0]
        assert names.count("run_start") == 1 and names.count("run_end") == 1, names
        # Both launchers record what the plan decided: the FP8 layers (all of them emulated on CPU) and the notes.
        start = next(e for e in events if e["event"] == "run_start")
        layers = start["fp8_layers"]
        assert layers["converted"] == layers["eligible"] > 0 and isinstance(start["machine"], list), start
        assert names.count("worker_group_start") == 2 and names.count("worker_lost") == 1, names
        resume = next(e for e in events if e["event"] == "resume")
        assert resume["origin"] == "restart" and resume["from_step"] == EVERY, resume
        # every step trained exactly once in metrics (the killed group's steps after the checkpoint superseded)
        steps = [m["step"] for m in read_jsonl(out / r["name"] / "metrics.jsonl")]
        assert steps == list(range(1, STEPS + 1)), steps
    torchrun = result["runs"][0]
    groups = [e["group_id"] for e in read_jsonl(out / torchrun["name"] / "events.jsonl")
              if e["event"] == "worker_group_start"]
    assert groups == ["torchrun-attempt0", "torchrun-attempt1"], groups
