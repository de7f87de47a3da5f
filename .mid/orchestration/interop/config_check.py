"""The job settings that name a Hugging Face checkpoint, checked when the config is loaded (before Ray starts):
model=from_hf resolved to a preset of the family with config.json's architecture, model.init_from checked against
the model (config.json's fields, every tensor's name, shape and dtype, the files complete), checkpoint.export_hf
against the model's layout. Reads headers only."""

from __future__ import annotations

import os
from typing import Any

from orchestration.config import ConfigError, JobConfig
from orchestration.interop.files import open_checkpoint
from orchestration.interop.import_hf import ArchitectureMismatch, check_checkpoint
from orchestration.interop.layout import BASE_FLAVOR, LayoutError, args_from_hf_config, exportable

FROM_HF = "from_hf"
# Compared attributes that are derived properties: the argument that sets them.
OVERRIDE_OF = {"kv_heads": "n_kv_heads", "hidden_dim": "ffn_hidden_dim"}
FIX_FILES = ("point model.init_from at a complete Hugging Face checkpoint directory of a supported layout "
             "(docs/interop.md)")


def _absolute(path: str) -> str:
    # Workers run in another working directory (Ray's session directory): the path they get must be absolute.
    return os.path.abspath(os.path.expanduser(path))


def resolve_from_hf(job: JobConfig) -> None:
    """model=from_hf: the family's preset (layout.BASE_FLAVOR) with every architecture field of config.json as a
    model override (overrides given by the user win, and are then checked like a preset's). Idempotent."""
    if job.model.name != FROM_HF:
        return
    if not job.model.init_from:
        raise ConfigError("model.init_from: model=from_hf takes the architecture from a Hugging Face checkpoint - "
                          "set model.init_from=DIR (the directory holding config.json)")
    root = _absolute(job.model.init_from)
    try:
        family, fields = args_from_hf_config(open_checkpoint(root).config)
    except LayoutError as exc:
        raise ConfigError(f"model.init_from: {exc} - {FIX_FILES}") from None
    job.model.name = BASE_FLAVOR[family]
    job.model.overrides = {**fields, **dict(job.model.overrides)}
    job.model.init_from = root


def check_hf_settings(job: JobConfig) -> None:
    """model.init_from and checkpoint.export_hf against the model; ConfigError naming the key, the file, tensor or
    field, and what to change."""
    from models.registry import resolve_flavor

    if not job.model.init_from and job.checkpoint.export_hf == "none":
        return
    try:
        flavor = resolve_flavor(job.model.name, dict(job.model.overrides))
    except ValueError as exc:
        raise ConfigError(f"model.overrides: {exc}") from None
    if job.checkpoint.export_hf != "none":
        if job.checkpoint.every_steps == 0:
            raise ConfigError("checkpoint.export_hf: final exports the run's last checkpoint, but "
                              "checkpoint.every_steps=0 writes none - set checkpoint.every_steps > 0 or "
                              "checkpoint.export_hf=none")
        try:
            exportable(flavor.family, flavor.args)
        except LayoutError as exc:
            raise ConfigError(f"checkpoint.export_hf: {exc} - set checkpoint.export_hf=none") from None
    if not job.model.init_from:
        return
    job.model.init_from = _absolute(job.model.init_from)
    try:
        check_checkpoint(job.model.init_from, flavor.family, flavor.args)
    except ArchitectureMismatch as exc:
        raise ConfigError(f"model.init_from: {exc} (model {job.model.name}) - use model=from_hf to take the "
                          f"architecture of config.json, or set model.overrides.{OVERRIDE_OF.get(exc.attr, exc.attr)}="
                          f"{_yaml(exc.theirs)}") \
            from None
    except LayoutError as exc:
        raise ConfigError(f"model.init_from: {exc} - {FIX_FILES}") from None


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
