"""Triton kernels in the CPU interpreter, from a test file that also runs in the parent pytest.

TRITON_INTERPRET=1 must be set before triton is imported (its standard library is @jit code built at import), so
interpreter cases cannot share a pytest process with tests that imported triton first: the parent starts a child
pytest with TRITON_INTERPRET=1 in its environment from the start. A file defines its cases as `_interp_*` functions
and ends with `expose_or_run(globals(), __file__, n_cases, name)`: in the child the cases become `test_interp_*`; in
the parent one test, `name`, runs the child and asserts that all n cases passed.
"""

from __future__ import annotations

import os
import subprocess
import sys

_CHILD_FLAG = "ELASTIC_FP8_INTERP_CHILD"
IN_CHILD = os.environ.get(_CHILD_FLAG) == "1"
# The oldest Triton whose interpreter runs the quantize and cross-entropy kernels (fp8/kernels): of the GPU image's
# 3.6, 3.7.1, 3.8.0 and 3.9.0, the cases of tests/test_fp8_kernels.py failed 23 of 40 under 3.6 and 16 under 3.7.1,
# none under 3.8 or 3.9 (the AdamW and guard kernels run under 3.6).
QUANTIZE_INTERPRETER_TRITON = (3, 8)


def run_child(test_file: str, n_cases: int) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", **{_CHILD_FLAG: "1"})
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interp", test_file]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=600)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert f"{n_cases} passed" in proc.stdout, tail


def installed_triton() -> tuple[int, ...]:
    """Triton's version, read without importing it (an import here would fix its mode for this process); nightly
    and ROCm builds of torch ship it as pytorch-triton(-rocm)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
        try:
            return tuple(int(part) for part in version(dist).split("+")[0].split(".")[:2])
        except PackageNotFoundError:
            continue
    return (0, 0)


def skip_if_interpreter_older_than(min_triton: tuple[int, int]) -> None:
    """Skip where the installed Triton's interpreter is older than `min_triton`: a GPU image's own Triton, whose
    kernels run compiled there and are tested by tests/test_fp8_gpu.py (the CPU machines' `make test` resolves
    Triton 3.9)."""
    import pytest

    found = installed_triton()
    if found < min_triton:
        pytest.skip(f"Triton {'.'.join(map(str, found))}'s interpreter cannot run these kernels; it needs "
                    f"{'.'.join(map(str, min_triton))} or newer")


def expose_or_run(namespace: dict, test_file: str, n_cases: int, parent_test_name: str,
                  min_triton: tuple[int, int] | None = None) -> None:
    """Child: `_interp_x` -> `test_interp_x`. Parent: one test, `parent_test_name`, that runs the child (skipped
    where the interpreter is older than `min_triton`)."""
    if IN_CHILD:
        namespace.update({"test_" + name[1:]: fn for name, fn in list(namespace.items())
                          if name.startswith("_interp_")})
    else:
        def parent_test():
            if min_triton:
                skip_if_interpreter_older_than(min_triton)
            run_child(test_file, n_cases)

        parent_test.__name__ = parent_test_name
        namespace[parent_test_name] = parent_test
