"""A run started from a Hugging Face Llama checkpoint through the product's torchrun entry (one CPU process, no Ray):
its first step's loss is transformers' loss on the same batch, the import is recorded and happens once (a resume
loads its checkpoint), and checkpoint.export_hf=final leaves a directory transformers loads with our logits."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from models.llama3 import Llama3
from orchestration.checkpoint.manager import CheckpointManager
from orchestration.data.select import build_datasets
from orchestration.interop.layout import args_from_hf_config, args_of
from orchestration.observability.events import read_jsonl
from orchestration.validation import from_dict
from tests.conftest import REPO
from tests.test_hf_interop import make_llama_dir


def torchrun_main(env: dict, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "orchestration.driver.torchrun", *overrides], capture_output=True,
                          text=True, cwd=REPO, env=env, timeout=600, check=False)


@pytest.fixture(autouse=True)
def exact_matmuls():
    torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.slow
def test_run_from_imported_llama_trains_from_its_weights_and_exports_at_the_end(tmp_path, isolated_env):
    from transformers import AutoModelForCausalLM

    src = make_llama_dir(tmp_path / "src", shard_size=None)  # one model.safetensors
    runs = tmp_path / "runs"
    common = [f"run_root={runs}", "run_name=ft", "model=from_hf", f"model.init_from={src}", "precision=bf16",
              "precision.compute_dtype=float32", "train.global_batch_size=2", "train.micro_batch_size=2",
              "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0", "data.seq_len=32",
              "logging.wandb=false", "checkpoint.every_steps=2", "checkpoint.export_hf=final"]
    first = torchrun_main(isolated_env, *common, "train.steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    run = runs / "ft"
    events = read_jsonl(run / "events.jsonl")
    imported = [e for e in events if e["event"] == "weights_imported"]
    assert len(imported) == 1
    assert imported[0]["path"] == str(src)
    assert imported[0]["config_sha256"] == hashlib.sha256((src / "config.json").read_bytes()).hexdigest()
    assert imported[0]["tensors"] == 21

    # the first step's loss is transformers' on the same batch (the run's own data, sample 0 and 1)
    job = from_dict(yaml.safe_load((run / "config.yaml").read_text()))
    assert job.model.name == "llama3_8b" and job.model.overrides["dim"] == 64  # from config.json alone
    inputs, targets = build_datasets(job)[0].batch(0, 2)
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_loss = F.cross_entropy(hf(inputs).logits.flatten(0, 1), targets.flatten()).item()
    metrics = read_jsonl(run / "metrics.jsonl")
    assert metrics[0]["step"] == 1
    assert metrics[0]["loss"] == pytest.approx(hf_loss, rel=1e-5)

    # the export at the end: the last checkpoint, loaded by transformers, gives our model's logits on it
    exported = [e for e in events if e["event"] == "hf_exported"]
    assert [e["step"] for e in exported] == [2]
    out = Path(exported[0]["path"])
    assert out == run / "hf" / "step_000002"
    trained = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    model = Llama3(args_of(*args_from_hf_config(json.loads((src / "config.json").read_text()))))
    model.init_weights(0)
    manager = CheckpointManager(run / "checkpoints", rank=0, world_size=1)
    manager.load(manager.latest(), model)
    with torch.no_grad():
        for p in model.parameters():  # the export is bf16 (the default)
            p.copy_(p.to(torch.bfloat16).float())
        assert not torch.equal(model.tok_embeddings.weight, hf.model.embed_tokens.weight)  # it trained
        torch.testing.assert_close(trained(inputs).logits, model(inputs), rtol=1e-5, atol=1e-5)

    # a resume continues from the checkpoint: no second import
    again = torchrun_main(isolated_env, *common, "train.steps=3")
    assert again.returncode == 0, again.stderr[-3000:]
    events = read_jsonl(run / "events.jsonl")
    assert len([e for e in events if e["event"] == "weights_imported"]) == 1
    assert [e["from_step"] for e in events if e["event"] == "resume"] == [2]
    assert [e["step"] for e in events if e["event"] == "hf_exported"] == [2, 3]
