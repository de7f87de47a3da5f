"""The dispatch layer (fp8/quant.py) feeds fp8/kernels the right shapes and reads back the right layouts.

On CPU the kernels package answers with the PyTorch reference, so routing every cast through it must reproduce
the results of the direct reference calls bit for bit (Float8Linear per recipe, grouped GEMM incl. the 3D
expert-weight casts that the dispatch reshapes to 2D).
"""

import pytest
import torch

from fp8 import RECIPES, Float8Linear, Fp8GroupedMM, kernels, quant


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
    monkeypatch.setattr(quant, "_kernel_fn", lambda x, name: getattr(kernels, name))
    got = run()
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_kernel_failure_falls_back_to_reference(monkeypatch):
    ref = linear_run("rowwise")

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setattr(quant, "_kernel_fn", lambda x, name: None if name in quant._FAILED else broken)
    monkeypatch.setattr(quant, "_FAILED", set())
    with pytest.warns(UserWarning, match="using the PyTorch reference"):
        got = linear_run("rowwise")
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_stored_enk_backward_weight_cast_reads_the_storage_in_place(monkeypatch):
    """The grad-input recast of an [E, N, K]-stored weight goes through the batched kernel on the storage itself (no
    transposed bf16 copy), and gives the same result as the references."""
    calls = []

    def spy(name):
        fn = getattr(kernels, name)

        def wrapped(x, *args, **kwargs):
            calls.append((name, x.is_contiguous()))
            return fn(x, *args, **kwargs)

        return wrapped

    ref = grouped_run(stored_enk=True)
    monkeypatch.setattr(quant, "_kernel_fn", lambda x, name: spy(name))
    got = grouped_run(stored_enk=True)
    assert ("cast_rows_transposed_batched", True) in calls  # the [E, N, K] storage, contiguous as stored
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
        "print('ok', fp8.quant.kernels_active('cpu'))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr[-3000:]
