"""NCCL / RCCL environment presets for Ray Train workers (pure: no imports of torch or Ray, no os.environ reads).

`cluster.env_preset` names one of ENV_PRESETS; `cluster.env_vars` is merged over it by `resolve_worker_env`, and the
result goes to the workers through Ray's runtime_env (or the pod env on KubeRay). Presets hold only what is
specific to the accelerator generation; what is specific to one cloud's network (AWS EFA, GCP GPUDirect-TCPX,
an InfiniBand HCA list) belongs in the cluster preset's env_vars, because the same GPU ships on different fabrics.

Sources (reference, read 2026-12):
  [nccl-env]  NCCL environment variables, https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html
  [rocm-wl]   ROCm workload tuning for MI300X (RCCL section),
              https://rocm.docs.amd.com/en/latest/how-to/rocm-for-ai/inference-optimization/workload.html
  [rccl-tips] RCCL usage tips, https://rocm.docs.amd.com/projects/rccl/en/latest/how-to/rccl-usage-tips.html
  [rccl-7.0]  RCCL 2.26.6 release notes (ROCm 7.0), https://github.com/ROCm/rccl/releases/tag/rocm-7.0.0
  [primus]    AMD-AGI/Primus runner/helpers/envs/base_env.sh and MI350X.sh (AMD's own training launcher)
  [torch-fr]  PyTorch flight recorder, https://pytorch.org/tutorials/prototype/flight_recorder_tutorial.html
"""

from __future__ import annotations

import re

# Every GPU preset carries these. They serve elasticity rather than speed:
_ELASTIC_BASE: dict[str, str] = {
    # A failed or timed-out collective must kill the worker process, so Ray Train sees a dead worker and
    # restarts the group at the new size; a rank left blocked in a collective would hang the whole job.
    # 3 = tear the process down without aborting the communicator first (PyTorch's default since 2.2); set
    # explicitly because a site-wide 0 would silently turn a lost node into a hang.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    # Flight recorder [torch-fr]: on a collective timeout every rank dumps its last collectives, which names
    # the rank that never arrived (the preempted node). 2000 entries is torch 2.13's default buffer
    # (FlightRecorder.hpp); explicit for older builds in vendor images, where the default was 0 (off).
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    # Transport errors (a peer gone, an IB port down) reach the worker logs; INFO would flood them.
    "NCCL_DEBUG": "WARN",
}

# NVIDIA Hopper HGX nodes (8 GPUs on NVSwitch, NVLink 4). NCCL picks NVLink, NVLS and the network plugin itself;
# what is left to say is about failure handling. NCCL_NVLS_ENABLE is deliberately NOT set: NCCL already uses
# NVLink SHARP where the system supports multicast [nccl-env], and forcing it to 1 through the runtime_env would
# override an operator's NCCL_NVLS_ENABLE=0 on shared or virtualized hosts, where multicast is disabled because
# a faulty use can take the host's GPUs out of service. Users who own whole nodes can still add it in env_vars.
_NCCL_HOPPER: dict[str, str] = dict(_ELASTIC_BASE)

# AMD Instinct (RCCL reads the NCCL_* names: RCCL keeps NCCL's API and environment [rccl-tips]).
_RCCL_INSTINCT: dict[str, str] = {
    **_ELASTIC_BASE,
    # Communication kernels on high-priority streams, so FSDP all-gathers overlap compute [rocm-wl], [primus].
    "TORCH_NCCL_HIGH_PRIORITY": "1",
    # Fewer hardware queues per device keeps compute and RCCL kernels from thrashing queues [rocm-wl], [primus].
    "GPU_MAX_HW_QUEUES": "2",
    # Peer-to-peer over PCIe needs fine-grained PCIe memory [rccl-tips]; harmless on xGMI-connected OAM boards.
    "HSA_FORCE_FINE_GRAIN_PCIE": "1",
    # MSCCL paths off for stability, as AMD's Primus does [primus]; RCCL >= 7.13 removed MSCCL (a no-op there).
    "RCCL_MSCCL_ENABLE": "0",
    "RCCL_MSCCLPP_ENABLE": "0",
    # RoCE v2 GID index used by AMD clusters [primus]; NCCL reads it in RoCE mode only [nccl-env], so native
    # InfiniBand fabrics (Azure ND MI300X v5) ignore it.
    "NCCL_IB_GID_INDEX": "3",
}

ENV_PRESETS: dict[str, dict[str, str]] = {
    "none": {},
    "nccl_h100": dict(_NCCL_HOPPER),
    # Same Hopper die, NVSwitch and NVLink as H100; only HBM differs, which NCCL does not tune on.
    "nccl_h200": dict(_NCCL_HOPPER),
    "rccl_mi300x": {
        **_RCCL_INSTINCT,
        # MI300X (gfx942): 112 channels fill the 7 xGMI links of each GPU in single-node collectives [rocm-wl].
        "NCCL_MIN_NCHANNELS": "112",
    },
    "rccl_mi350x": {
        **_RCCL_INSTINCT,
        # gfx950: RCCL >= 2.26.6 already defaults to 112 channels on 8-GPU nodes [rccl-7.0], so no
        # NCCL_MIN_NCHANNELS. Its "warp speed" auto-tuning is on by default there and was seen producing NaN
        # losses [primus]; a divergence detector would then fire on a communication bug, so keep it off.
        "RCCL_WARP_SPEED_AUTO": "0",
    },
}

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def resolve_worker_env(preset: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The worker environment: the preset's variables with `extra` merged over them (extra wins).

    An empty string in `extra` removes the preset's variable instead of setting it to "", so a cluster preset can
    drop one it does not want (e.g. NCCL_IB_GID_INDEX: "") and let the node's own value, if any, through.
    Returns a new dict; ENV_PRESETS is never mutated.
    """
    if preset not in ENV_PRESETS:
        raise ValueError(f"cluster.env_preset: unknown preset '{preset}'; choose one of {sorted(ENV_PRESETS)}")
    env = dict(ENV_PRESETS[preset])
    for key, value in (extra or {}).items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise ValueError(f"cluster.env_vars: '{key}' is not a valid environment variable name "
                             "(letters, digits and '_', not starting with a digit)")
        if isinstance(value, bool) or not isinstance(value, (str, int)):
            # A config value of the wrong type is a user error: ValueError (ConfigError's base) (the config errors name the key and what to set).
            raise ValueError(  # noqa: TRY004
                f"cluster.env_vars.{key}: value must be a string (quote it in YAML, e.g. \"1\"), "
                f"got {type(value).__name__} {value!r}")
        if value == "":
            env.pop(key, None)
        else:
            env[key] = str(value)
    return env
