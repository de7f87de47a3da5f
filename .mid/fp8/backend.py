"""The one place that decides what FP8 hardware support a device has.

Detection is lazy (nothing is probed at import) and cached per device. Everything else in fp8/ asks
`get_backend(device)` and never looks at `torch.version.hip` or device properties itself.

Kinds:
- "cuda":  NVIDIA sm89+ (Ada, Hopper, Blackwell): OCP float8_e4m3fn (max 448) / float8_e5m2 (max 57344),
           torch._scaled_mm through cuBLASLt; torch._scaled_grouped_mm only on sm90 (Hopper) for now.
- "rocm":  AMD MI300 family (gfx940/941/942): the *fnuz* formats, float8_e4m3fnuz (max 240!) /
           float8_e5m2fnuz (max 57344). Using 448 there silently clips every value above 240 - the bug the
           AMD work fixed, so the max always comes from `torch.finfo` of the chosen dtype, never a constant.
           gfx950 (MI350/MI355) uses the OCP formats like NVIDIA. hipBLASLt backs _scaled_mm; torch routes
           _scaled_grouped_mm to Composable Kernel kernels that ship only in builds with MSLK (named FBGEMM
           GenAI in older torch), for gfx942 and gfx950 only: torch's own test gate
           (torch.testing._internal.common_cuda.evaluate_platform_supports_fp8_grouped_gemm) asks the same.
- "cpu" / anything else: emulated FP8 (real fp8 casts, matmuls on dequantized float32), same numerics.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# ROCm architectures (gcnArchName prefix) and the FP8 flavour their matrix cores implement.
_ROCM_FNUZ_ARCHS = ("gfx940", "gfx941", "gfx942")  # MI300A/MI300X/MI325X
_ROCM_OCP_ARCHS = ("gfx950",)  # MI350/MI355
_ROCM_GROUPED_ARCHS = ("gfx942", "gfx950")  # the archs torch's FP8 grouped GEMM (CK, through MSLK) is built for
_ROCM_GROUPED_BUILD_FLAGS = ("USE_MSLK", "USE_FBGEMM_GENAI")  # the library's build flag, new and old name


def rocm_build_has_fp8_grouped_gemm(build_config: str) -> bool:
    """Whether torch.__config__.show() text names the library that carries ROCm's FP8 grouped GEMM as built in.
    A flag written as =OFF / =0 is not built in (torch's gate checks only for the name: stricter here)."""
    for flag in _ROCM_GROUPED_BUILD_FLAGS:
        for match in re.finditer(rf"(?:\b|(?<=-D)){flag}(?!\w)(?:=(\w+))?", build_config):
            if match.group(1) is None or match.group(1).upper() in ("ON", "1", "TRUE", "YES"):
                return True
    return False


@dataclass(frozen=True)
class Fp8Backend:
    """What one device can do with FP8. `emulate` means: no FP8 matrix unit, use the reference path."""

    kind: str  # "cuda" | "rocm" | "cpu"
    arch: str  # "sm90", "gfx942", "cpu", ...
    e4m3: torch.dtype
    e5m2: torch.dtype
    emulate: bool
    has_scaled_mm: bool
    has_scaled_grouped_mm: bool

    @property
    def e4m3_max(self) -> float:
        return float(torch.finfo(self.e4m3).max)

    @property
    def e5m2_max(self) -> float:
        return float(torch.finfo(self.e5m2).max)

    def max_of(self, dtype: torch.dtype) -> float:
        return float(torch.finfo(dtype).max)


_CPU_BACKEND = Fp8Backend(
    kind="cpu",
    arch="cpu",
    e4m3=torch.float8_e4m3fn,
    e5m2=torch.float8_e5m2,
    emulate=True,
    has_scaled_mm=False,
    has_scaled_grouped_mm=False,
)


def _device_key(device: torch.device | str | None) -> tuple[str, int]:
    if device is None:
        device = torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return ("cuda", index)
    return (device.type, 0)


def _detect(kind: str, index: int) -> Fp8Backend:
    if kind != "cuda":
        # meta, cpu and other devices: emulated numerics (meta tensors only need the dtypes).
        return _CPU_BACKEND
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        arch = str(getattr(props, "gcnArchName", "")).split(":")[0]
        grouped = arch.startswith(_ROCM_GROUPED_ARCHS) and rocm_build_has_fp8_grouped_gemm(torch.__config__.show())
        if arch.startswith(_ROCM_FNUZ_ARCHS):
            return Fp8Backend("rocm", arch, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, False, True, grouped)
        if arch.startswith(_ROCM_OCP_ARCHS):
            return Fp8Backend("rocm", arch, torch.float8_e4m3fn, torch.float8_e5m2, False, True, grouped)
        # Older Instinct/Radeon parts have no FP8 matrix cores: emulate with OCP dtypes.
        return Fp8Backend("rocm", arch or "gfx?", torch.float8_e4m3fn, torch.float8_e5m2, True, False, False)
    cc = (int(props.major), int(props.minor))
    arch = f"sm{cc[0]}{cc[1]}"
    if cc < (8, 9):
        return Fp8Backend("cuda", arch, torch.float8_e4m3fn, torch.float8_e5m2, True, False, False)
    # torch's FP8 grouped GEMM (CUTLASS) is built for sm90 only; sm100 uses MXFP8 there, so emulate grouped.
    return Fp8Backend("cuda", arch, torch.float8_e4m3fn, torch.float8_e5m2, False, True, cc[0] == 9)


# A plain dict, not functools.lru_cache: torch.compile reads a dict with guards, but warns on and re-traces
# lru_cache wrappers.
_CACHE: dict[tuple[str, int], Fp8Backend] = {}


def get_backend(device: torch.device | str | None = None) -> Fp8Backend:
    """FP8 capabilities of `device` (detected on first use, then cached)."""
    key = _device_key(device)
    backend = _CACHE.get(key)
    if backend is None:
        backend = _detect(*key)
        _CACHE[key] = backend
    return backend


def clear_backend_cache() -> None:
    """For tests that mock device properties."""
    _CACHE.clear()


def fp8_dtypes(device: torch.device | str | None = None) -> tuple[torch.dtype, torch.dtype]:
    """(e4m3, e5m2) dtypes of `device`: the fnuz pair on MI300/gfx942, the OCP pair elsewhere."""
    b = get_backend(device)
    return b.e4m3, b.e5m2


def recommended_recipe(device: torch.device | str | None = None) -> str:
    """The recipe `precision=fp8` means on this device.

    NVIDIA: tensorwise (the fastest in torchao's and torchtitan's published runs). ROCm: rowwise_gw_hp
    (the seed's MI300X recipe; high-precision weight gradients, rowwise scales tolerate outliers).
    CPU: tensorwise, the cheapest emulation for correctness runs.
    """
    b = get_backend(device)
    if b.kind == "rocm":
        return "rowwise_gw_hp"
    return "tensorwise"
