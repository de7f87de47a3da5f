"""The default job on a machine with GPUs, as a user there types it: `python launch.py` with no cluster, data or
train shape flags plans one GPU worker per card, memory read from the device, the model's own context length, and
trains on the GPUs (skipped without CUDA; run on the lent GPU machine). The CPU machine's default job is
tests/test_e2e_train.py; every other launching test hides the GPUs (tests/conftest.py's isolated_env says why)."""

import json
import os

import pytest
import torch
import yaml

from models.registry import MODEL_FLAVORS
from orchestration.observability.events import read_jsonl
from tests.conftest import CPU_CLUSTER_ENV, launch

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

STEPS = 30


def test_default_job_on_a_gpu_machine_trains_on_its_gpus(tmp_path, isolated_env, no_ray_leftovers):
    # The machine as its user has it: the GPUs isolated_env hides given back as this process sees them.
    env = {k: v for k, v in isolated_env.items() if k not in CPU_CLUSTER_ENV}
    env.update({k: os.environ[k] for k in CPU_CLUSTER_ENV if k in os.environ})
    gpus = torch.cuda.device_count()
    proc = launch(env, f"run_root={tmp_path / 'runs'}", "run_name=gpu_default", f"train.steps={STEPS}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "gpu_default"
    # What the machine decided is printed before the run starts and kept in its run_start event.
    events = read_jsonl(run_dir / "events.jsonl")
    run_start = next(e for e in events if e["event"] == "run_start")
    cluster_line = run_start["machine"][0]
    assert cluster_line.startswith(f"cluster: {gpus} cuda worker(s), 1 GPU and "), run_start["machine"]
    assert f"from this machine: {gpus} x {torch.cuda.get_device_name(0)}" in cluster_line
    layers = run_start["fp8_layers"]
    if run_start["precision"] == "fp8":  # some layer large enough for FP8 to pay: the count is printed
        printed = [cluster_line, f"fp8: {layers['converted']} of {layers['eligible']} layers"]
    else:  # none: bf16, and the plan says why (a bf16 job has no FP8 layer to count)
        assert layers == {"eligible": 0, "converted": 0, "kept_bf16": {}}, layers
        printed = [cluster_line, *(n for n in run_start["machine"] if n.startswith("precision bf16: no layer of"))]
        assert len(printed) == 2, run_start["machine"]
    for line in printed:
        assert line in proc.stdout and proc.stdout.index(line) < proc.stdout.index("Run directory:"), proc.stdout[:3000]

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    cluster, data, train = config["cluster"], config["data"], config["train"]
    assert cluster["device"] == "cuda" and cluster["gpus_per_worker"] == 1
    assert cluster["min_workers"] == cluster["max_workers"] == gpus
    memory_gb = torch.cuda.get_device_properties(0).total_memory / 1024**3
    assert cluster["memory_per_worker_gb"] == pytest.approx(memory_gb, abs=0.05)
    flavor = MODEL_FLAVORS[config["model"]["name"]]
    assert data["seq_len"] == flavor.args.max_seq_len  # the model's context, not the CPU demo's 128
    assert train["global_batch_size"] == max(1, flavor.tokens_per_gpu_step // data["seq_len"]) * gpus

    start = next(e for e in events if e["event"] == "worker_group_start")
    assert start["world_size"] == gpus
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics][-1] == STEPS and all(m["mfu"] > 0 for m in metrics)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["final_step"] == STEPS
    # Byte-level loss starts near ln(256) = 5.55; 30 steps of 16k tokens must learn more than byte frequencies.
    assert summary["final_loss"] < summary["first_loss"] - 1.0, summary
