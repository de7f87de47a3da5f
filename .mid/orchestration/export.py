"""Export a run's checkpoint as a Hugging Face checkpoint directory (safetensors shards + index, config.json,
generation_config.json, the run's tokenizer files):

    python -m orchestration.export RUN_DIR --out DIR [--step N|latest|good] [--dtype bfloat16|float32]

--step good (the default) takes the newest checkpoint the monitors passed, latest the newest one, N that step. The
checkpoint is verified (its manifest's digests) before a tensor is read; the model comes from the run's config.yaml.
Exit 2 with one line naming what to change when the run, the checkpoint or --out is not usable; nothing is written
then. docs/interop.md lists the layouts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from orchestration.checkpoint.directory import STEP_DIR_RE, CheckpointError, CheckpointInfo, verify_checkpoint
from orchestration.config import ConfigError, JobConfig
from orchestration.interop.export_hf import DEFAULT_MAX_SHARD_BYTES, export_checkpoint
from orchestration.interop.files import GENERATION_CONFIG_FILE, TOKENIZER_FILES
from orchestration.interop.layout import LayoutError
from orchestration.observability.events import CONFIG_FILE

EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
USAGE_ERROR_EXIT = 2
SPECIAL_TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


class ExportError(ValueError):
    """The run, its checkpoint or the output cannot be used; the message says what to change."""


def run_job(run_dir: Path) -> JobConfig:
    from orchestration.validation import from_dict

    path = run_dir / CONFIG_FILE
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise ExportError(f"{path}: cannot read the run's config ({exc}); RUN_DIR must be a run directory") from None
    return from_dict(data)


def select_checkpoint(run_dir: Path, step: str) -> CheckpointInfo:
    """The verified checkpoint `step` names: "good" (newest marked good), "latest" (newest), or a step number."""
    root = run_dir / "checkpoints"
    found = sorted(((int(m[1]), p) for p in (root.iterdir() if root.is_dir() else [])
                    if (m := STEP_DIR_RE.match(p.name))), reverse=True)
    if not found:
        raise ExportError(f"{run_dir} has no checkpoints (checkpoint.every_steps=0, or not a run directory)")
    steps = [s for s, _ in found]
    if step not in ("good", "latest"):
        if not step.isdigit() or int(step) not in steps:
            raise ExportError(f"--step {step}: {run_dir} has checkpoints of steps {sorted(steps)}; pass one of them, "
                              "latest or good")
        found = [(s, p) for s, p in found if s == int(step)]
    errors = []
    for s, path in found:
        try:
            info = verify_checkpoint(path)
        except CheckpointError as exc:
            errors.append(f"step {s}: {exc}")
            continue
        if step == "good" and not info.good:
            continue
        return info
    what = "a good checkpoint (pass --step latest for the newest one)" if step == "good" else f"checkpoint {step}"
    raise ExportError(f"{run_dir} has no sound {what}" + (f"; damaged: {'; '.join(errors)}" if errors else ""))


def tokenizer_files(job: JobConfig) -> tuple[list[Path], dict[str, Any]]:
    """The run's tokenizer files (tokenizer.json and the tokenizer_config.json / special_tokens_map.json beside it)
    and the generation settings they imply (eos_token_id); none for the bytes of data=stdlib."""
    if job.data.name != "tokenized" or not job.data.path:
        return [], {}
    manifest_path = Path(job.data.path) / "manifest.json"
    try:
        tokenizer = json.loads(manifest_path.read_text(encoding="utf-8"))["tokenizer"]
    except (OSError, ValueError, KeyError) as exc:
        raise ExportError(f"{manifest_path}: cannot read the run's tokenizer ({exc}); the corpus moved?") from None
    if tokenizer.get("kind") == "bytes":
        return [], {}
    path = Path(tokenizer["path"])
    if not path.is_file():
        raise ExportError(f"the run's tokenizer {path} is missing; put it back (its sha256 is in {manifest_path})")
    files = [path] + [path.parent / name for name in TOKENIZER_FILES[1:] if (path.parent / name).is_file()]
    generation = {"eos_token_id": tokenizer["eos_id"]} if tokenizer.get("eos_id") is not None else {}
    return files, generation


def source_metadata(job: JobConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """For a run started from a Hugging Face checkpoint (model.init_from): the special token ids of its config.json
    (without them transformers falls back to its class defaults, e.g. Llama's 1 and 2) and its
    generation_config.json. Nothing when the run started from random weights or the directory is gone."""
    if not job.model.init_from:
        return {}, {}
    root = Path(job.model.init_from)
    try:
        config = json.loads((root / "config.json").read_text(encoding="utf-8"))
        generation_path = root / GENERATION_CONFIG_FILE
        generation = json.loads(generation_path.read_text(encoding="utf-8")) if generation_path.is_file() else {}
    except (OSError, ValueError):
        return {}, {}
    tokens = {key: config[key] for key in SPECIAL_TOKEN_KEYS if config.get(key) is not None}
    return tokens, generation if isinstance(generation, dict) else {}


def export_run(run_dir: str | Path, out: str | Path, step: str = "good", dtype: str = "bfloat16",
               max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, Any]:
    """Export one checkpoint of a run; ExportError (nothing written) when something is not usable."""
    from models.registry import resolve_flavor

    run_dir, out = Path(run_dir).resolve(), Path(out).resolve()
    if dtype not in EXPORT_DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(EXPORT_DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not empty; choose a new directory")
    job = run_job(run_dir)
    flavor = resolve_flavor(job.model.name, dict(job.model.overrides))
    info = select_checkpoint(run_dir, step)
    files, tokenizer_generation = tokenizer_files(job)
    special_tokens, generation = source_metadata(job)
    generation = {**generation, **tokenizer_generation}  # the run's own tokenizer wins
    try:
        report = export_checkpoint(info.path / "dcp", flavor.family, flavor.args, out, EXPORT_DTYPES[dtype],
                                   max_shard_bytes, files, generation, special_tokens)
    except LayoutError as exc:
        raise ExportError(str(exc)) from None
    return {**report, "step": info.step, "checkpoint": str(info.path), "dtype": dtype}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestration.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the run directory (holds config.yaml and checkpoints/)")
    parser.add_argument("--out", required=True, help="the directory to write; must not exist or be empty")
    parser.add_argument("--step", default="good", help="good (default: newest good checkpoint), latest, or N")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(EXPORT_DTYPES))
    parser.add_argument("--max-shard-gb", type=float, default=DEFAULT_MAX_SHARD_BYTES / 1e9,
                        help="largest safetensors shard in GB (10^9 bytes); a larger tensor gets a shard alone")
    ns = parser.parse_args(argv)
    try:
        report = export_run(ns.run_dir, ns.out, ns.step, ns.dtype, int(ns.max_shard_gb * 1e9))
    except (ExportError, ConfigError) as exc:
        print(f"export error: {exc}", file=sys.stderr, flush=True)
        return USAGE_ERROR_EXIT
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
