"""Seeds for weight initialisation, one per initialisation unit (the root's own weights, each transformer block).

A unit's weights depend only on (seed, unit name), not on what was initialised before it, so a model can be
initialised whole (`init_weights(seed)`) or one unit at a time on the device, shard by shard
(orchestration.training.distributed.init_weights_by_unit), with the same result - which is what lets a model too large for
one device's memory (or a host's) start from the same weights at every world size.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

ROOT_UNIT = "root"


def unit_seed(seed: int, unit: str) -> int:
    """The RNG seed of initialisation unit `unit` ("root" or "layers.<i>") for run seed `seed`."""
    digest = hashlib.sha256(f"elastic-fp8-init:{seed}:{unit}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def layer_unit(name: str) -> str:
    return f"layers.{name}"


def init_unit(model: nn.Module, unit: str, seed: int | None) -> None:
    """Initialise one unit of `model` from its own seed: ROOT_UNIT is the root's own weights (`init_root_weights`),
    "layers.<i>" that block (`init_weights`). seed=None continues the global random stream."""
    if seed is not None:
        torch.manual_seed(unit_seed(seed, unit))
    if unit == ROOT_UNIT:
        model.init_root_weights()
    else:
        model.layers[unit.removeprefix("layers.")].init_weights()


def init_model_by_units(model: nn.Module, seed: int | None) -> None:
    """The models' init_weights: the root's own weights, then each block, each unit from its own seed."""
    init_unit(model, ROOT_UNIT, seed)
    for name in model.layers:
        init_unit(model, layer_unit(name), seed)
