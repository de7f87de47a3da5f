"""Backend detection with mocked device properties (CUDA, ROCm MI300/MI350, CPU) and the fnuz range."""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import fp8
from fp8 import backend as be
from fp8.reference import amax_to_scale, quantize_tensorwise_ref


@pytest.fixture
def mock_device(monkeypatch):
    """Pretend cuda:0 is a given GPU; returns a setter(hip, **props)."""

    def set_device(hip: str | None, build_config: str = "", **props):
        be.clear_backend_cache()
        monkeypatch.setattr(torch.version, "hip", hip)
        monkeypatch.setattr(torch.__config__, "show", lambda: build_config)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(**props))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    yield set_device
    be.clear_backend_cache()


@pytest.mark.parametrize(
    "cc, emulate, grouped",
    [((9, 0), False, True), ((8, 9), False, False), ((10, 0), False, False), ((8, 0), True, False)],
)
def test_cuda_capabilities(mock_device, cc, emulate, grouped):
    mock_device(None, major=cc[0], minor=cc[1], name="gpu")
    b = be.get_backend("cuda:0")
    assert (b.kind, b.emulate, b.has_scaled_grouped_mm) == ("cuda", emulate, grouped)
    assert fp8.fp8_dtypes("cuda:0") == (torch.float8_e4m3fn, torch.float8_e5m2)
    assert b.e4m3_max == 448.0
    assert fp8.recommended_recipe("cuda:0") == "tensorwise"


def test_rocm_mi300_uses_fnuz_with_max_240(mock_device):
    mock_device("6.4", "USE_ROCM=ON, USE_MSLK=ON", gcnArchName="gfx942:sramecc+:xnack-", major=9, minor=4)
    b = be.get_backend("cuda:0")
    assert (b.kind, b.arch, b.emulate, b.has_scaled_grouped_mm) == ("rocm", "gfx942", False, True)
    assert fp8.fp8_dtypes("cuda:0") == (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
    assert b.e4m3_max == 240.0 and b.e5m2_max == 57344.0
    assert fp8.recommended_recipe("cuda:0") == "rowwise_gw_hp"


def test_rocm_mi350_uses_ocp(mock_device):
    mock_device("7.0", "USE_FBGEMM_GENAI=1", gcnArchName="gfx950", major=9, minor=5)
    b = be.get_backend("cuda:0")
    assert (b.kind, b.e4m3, b.emulate, b.has_scaled_grouped_mm) == ("rocm", torch.float8_e4m3fn, False, True)


@pytest.mark.parametrize("arch, build_config, grouped", [
    ("gfx942:sramecc+:xnack-", "USE_ROCM=ON, USE_MSLK=OFF", False),  # FP8 GEMMs yes, grouped kernels not built
    ("gfx942", "", False),
    ("gfx942", "CXX_FLAGS= -DUSE_MSLK -O2", True),
    ("gfx940", "USE_MSLK=ON", False),  # torch builds the grouped kernels for gfx942 and gfx950 only
    ("gfx950", "USE_MSLKX=ON", False),  # another flag that merely starts with the name
])
def test_rocm_fp8_grouped_gemm_needs_the_arch_and_the_build(mock_device, arch, build_config, grouped):
    """torch._scaled_grouped_mm on ROCm exists only in builds with MSLK (FBGEMM GenAI before) and on gfx942/gfx950;
    elsewhere the experts would fall to the float32 emulation, which the worker refuses on a GPU."""
    mock_device("6.4", build_config, gcnArchName=arch, major=9, minor=4)
    b = be.get_backend("cuda:0")
    assert not b.emulate and b.has_scaled_mm
    assert b.has_scaled_grouped_mm is grouped


def test_rocm_without_fp8_units_emulates(mock_device):
    mock_device("6.0", gcnArchName="gfx90a", major=9, minor=0)
    assert be.get_backend("cuda:0").emulate


def test_cpu_and_meta_emulate():
    for dev in ("cpu", "meta", None):
        b = be.get_backend(dev)
        assert b.kind == "cpu" and b.emulate and b.e4m3 == torch.float8_e4m3fn


def test_fnuz_scale_uses_240_not_448():
    """Scaling for 448 and casting to e4m3fnuz clips everything above 240: the bug the AMD work fixed."""
    x = torch.linspace(-3.0, 3.0, 1001)
    x_fp8, scale = quantize_tensorwise_ref(x, torch.float8_e4m3fnuz)
    assert scale.item() == pytest.approx(240.0 / 3.0)
    deq = x_fp8.float() / scale
    assert deq.abs().max().item() == pytest.approx(3.0, rel=1e-6)
    assert (deq - x).abs().max().item() < 3.0 / 16  # within one e4m3 step of the largest binade
    # The wrong constant saturates: the top ~46% of the range collapses onto +-240.
    wrong = (x * amax_to_scale(torch.tensor(3.0), torch.float8_e4m3fn, False)).clamp(-240, 240).to(torch.float8_e4m3fnuz)
    assert (wrong.float().abs() == 240).float().mean().item() > 0.4


def test_detection_is_lazy():
    """Importing fp8 must not initialise CUDA or probe devices."""
    code = "import torch, fp8; import fp8.backend as b; assert not b._CACHE; assert not torch.cuda.is_initialized()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
