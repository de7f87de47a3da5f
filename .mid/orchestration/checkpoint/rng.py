"""RNG states of a rank: captured with a checkpoint, restored on a resume at the same world size, derived from
(seed, step, rank) at another (see CheckpointManager.load)."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import torch

try:  # numpy is optional for us; its RNG is saved only when it is importable
    import numpy as np
except ImportError:  # pragma: no cover - numpy ships with torch's usual environments
    np = None


def derive_rng_seed(seed: int, step: int, rank: int) -> int:
    """Seed for `rank` when resuming from `step` at a different world size (pure, stable across Python runs)."""
    digest = hashlib.sha256(f"elastic-fp8-rng:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def seed_all_rngs(seed: int) -> None:
    """Seed torch (CPU and every CUDA device), python `random` and numpy from one integer."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds all CUDA devices
    if np is not None:
        np.random.seed(seed % 2**32)


def capture_rng_state() -> dict[str, Any]:
    """RNG states of this process in types that `torch.load(weights_only=True)` accepts."""
    state: dict[str, Any] = {"torch_cpu": torch.get_rng_state(), "python": random.getstate(), "numpy": None,
                             "cuda": None}
    if np is not None:
        name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
        # ndarrays are not allowed by weights_only loading; the MT19937 key fits an int64 tensor exactly
        state["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device: one device per rank
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if state.get("numpy") is not None and np is not None:
        s = state["numpy"]
        np.random.set_state((s["name"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
