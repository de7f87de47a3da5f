"""The dispatch (fp8/quant.py) feeds the kernels the right shapes and reads back the right layouts.

With the policy made to pick a "kernel" for every cast whose body is the cast's reference (fp8.quant.CASTS; on CPU,
with the kernels' arguments), every cast takes the kernel branch of the dispatch - flattening, copies, reshapes of the
results - and must reproduce the results of the reference branch bit for bit (Float8Linear per recipe, grouped GEMM
incl. the 3D expert-weight casts that the dispatch reshapes to 2D).
"""

import pytest
import torch

from fp8 import RECIPES, Float8Linear, Fp8GroupedMM, quant


def linear_run(recipe):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48, bias=False, dtype=torch.bfloat16)
    mod = Float8Linear.from_float(lin, recipe)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    x[:2] = 0
    x = x.requires_grad_()
    y = mod(x)
    y.backward(torch.randn_like(y))
    return y, x.grad, lin.weight.grad


def grouped_run(stored_enk: bool):
    """stored_enk: the models' layout, an [E, N, K] parameter used through its strided [E, K, N] view."""
    torch.manual_seed(1)
    x = torch.randn(64, 32, dtype=torch.bfloat16).requires_grad_()
    param = torch.randn(3, 48, 32, dtype=torch.bfloat16) if stored_enk else torch.randn(3, 32, 48, dtype=torch.bfloat16)
    param.requires_grad_()
    w = param.transpose(-2, -1) if stored_enk else param
    offs = torch.tensor([16, 16, 64], dtype=torch.int32)
    out = Fp8GroupedMM(emulate=True)(x, w, offs)
    out.backward(torch.randn_like(out))
    return out, x.grad, param.grad


GROUPED_CASES = [f"grouped:{layout}" for layout in ("ekn", "enk")]


@pytest.mark.parametrize("case", [*RECIPES, *GROUPED_CASES])
def test_kernel_dispatch_matches_references(monkeypatch, case):
    if case.startswith("grouped"):
        _, layout = case.split(":")

        def run():
            return grouped_run(stored_enk=layout == "enk")
    else:

        def run():
            return linear_run(case)
    ref = run()
    monkeypatch.setattr(quant, "_kernel_for", lambda cast, x, use_triton: cast.reference)
    got = run()
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_kernel_failure_falls_back_to_reference(monkeypatch):
    ref = linear_run("rowwise")

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(quant, "_kernel_for", lambda cast, x, use_triton: None if cast.name in quant._FAILED else broken)
    monkeypatch.setattr(quant, "_FAILED", set())
    with pytest.warns(UserWarning, match="using the PyTorch reference"):
        got = linear_run("rowwise")
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def _recording_references(calls: list):
    """A stand-in for quant._kernel_for that runs every cast's reference and records (name, shape, dtype, contiguous)
    of its input."""
    def kernel_for(cast, x, use_triton):
        def wrapped(x, *args, **kwargs):
            calls.append((cast.name, tuple(x.shape), x.dtype, x.is_contiguous()))
            return cast.reference(x, *args, **kwargs)

        return wrapped

    return kernel_for


def test_stored_enk_backward_weight_cast_reads_the_storage_in_place(monkeypatch):
    """A weight in the tokens' dtype (FSDP2's bf16 gather): the grad-input recast of an [E, N, K]-stored weight goes
    through the batched kernel on the storage itself (no transposed bf16 copy), and gives the references' results."""
    calls = []
    spy = _recording_references(calls)
    ref = grouped_run(stored_enk=True)
    monkeypatch.setattr(quant, "_kernel_for", spy)
    got = grouped_run(stored_enk=True)
    assert ("cast_rows_transposed_batched", (3, 48, 32), torch.bfloat16, True) in calls  # the storage, as stored
    assert not any(c[0] == "transpose" for c in calls)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_float32_expert_weight_is_cast_once_and_its_fp8_bytes_transposed(monkeypatch):
    """Float32 master weights under bf16 autocast: the forward's row cast reads the float32 storage itself, and the
    grad-input operand is that fp8 weight transposed as bytes (no bf16 copy, no second cast of the weight)."""
    calls = []
    spy = _recording_references(calls)
    def run():
        torch.manual_seed(1)
        x = torch.randn(64, 32).requires_grad_()
        param = torch.randn(3, 48, 32).requires_grad_()
        offs = torch.tensor([16, 16, 64], dtype=torch.int32)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = Fp8GroupedMM(emulate=True)(x, param.transpose(-2, -1), offs)
        out.backward(torch.randn_like(out))
        return out, x.grad, param.grad

    ref = run()
    monkeypatch.setattr(quant, "_kernel_for", spy)
    got = run()
    assert ("quantize_rowwise", (3 * 48, 32), torch.float32, True) in calls  # the float32 storage's rows
    assert ("transpose", (3, 48, 32), torch.float8_e4m3fn, True) in calls  # the fp8 weight, [E, N, K] -> [E, K, N]
    assert sum(c[1] == (3 * 48, 32) for c in calls) == 1  # the weight is cast once
    assert not any(c[0] == "cast_rows_transposed_batched" for c in calls)
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_fp8_layers_work_when_the_kernels_package_cannot_import():
    """fp8.quant absorbs a broken fp8.kernels import (no Triton, a bad install) by using the references: the health
    statistics of every forward must not need that package either."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['fp8.kernels.ops'] = None\n"  # any import of fp8.kernels now fails
        "import torch, fp8\n"
        "lin = fp8.Float8Linear.from_float(torch.nn.Linear(32, 16), 'rowwise')\n"
        "y = lin(torch.randn(8, 32)); y.sum().backward()\n"
        "assert lin.fp8_health_valid and torch.isfinite(lin.fp8_health_stats).all()\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr[-3000:]


def test_cpu_tensors_take_the_reference_without_looking_up_the_kernels(monkeypatch):
    """On CPU (no TRITON_INTERPRET) the policy never reaches a kernel: launchers that would raise are not called,
    no warning, no cast retired, the results are the references'."""
    import fp8.kernels
    from fp8 import reference

    def broken(*args, **kwargs):
        raise AssertionError("a Triton launcher ran on a CPU tensor")

    for name in quant.CASTS:
        monkeypatch.setattr(fp8.kernels, f"{name}_triton", broken)
    monkeypatch.setattr(quant, "_FAILED", set())
    x = torch.randn(16, 24)
    e4m3 = torch.float8_e4m3fn
    for got, want in ((quant.quantize_rowwise(x, e4m3), reference.quantize_rowwise_ref(x, e4m3)),
                      (quant.quantize_tensorwise(x, e4m3), reference.quantize_tensorwise_ref(x, e4m3)),
                      (quant.quantize_rowwise_and_colwise(x, e4m3), reference.quantize_rowwise_and_colwise_ref(x, e4m3)),
                      ((quant.transpose(x),), (x.t().contiguous(),))):
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a.float(), b.float())
    assert quant._FAILED == set()
