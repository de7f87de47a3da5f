"""Hugging Face import and export on CPU: time and peak host memory (RSS) at Llama3-8B width with a few layers.

    python -m benchmarks.hf_interop [--layers 4] [--workdir /tmp/hf_interop] [--out benchmarks/results/hf_interop_cpu.json]
    python -m benchmarks.hf_interop --gpu-check --layers 1 --out benchmarks/results/hf_interop_gpu.json   # one GPU

1. A Llama 3.1 8B-shaped checkpoint (bf16, --layers layers, random weights) is written as Hugging Face safetensors
   shards of at most 5 GB.
2. import, in a fresh process: our model materialized on the CPU in fp32 (to_empty, as a worker's), then
   orchestration.interop.import_hf.import_weights; then the model saved as a DCP checkpoint (model only).
3. export, in a fresh process: orchestration.interop.export_hf.export_checkpoint of that checkpoint to bf16 shards.
Each step's peak RSS is the process's high-water mark (getrusage) read right after it, next to the RSS before it
and the bytes the step must hold anyway (the fp32 model for the import). The source and the export are compared
tensor by tensor (the round trip is exact).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
}


def rss_peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def rss_now_gib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**30


def family_args(src: Path):
    from orchestration.interop.layout import args_from_hf_config, args_of

    family, fields = args_from_hf_config(json.loads((src / "config.json").read_text()))
    return family, args_of(family, fields)


def write_source(src: Path, layers: int) -> dict:
    from orchestration.interop.files import write_json, write_shards
    from orchestration.interop.import_hf import meta_shapes
    from orchestration.interop.layout import hf_shapes, tensor_maps

    src.mkdir(parents=True)
    write_json(src / "config.json", {**LLAMA_31_8B, "num_hidden_layers": layers})
    family, args = family_args(src)
    shapes = meta_shapes(family, args)
    entries = [(name, shape, torch.bfloat16) for tmap in tensor_maps(family, args)
               for name, shape in zip(tmap.hf, hf_shapes(tmap, shapes[tmap.ours]), strict=True)]
    gen = torch.Generator().manual_seed(0)
    tensors = ((name, (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)) for name, shape, _ in entries)
    weight_map = write_shards(src, entries, tensors, 5 * 10**9)
    total = sum(torch.Size(shape).numel() * 2 for _, shape, _ in entries)
    write_json(src / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    return {"source_bytes": total, "source_shards": len(set(weight_map.values())), "tensors": len(entries)}


def step_import(src: Path, dcp_dir: Path) -> dict:
    import torch.distributed.checkpoint as dcp

    from models.llama3 import Llama3
    from orchestration.interop.import_hf import import_weights

    family, args = family_args(src)
    with torch.device("meta"):
        model = Llama3(args)
    model.to_empty(device="cpu")
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rss_before = rss_now_gib()
    t0 = time.perf_counter()
    report = import_weights(model, src, family, args)
    seconds = time.perf_counter() - t0
    peak = rss_peak_gib()
    t1 = time.perf_counter()
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(str(dcp_dir)))
    return {"import_s": round(seconds, 2), "import_peak_rss_gib": round(peak, 2),
            "rss_before_import_gib": round(rss_before, 2), "model_fp32_gib": round(model_bytes / 2**30, 2),
            "import_rss_over_model_gib": round(peak - model_bytes / 2**30, 2), "bytes_read": report["bytes_read"],
            "dcp_save_s": round(time.perf_counter() - t1, 2)}


def step_export(src: Path, dcp_dir: Path, out: Path) -> dict:
    from orchestration.interop.export_hf import export_checkpoint

    family, args = family_args(src)
    rss_before = rss_now_gib()
    t0 = time.perf_counter()
    report = export_checkpoint(dcp_dir, family, args, out, torch.bfloat16)
    seconds = time.perf_counter() - t0
    largest = max(p.numel() for p in _meta_params(family, args))
    return {"export_s": round(seconds, 2), "export_peak_rss_gib": round(rss_peak_gib(), 2),
            "rss_before_export_gib": round(rss_before, 2), "export_bytes": report["bytes"],
            "export_shards": report["shards"], "largest_parameter_fp32_gib": round(largest * 4 / 2**30, 2)}


def _meta_params(family, args):
    from models.llama3 import Llama3

    with torch.device("meta"):
        return list(Llama3(args).parameters())


def compare(src: Path, out: Path) -> dict:
    from safetensors import safe_open

    def handles(root):
        index = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
        return index, {f: safe_open(str(root / f), "pt") for f in set(index.values())}

    a_map, a = handles(src)
    b_map, b = handles(out)
    assert sorted(a_map) == sorted(b_map)
    for name in a_map:
        assert torch.equal(a[a_map[name]].get_tensor(name), b[b_map[name]].get_tensor(name)), name
    return {"round_trip_exact": True, "compared_tensors": len(a_map)}


def gpu_check(work: Path, layers: int) -> dict:
    """On one GPU: a run of the product (the torchrun entry, FP8) started from an 8B-width source and exported at its
    end, the export loaded by transformers on the GPU, its logits against our model on the run's last checkpoint
    (both bf16 weights, bf16 compute: the figure is their difference, not a pass/fail)."""
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from models.llama3 import Llama3
    from orchestration.checkpoint.manager import CheckpointManager

    src, runs = work / "source", work / "runs"
    results = {"layers": layers, **write_source(src, layers)}
    steps = 4
    cmd = [sys.executable, "-m", "orchestration.driver.torchrun", f"run_root={runs}", "run_name=gpu",
           "model=from_hf", f"model.init_from={src}", "cluster.device=cuda", "precision=fp8", f"train.steps={steps}",
           "train.warmup_steps=1", "data.seq_len=512", "train.global_batch_size=4", "train.micro_batch_size=4",
           "train.eval_every=0", "checkpoint.every_steps=2", "checkpoint.export_hf=final", "logging.wandb=false",
           # a save of fp32 weights and AdamW is 12 bytes a parameter (15 GB at one layer): keep one on the 64 GB disk
           "checkpoint.keep_last=1", "checkpoint.keep_good=1"]
    t0 = time.time()
    subprocess.run(cmd, cwd=REPO, check=True)
    results["run_s"] = round(time.time() - t0, 1)
    events = [json.loads(line) for line in (runs / "gpu" / "events.jsonl").read_text().splitlines() if line]
    imported = next(e for e in events if e["event"] == "weights_imported")
    exported = next(e for e in events if e["event"] == "hf_exported")
    results |= {"import_s": imported["seconds"], "export_s": exported["seconds"], "export": exported["path"]}
    tokens = torch.randint(0, LLAMA_31_8B["vocab_size"], (2, 256), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1].cuda(), tokens[:, 1:].cuda()
    t0 = time.time()
    hf = AutoModelForCausalLM.from_pretrained(exported["path"], dtype=torch.bfloat16).cuda().eval()
    results["transformers_load_s"] = round(time.time() - t0, 1)
    _, args = family_args(src)
    with torch.device("meta"):
        ours = Llama3(args)
    ours.to_empty(device="cuda")
    ours.init_root_weights()  # the RoPE tables; every weight comes from the checkpoint
    manager = CheckpointManager(runs / "gpu" / "checkpoints", rank=0, world_size=1)
    manager.load(manager.latest(), ours)
    ours = ours.to(torch.bfloat16).eval()
    with torch.no_grad():
        a, b = hf(inputs).logits.float(), ours(inputs).float()
        results |= {"gpu": torch.cuda.get_device_name(),
                    "transformers_loss": round(F.cross_entropy(a.flatten(0, 1), targets.flatten()).item(), 5),
                    "our_loss": round(F.cross_entropy(b.flatten(0, 1), targets.flatten()).item(), 5),
                    "max_abs_logit_diff": round((a - b).abs().max().item(), 5),
                    "logit_scale": round(a.abs().max().item(), 3)}
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--workdir", default="/tmp/hf_interop_bench")
    parser.add_argument("--out", default=str(REPO / "benchmarks/results/hf_interop_cpu.json"))
    parser.add_argument("--step", choices=["import", "export"], help=argparse.SUPPRESS)  # the child processes
    parser.add_argument("--gpu-check", action="store_true",
                        help="one GPU: a run from an imported checkpoint, its export loaded by transformers")
    ns = parser.parse_args()
    work = Path(ns.workdir)
    if ns.gpu_check:
        shutil.rmtree(work, ignore_errors=True)
        t0 = time.time()
        results = gpu_check(work, ns.layers)
        print(json.dumps(results, indent=1), flush=True)
        from benchmarks.common import write_result

        command = "python -m benchmarks.hf_interop " + " ".join(sys.argv[1:])
        write_result(ns.out, benchmark=Path(ns.out).stem, suite="hf_interop", command=command.strip(),
                     suite_command=command.strip(), returncode=0, wall_s=time.time() - t0, results=results)
        return
    src, dcp_dir, out = work / "source", work / "dcp", work / "export"
    if ns.step:
        torch.set_num_threads(2)
        result = step_import(src, dcp_dir) if ns.step == "import" else step_export(src, dcp_dir, out)
        print("RESULT " + json.dumps(result), flush=True)
        return
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.time()
    results = {"layers": ns.layers, "width": "Llama 3.1 8B", "threads": 2, **write_source(src, ns.layers)}
    for step in ("import", "export"):
        proc = subprocess.run([sys.executable, "-m", "benchmarks.hf_interop", "--step", step, "--workdir", str(work)],
                              capture_output=True, text=True, cwd=REPO, check=True)
        results |= json.loads(proc.stdout.split("RESULT ", 1)[1])
    results |= compare(src, out)
    print(json.dumps(results, indent=1), flush=True)
    from benchmarks.common import write_result

    command = "python -m benchmarks.hf_interop " + " ".join(sys.argv[1:])
    write_result(ns.out, benchmark="hf_interop_cpu", suite="hf_interop", command=command.strip(),
                 suite_command=command.strip(), returncode=0, wall_s=time.time() - t0, results=results)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
