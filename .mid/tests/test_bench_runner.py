"""benchmarks/run_suite.py: the suite table, the result file it writes, and one real (CPU) benchmark run through it."""

import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import run_suite
from benchmarks.common import RESULT_KEYS, write_result
from tests.interp_child import QUANTIZE_INTERPRETER_TRITON, skip_if_interpreter_older_than

REPO = Path(__file__).resolve().parent.parent
GPU_SUITES = ("kernels", "dense", "moe", "loop", "mission", "checkpoint", "quality_dense",
              "quality_moe", "quality_moe_seeds", "ray_dense", "ray_faults")


def test_every_suite_runs_existing_programs_with_options_they_define():
    """A renamed program or option would only fail on the GPU machine; catch it here from the programs' source."""
    for suite, benchmarks in run_suite.SUITES.items():
        assert benchmarks, suite
        for b in benchmarks:
            source = (REPO / "benchmarks" / b.script).read_text()
            options = [a for a in b.args if a.startswith("--")] + ["--out"] + (["--run-root"] if b.run_root else [])
            for option in options:
                assert re.search(rf"add_argument\(\s*\"{re.escape(option)}\"", source), (suite, b.name, option)
            assert b.output.endswith(".json"), b.name
            assert 0 < b.timeout_s <= 600, b.name  # one device call runs at most 10 minutes


def _loop_variants(benchmark):
    """(name, overrides) of every run of a worker_throughput benchmark: its --common settings and each --variant's."""
    args = list(benchmark.args)
    common, variants, current = [], [], None
    for arg in args[args.index("--common") + 1:]:
        if arg == "--variant":
            current = []
            variants.append(current)
        elif arg.startswith("--"):
            current = None
        elif current is not None:
            current.append(arg)
        else:
            common.append(arg)
    return [(v[0], common + [o for o in v[1:] if not o.startswith("launcher=")]) for v in variants]


# Not named `benchmark`: the GPU image's pytest has a plugin whose `benchmark` fixture hook, handed this parameter,
# stops pytest with an internal error, and the files after this one never run.
@pytest.mark.parametrize("suite_benchmark", [b for s in GPU_SUITES for b in run_suite.SUITES[s]
                                       if b.script == "worker_throughput.py"], ids=lambda b: b.name)
def test_every_product_loop_run_of_the_gpu_suites_is_a_config_the_product_accepts(suite_benchmark, monkeypatch):
    """A setting the product refuses (a renamed key, a profile window past the run's end) fails every row of a GPU
    call in seconds; catch it here."""
    from hydra import compose, initialize_config_dir

    import orchestration.data.select
    from orchestration.machine_defaults import Machine
    from orchestration.validation import resolve_job

    # The one-GPU machine the suites run on, described (this one has none): a suite that leaves the cluster to the
    # machine (the mission command) resolves as it does there.
    one_gpu = Machine(gpu_vendor="cuda", gpu_count=1, gpu_memory_gb=79.1, gpu_name="NVIDIA H100 80GB HBM3",
                      source="the GPU machine")

    # The quality suites read a corpus prepared on the GPU machine (docs/data.md), absent from a fresh clone: every
    # other setting is checked here, the corpus checks are tests/test_tokenized_data.py's.
    resolve_data = orchestration.data.select.resolve_data
    monkeypatch.setattr(orchestration.data.select, "resolve_data",
                        lambda job: None if job.data.name == "tokenized" else resolve_data(job))
    variants = _loop_variants(suite_benchmark)
    assert variants, suite_benchmark.name
    for name, overrides in variants:
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            job, _ = resolve_job(compose(config_name="config", overrides=overrides), one_gpu)
        assert job.cluster.device == "cuda" and job.cluster.max_workers == 1, (suite_benchmark.name, name)


def test_all_is_every_gpu_suite_in_order_with_unique_result_names():
    expected = [b.name for s in GPU_SUITES for b in run_suite.SUITES[s]]
    assert [b.name for b in run_suite.SUITES["all"]] == expected
    assert len(set(expected)) == len(expected)  # one result file per benchmark
    assert set(run_suite.SUITES) == {*GPU_SUITES, "all", "smoke"}


def test_suite_fits_one_device_call():
    for suite in GPU_SUITES:
        assert sum(b.timeout_s for b in run_suite.SUITES[suite]) <= 600 + 60, suite  # + start-up slack of the call


def test_select_narrows_and_names_what_is_valid():
    assert [b.name for b in run_suite.select("dense", ["train_step_dense"])] == ["train_step_dense"]
    with pytest.raises(SystemExit, match="choose one of kernels, dense, moe"):
        run_suite.select("dens")
    with pytest.raises(SystemExit, match=r"not in suite 'moe' \(it has moe_grouped, train_step_moe\)"):
        run_suite.select("moe", ["fp8_linear"])


def test_dry_run_lists_each_command_and_result_file(tmp_path, capsys):
    assert run_suite.main(["loop", "--dry-run", "--results", str(tmp_path), "--scratch", str(tmp_path / "s"),
                           "--run-root", str(tmp_path / "r")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["loop_dense", "loop_moe"]
    assert lines[1].endswith(f"-> {tmp_path / 'loop_moe.json'}")
    assert "--json-name loop_moe.json" in lines[1] and f"--run-root {tmp_path / 'r'}" in lines[1]
    assert "--variant fp8 precision=fp8 --variant fp8_bf16_head precision=fp8 precision.fp8_output_head=false" in lines[1]
    assert not list(tmp_path.glob("*.json"))  # a dry run writes nothing


def test_write_result_writes_the_documented_record(tmp_path):
    results = {"cases": [{"case": "bf16", "ms": 1.25}]}
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    path = write_result(tmp_path / "sub" / "x.json", benchmark="x", suite="dense", command="python3 benchmarks/x.py",
                        suite_command="python3 benchmarks/run_suite.py dense", returncode=0, wall_s=12.345,
                        results=results)
    record = json.loads(path.read_text())
    assert tuple(record) == RESULT_KEYS
    assert record["results"] == results and record["wall_s"] == 12.3 and record["returncode"] == 0
    assert record["torch"] == torch.__version__
    assert record["gpu"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    written = datetime.datetime.strptime(record["date_utc"], "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=datetime.UTC)
    assert 0 <= (written - before).total_seconds() < 60
    failed = write_result(path, benchmark="x", suite="dense", command="c", suite_command="s", returncode="timeout",
                          wall_s=1.0, results=None, output_tail="last line")
    assert json.loads(failed.read_text())["output_tail"] == "last line"  # replaced, not appended


def test_missing_required_module_stops_before_running_and_says_what_to_fetch(tmp_path):
    bench = run_suite.Benchmark("b", "fp8_kernels.py", (), "b.json", requires=("omegaconf", "no_such_module_x"))
    (tmp_path / "wheels").mkdir()
    with pytest.raises(SystemExit, match=r"need no_such_module_x.*put wheels of no_such_module_x into"):
        run_suite.prepare_modules([bench], tmp_path / "wheels", tmp_path / "site")
    assert run_suite.install_wheels(tmp_path / "wheels", tmp_path / "site") == []


def test_missing_module_is_installed_from_the_wheel_dir_for_the_runner_and_its_programs(tmp_path, monkeypatch):
    """What the GPU image lacks comes from wheels: a real wheel built here, installed into --site by pip, importable
    by the runner and on the PYTHONPATH its programs inherit."""
    project = tmp_path / "project"
    (project / "src" / "bench_probe_mod").mkdir(parents=True)
    (project / "src" / "bench_probe_mod" / "__init__.py").write_text("VALUE = 42\n")
    (project / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "bench-probe-mod"\nversion = "1.0"\n[tool.setuptools.packages.find]\nwhere = ["src"]\n')
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
                    "-w", str(wheels), str(project)], check=True)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    bench = run_suite.Benchmark("b", "fp8_kernels.py", (), "b.json", requires=("bench_probe_mod",))
    assert run_suite.missing(["bench_probe_mod"]) == ["bench_probe_mod"]
    assert run_suite.prepare_modules([bench], wheels, tmp_path / "site") == []
    assert run_suite.missing(["bench_probe_mod"]) == []
    out = subprocess.run([sys.executable, "-c", "import bench_probe_mod; print(bench_probe_mod.VALUE)"],
                         env=dict(os.environ), capture_output=True, text=True, check=True).stdout
    assert out.strip() == "42"
    sys.modules.pop("bench_probe_mod", None)


def test_smoke_suite_writes_real_results_through_the_runner(tmp_path):
    """Two programs at tiny shapes on CPU, run by the runner: each file holds the program's own results - the kernels'
    checks against fp8.reference (Triton interpreter), the MoE FFN's SQNR against float64 (emulated FP8)."""
    skip_if_interpreter_older_than(QUANTIZE_INTERPRETER_TRITON)  # fp8_kernels.py --smoke runs them interpreted
    assert run_suite.main(["smoke", "--results", str(tmp_path), "--scratch", str(tmp_path / "scratch")]) == 0
    kernels = json.loads((tmp_path / "fp8_kernels_smoke.json").read_text())
    assert tuple(kernels) == RESULT_KEYS and kernels["returncode"] == 0
    assert kernels["command"].endswith(
        f"benchmarks/fp8_kernels.py --smoke --out {tmp_path / 'scratch' / 'fp8_kernels_smoke'}")
    checks = kernels["results"]["checks"]
    ops = {c["op"] for c in checks}
    assert {"tensorwise", "rowwise", "rowwise_and_colwise", "rowwise_group_scaled", "cast_rows_transposed_batched",
            "transpose_batched", "transpose"} <= ops
    assert all(c["ok"] for c in checks) and kernels["results"]["checks_ok"] is True
    moe = json.loads((tmp_path / "moe_grouped_smoke.json").read_text())["results"]
    sqnr = moe["numerics"]
    # bf16 grouped GEMMs ~49 dB against float64, rowwise e4m3 ~23 dB (the H200 gave 48.5 and 23.1 at larger shapes)
    assert all(45 < v < 60 for v in sqnr["bf16_eager"].values()), sqnr["bf16_eager"]
    assert all(20 < v < 30 for v in sqnr["ours_eager"].values()), sqnr["ours_eager"]
    assert [c["impl"] for c in moe["cases"]] == ["bf16_eager", "ours_eager"]
    assert all(c["ms"] > 0 for c in moe["cases"])


def test_timeout_kills_the_program_and_still_writes_its_file(tmp_path):
    bench = run_suite.Benchmark("slow", "fp8_kernels.py", ("--smoke",), "fp8_kernels_smoke.json", timeout_s=1)
    rc, wall, _tail = run_suite.run_one(bench, tmp_path, tmp_path)
    assert rc == "timeout" and wall < 10
    assert run_suite.collect(bench, tmp_path / "slow") is None
