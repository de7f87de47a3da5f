"""NCCL/RCCL environment presets: contents that matter, merge rules, vendor checks. Pure Python, no torch."""

from __future__ import annotations

import re

import pytest

from orchestration.config import PRESET_DEVICE
from orchestration.driver.env_presets import ENV_PRESETS, resolve_worker_env
from orchestration.validation import check_preset_device

AMD_ONLY_PREFIXES = ("HSA_", "RCCL_", "GPU_MAX_HW_QUEUES", "HIP_")
GPU_PRESETS = [name for name in ENV_PRESETS if name != "none"]


def test_preset_names_match_the_config_schema():
    # conf validation (orchestration/config.py) and this module must agree on the names a user may pick.
    from orchestration.config import ENV_PRESET_NAMES

    assert set(ENV_PRESETS) == set(ENV_PRESET_NAMES)
    assert set(PRESET_DEVICE) == set(ENV_PRESETS)
    assert ENV_PRESETS["none"] == {}


@pytest.mark.parametrize("name", list(ENV_PRESETS))
def test_presets_are_string_env_vars(name):
    for key, value in ENV_PRESETS[name].items():
        assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), key
        assert isinstance(value, str) and value != "", (key, value)


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_presets_turn_a_lost_peer_into_a_dead_worker(name):
    env = ENV_PRESETS[name]
    # 1 (abort + tear down) or 3 (tear down): both kill the process so Ray Train restarts the group.
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] in ("1", "3")
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0 and env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"


@pytest.mark.parametrize("name", list(ENV_PRESETS))
def test_no_preset_forces_nvlink_multicast_on(name):
    # Forcing NVLS through the runtime_env would override an operator's NCCL_NVLS_ENABLE=0 on shared hosts.
    assert ENV_PRESETS[name].get("NCCL_NVLS_ENABLE", "0") == "0"


@pytest.mark.parametrize("name", ["nccl_h100", "nccl_h200"])
def test_nvidia_presets_carry_no_rocm_variables(name):
    leaked = [k for k in ENV_PRESETS[name] if k.startswith(AMD_ONLY_PREFIXES)]
    assert leaked == []
    assert "NCCL_MIN_NCHANNELS" not in ENV_PRESETS[name]  # NCCL sizes channels itself on NVSwitch systems


def test_mi300x_preset_has_the_amd_recommended_values():
    env = ENV_PRESETS["rccl_mi300x"]
    expected = {
        "NCCL_MIN_NCHANNELS": "112",
        "TORCH_NCCL_HIGH_PRIORITY": "1",
        "GPU_MAX_HW_QUEUES": "2",
        "HSA_FORCE_FINE_GRAIN_PCIE": "1",
        "RCCL_MSCCL_ENABLE": "0",
        "NCCL_IB_GID_INDEX": "3",
    }
    assert {k: env.get(k) for k in expected} == expected


def test_mi350x_preset_differs_from_mi300x_where_rccl_changed():
    mi300x, mi350x = ENV_PRESETS["rccl_mi300x"], ENV_PRESETS["rccl_mi350x"]
    # RCCL >= 2.26.6 defaults to 112 channels on 8x gfx950: not forced there.
    assert "NCCL_MIN_NCHANNELS" not in mi350x
    assert mi350x["RCCL_WARP_SPEED_AUTO"] == "0"
    shared = set(mi300x) & set(mi350x)
    assert {k: mi300x[k] for k in shared} == {k: mi350x[k] for k in shared}
    assert set(mi300x) ^ set(mi350x) == {"NCCL_MIN_NCHANNELS", "RCCL_WARP_SPEED_AUTO"}


def test_resolve_merges_extra_over_the_preset():
    env = resolve_worker_env("rccl_mi300x", {"NCCL_MIN_NCHANNELS": "64", "NCCL_SOCKET_IFNAME": "eth0"})
    assert env["NCCL_MIN_NCHANNELS"] == "64"
    assert env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["GPU_MAX_HW_QUEUES"] == "2"
    assert len(env) == len(ENV_PRESETS["rccl_mi300x"]) + 1


def test_resolve_empty_string_removes_a_preset_variable():
    env = resolve_worker_env("rccl_mi300x", {"NCCL_IB_GID_INDEX": "", "NOT_IN_PRESET": ""})
    assert "NCCL_IB_GID_INDEX" not in env and "NOT_IN_PRESET" not in env
    assert len(env) == len(ENV_PRESETS["rccl_mi300x"]) - 1


def test_resolve_returns_a_copy_and_never_mutates_the_presets():
    before = dict(ENV_PRESETS["nccl_h200"])
    env = resolve_worker_env("nccl_h200", {"NCCL_DEBUG": "INFO"})
    env["EXTRA"] = "1"
    assert ENV_PRESETS["nccl_h200"] == before
    assert resolve_worker_env("none") == {} and resolve_worker_env("none", None) == {}


def test_resolve_coerces_ints_and_rejects_bad_input():
    assert resolve_worker_env("none", {"NCCL_NCHANNELS_PER_NET_PEER": 4}) == {"NCCL_NCHANNELS_PER_NET_PEER": "4"}
    with pytest.raises(ValueError, match="unknown preset 'rccl_mi250'.*nccl_h100"):
        resolve_worker_env("rccl_mi250", {})
    with pytest.raises(ValueError, match="not a valid environment variable name"):
        resolve_worker_env("none", {"1BAD": "x"})
    with pytest.raises(ValueError, match="not a valid environment variable name"):
        resolve_worker_env("none", {"WITH SPACE": "x"})
    with pytest.raises(ValueError, match=r"cluster.env_vars.FLAG: value must be a string"):
        resolve_worker_env("none", {"FLAG": True})
    with pytest.raises(ValueError, match="value must be a string"):
        resolve_worker_env("none", {"X": 1.5})


def test_check_preset_device_rejects_the_other_vendor():
    check_preset_device("nccl_h100", "cuda")
    check_preset_device("rccl_mi300x", "rocm")
    for preset in ENV_PRESETS:  # auto and cpu never conflict: the device is decided later, or has no collectives
        check_preset_device(preset, "auto")
        check_preset_device(preset, "cpu")
    with pytest.raises(ValueError, match=r"env_preset=rccl_mi300x is for rocm.*cluster.device=cuda.*nccl_h100"):
        check_preset_device("rccl_mi300x", "cuda")
    with pytest.raises(ValueError, match="env_preset=nccl_h200 is for cuda"):
        check_preset_device("nccl_h200", "rocm")
    with pytest.raises(ValueError, match="unknown preset"):
        check_preset_device("bogus", "cuda")
