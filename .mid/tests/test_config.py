"""Config validation: every bad input fails before Ray starts, with a message naming the key."""

import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from orchestration.config import ConfigError, JobConfig
from orchestration.validation import load_job_config

REPO = Path(__file__).resolve().parent.parent


def compose_job(*overrides: str) -> JobConfig:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return load_job_config(cfg)


def test_default_config_composes_and_validates():
    job = compose_job()
    assert job.model.name == "debug_moe"
    assert job.precision.name == "fp8"
    assert (job.cluster.min_workers, job.cluster.max_workers) == (2, 2)
    assert job.train.global_batch_size % (job.cluster.max_workers * 1) == 0


@pytest.mark.parametrize("overrides, key, allowed", [
    (["cluster.min_workers=3", "cluster.max_workers=2"], "cluster.max_workers", ">= cluster.min_workers"),
    (["train.lr=-0.1"], "train.lr", "must be > 0"),
    (["train.global_batch_size=1"], "train.global_batch_size", "at least one sequence"),
    (["model.name=gpt5"], "model.name", "known: "),
    (["precision.recipe=blockwise"], "precision.recipe", "tensorwise"),
    (["cluster.device=tpu"], "cluster.device", "cpu"),
    (["train.warmup_steps=1000"], "train.warmup_steps", "must be in"),
    (["data.source=relative/path"], "data.source", "absolute path"),
    (["cluster.storage_path=relative"], "cluster.storage_path", "absolute"),
    (["model.compile_mode=turbo"], "model.compile_mode", "reduce-overhead"),
    (["model.compile_mode=reduce-overhead", "cluster.min_workers=1", "cluster.max_workers=2"], "model.compile_mode",
     "cluster.max_workers=1"),
])
def test_impossible_values_name_the_key(overrides, key, allowed):
    # A value outside a choice field's Enum fails in Hydra's composition (the override names the key, OmegaConf's
    # cause lists the allowed values); the other checks are ours (orchestration/validation.py).
    with pytest.raises((ConfigError, ConfigCompositionException)) as info:
        compose_job(*overrides)
    message = f"{info.value} {info.value.__cause__ or ''}"
    assert key in message and allowed in message, message


@pytest.mark.parametrize("mode, expected", [("default", None), ("reduce-overhead", "reduce-overhead")])
def test_compile_mode_reaches_every_block(monkeypatch, mode, expected):
    """model.compile_mode is what each block is compiled with (recorded at Module.compile: CUDA graphs themselves
    need a GPU, benchmarks/train_step.py's +cg variants run them on the H200)."""
    import torch

    from orchestration.training.model_setup import build_training_model

    seen = []
    original = torch.nn.Module.compile

    def recording_compile(self, *args, **kwargs):
        seen.append(kwargs.get("mode"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "compile", recording_compile)
    job = compose_job("model=debug_dense", "model.compile=true", f"model.compile_mode={mode}",
                      "cluster.min_workers=1", "cluster.max_workers=1", "precision=bf16")
    model = build_training_model(job, world_size=1, device=torch.device("cpu")).model
    assert seen == [expected] * len(model.layers) and len(seen) > 0


def test_fp8_output_head_setting_reaches_the_conversion():
    """precision.fp8_output_head: true (precision=fp8's default) makes the LM head a Float8Linear; false keeps it
    nn.Linear, with the same layers converted besides; a non-boolean value is refused naming the key."""
    import torch

    from fp8 import Float8Linear
    from orchestration.training.model_setup import build_training_model

    def fp8_layers(*overrides):
        job = compose_job("model=debug_dense", "model.compile=false", "cluster.min_workers=1",
                          "cluster.max_workers=1", "precision=fp8", *overrides)
        model = build_training_model(job, world_size=1, device=torch.device("cpu")).model
        return {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}

    bf16_head = fp8_layers("precision.fp8_output_head=false")
    assert bf16_head and "output" not in bf16_head
    assert fp8_layers() == bf16_head | {"output"}  # the default: the head in FP8 too
    # A wrong type fails in Hydra's composition onto the registered schema, naming the key.
    with pytest.raises(ConfigCompositionException, match="precision.fp8_output_head"):
        compose_job("model=debug_dense", "precision.fp8_output_head=sometimes")
    with pytest.raises(ConfigError, match="precision.fp8_output_head: true needs precision=fp8"):
        compose_job("model=debug_dense", "precision=bf16", "precision.fp8_output_head=true")
    # A vocabulary that is not a multiple of 16 cannot run in FP8: refused with the padded size, not left in bf16.
    with pytest.raises(ValueError, match=r"fp8_output_head=true.*model.overrides.vocab_size=272"):
        fp8_layers("precision.fp8_output_head=true", "+model.overrides.vocab_size=257")
    with pytest.raises(ValueError, match=r"fp8_output_head=true.*model.overrides.vocab_size=272"):
        fp8_layers("+model.overrides.vocab_size=257")  # the default asks the same
    assert "output" not in fp8_layers("precision.fp8_output_head=false", "+model.overrides.vocab_size=257")
    # The byte-level data's ids 0..255 must fit the vocabulary (the fused FP8 head's GPU kernel does not check them).
    with pytest.raises(ValueError, match=r"vocab_size=128, below the 256 token ids.*at least 256"):
        fp8_layers("+model.overrides.vocab_size=128")


def test_wrong_type_names_the_key():
    # Hydra composes onto the registered schema (conf/config.yaml's `base_job`), so the type error is its own.
    with pytest.raises(ConfigCompositionException) as info:
        compose_job("train.steps=many")
    assert "train.steps" in str(info.value)


def test_unknown_key_in_a_group_file_fails():
    # Hydra itself refuses `train.foo=1` (struct mode); `+train.foo=1` reaches our schema, which refuses it.
    with pytest.raises(ConfigError) as info:
        compose_job("+train.foo=1")
    assert "foo" in str(info.value)


def test_unknown_group_option_fails_in_hydra():
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"), pytest.raises(Exception) as info:
        compose(config_name="config", overrides=["model=not_a_model"])
    assert "not_a_model" in str(info.value)


def run_launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "launch.py"), *args], check=False, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


def test_launch_reports_config_error_before_ray_starts():
    proc = run_launch("cluster.min_workers=4", "cluster.max_workers=2")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cluster.max_workers" in proc.stderr
    assert "Ray dashboard" not in proc.stdout and "Run directory" not in proc.stdout


def test_launch_help_lists_groups_and_options():
    proc = run_launch("--help")
    assert proc.returncode == 0
    for group in ("model", "precision", "cluster", "data", "train", "monitor", "checkpoint", "logging", "faults"):
        assert f"{group}:" in proc.stdout, group
    assert "deepseek_moe16b" in proc.stdout and "llama3_8b" in proc.stdout


@pytest.mark.parametrize("launcher", ["launch.py", "torchrun"])
@pytest.mark.parametrize("override, key, change", [
    ("train.steps=abc", "train.steps", "give train.steps a value of its type"),
    ("precision=nonsense", "precision", "use one of bf16, fp8"),
    ("cluster.device=tpu", "cluster.device", "use one of cpu, cuda, rocm, auto"),
    ("train.stepz=5", "train.stepz", "check its spelling"),
])
def test_hydra_type_and_choice_errors_exit_2_with_one_line_naming_the_key(tmp_path, launcher, override, key, change):
    """What Hydra/OmegaConf refuse while composing (a wrong type, a value outside a choice field's Enum, an unknown
    group option or key) ends both launchers as our own checks do: exit code 2 and one line that names the key and
    what to change, not Hydra's multi-line error text and exit code 1; nothing is written."""
    command = ([str(REPO / "launch.py")] if launcher == "launch.py"
               else ["-m", "orchestration.driver.torchrun", "run_name=refused"])
    proc = subprocess.run([sys.executable, *command, f"run_root={tmp_path}", override], check=False,
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"config error: {key}: ") and change in lines[0], proc.stderr
    assert not list(tmp_path.iterdir())


def test_launch_cfg_job_shows_the_composed_config():
    proc = run_launch("--cfg", "job", "train.steps=7")
    assert proc.returncode == 0, proc.stderr
    assert "\n  steps: 7\n" in proc.stdout and "precision:" in proc.stdout


def test_env_preset_of_the_other_vendor_is_refused_for_an_explicit_device():
    """cluster.device=cuda with an RCCL preset (or rocm with an NCCL one) fails at config time, naming the presets
    that fit; device=auto is checked by the worker once it sees its GPU."""
    with pytest.raises(ConfigError, match=r"env_preset=rccl_mi300x is for rocm devices but cluster.device=cuda"):
        compose_job("cluster.device=cuda", "cluster.gpus_per_worker=1", "cluster.env_preset=rccl_mi300x")
    with pytest.raises(ConfigError, match=r"env_preset=nccl_h200 is for cuda devices but cluster.device=rocm"):
        compose_job("cluster.device=rocm", "cluster.gpus_per_worker=1", "cluster.env_preset=nccl_h200")
    assert compose_job("cluster.device=auto", "cluster.env_preset=rccl_mi300x").cluster.env_preset == "rccl_mi300x"
    import yaml

    from orchestration.validation import check_preset_device

    for path in sorted((REPO / "conf" / "cluster").glob("*.yaml")):  # the shipped cluster configs pair them right
        cluster = yaml.safe_load(path.read_text())
        # A key a preset leaves out takes the schema's default (env_preset none, device auto).
        check_preset_device(cluster.get("env_preset", "none"), cluster.get("device", "auto"))


def test_fp8_experts_setting_and_gpus_without_an_fp8_grouped_gemm():
    """precision.fp8_experts=false keeps the MoE experts bf16 (dense linears still FP8). FP8 experts on a GPU whose
    torch has no FP8 grouped GEMM (an MI300X build without MSLK, mocked: no AMD GPU here) are refused, naming that
    setting, instead of running the float32 emulation; the CPU emulates by design and an H200 has the GEMM."""
    import torch

    import fp8
    from fp8 import Float8Linear
    from fp8.backend import Fp8Backend
    from fp8.convert import require_fp8_grouped_gemm
    from orchestration.training.model_setup import build_training_model

    def build(*overrides):
        job = compose_job("model=debug_moe", "model.compile=false", "cluster.min_workers=1", "cluster.max_workers=1",
                          "precision=fp8", *overrides)
        model = build_training_model(job, world_size=1, device=torch.device("cpu")).model
        experts = [n for n, m in model.named_modules() if fp8.convert.is_fp8_grouped(m)]
        linears = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
        return model, experts, linears

    mi300x_without_mslk = Fp8Backend("rocm", "gfx942", torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
                                     emulate=False, has_scaled_mm=True, has_scaled_grouped_mm=False)
    h200 = Fp8Backend("cuda", "sm90", torch.float8_e4m3fn, torch.float8_e5m2,
                      emulate=False, has_scaled_mm=True, has_scaled_grouped_mm=True)
    model, experts, linears = build()
    assert experts and linears
    with pytest.raises(ValueError, match=r"gfx942.*MSLK.*precision.fp8_experts=false"):
        require_fp8_grouped_gemm(model, mi300x_without_mslk)
    require_fp8_grouped_gemm(model, h200)
    require_fp8_grouped_gemm(model, fp8.get_backend("cpu"))

    model_hp, experts_hp, linears_hp = build("precision.fp8_experts=false")
    assert experts_hp == [] and linears_hp == linears
    require_fp8_grouped_gemm(model_hp, mi300x_without_mslk)  # nothing left to refuse
    with pytest.raises(ConfigCompositionException, match="precision.fp8_experts"):
        compose_job("precision.fp8_experts=maybe")


def test_adamw_is_fused_on_gpus_and_default_on_cpu():
    """The worker's AdamW runs fused on GPUs (what benchmarks/train_step.py times) with the configured
    hyperparameters; CPU runs keep torch's default implementation."""
    import torch

    from orchestration.training.optimizer import adamw_kwargs

    job = compose_job("train.lr=0.002", "train.beta2=0.9", "train.weight_decay=0.05")
    gpu = adamw_kwargs(job, torch.device("cuda", 0))
    cpu = adamw_kwargs(job, torch.device("cpu"))
    assert gpu["fused"] is True and cpu["fused"] is None
    assert gpu["lr"] == cpu["lr"] == 0.002 and gpu["weight_decay"] == 0.05
    assert gpu["betas"] == (job.train.beta1, 0.9)
    # The kwargs build a working optimizer (fused AdamW exists on CPU too, so the GPU settings are checked here).
    param = torch.nn.Parameter(torch.ones(4))
    param.grad = torch.ones(4)
    torch.optim.AdamW([param], **gpu).step()
    assert torch.allclose(param.detach(), torch.full((4,), 1 - 0.002 - 0.002 * 0.05), rtol=1e-5)


def test_train_adamw_picks_our_triton_step_on_nvidia_gpus_only(monkeypatch):
    """train.adamw: auto = optim.ChunkedAdamW on NVIDIA GPUs, torch's AdamW on CPU and ROCm (mocked: no AMD GPU here);
    an explicit triton on a device it cannot run on is refused with the setting to change; bad values are refused."""
    import torch

    from optim import ChunkedAdamW
    from orchestration.training.optimizer import adamw_implementation, make_optimizer

    auto, triton, torch_impl = compose_job(), compose_job("train.adamw=triton"), compose_job("train.adamw=torch")
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert adamw_implementation(auto, cuda) == "triton" and adamw_implementation(auto, cpu) == "torch"
    assert adamw_implementation(torch_impl, cuda) == "torch" and adamw_implementation(triton, cuda) == "triton"
    with pytest.raises(ValueError, match="train.adamw=auto or torch"):
        adamw_implementation(triton, cpu)
    monkeypatch.setattr(torch.version, "hip", "6.3.0")  # ROCm: unverified, so torch's fused AdamW
    assert adamw_implementation(auto, cuda) == "torch"
    with pytest.raises(ValueError, match="ROCm"):
        adamw_implementation(triton, cuda)
    monkeypatch.setattr(torch.version, "hip", None)
    params = [torch.nn.Parameter(torch.ones(4))]
    assert type(make_optimizer(auto, cpu, params)) is torch.optim.AdamW
    assert type(make_optimizer(auto, cuda, params)) is ChunkedAdamW  # built, not stepped: no GPU needed for that
    with pytest.raises(ConfigCompositionException, match="train.adamw"):
        compose_job("train.adamw=apex")



def save_real_checkpoint(checkpoints: Path, step: int) -> None:
    """A sound checkpoint (manifest and digests) of a small model, written by the product's CheckpointManager: the
    resume checks refuse a run whose checkpoints are all damaged, so an empty step directory no longer stands in."""
    import torch

    from orchestration.checkpoint.manager import CheckpointManager

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    CheckpointManager(checkpoints, rank=0, world_size=1).save(step, model, optimizer)

def test_a_start_that_cannot_resume_is_refused_before_the_run_directory_changes(tmp_path):
    """driver/start_checks.py check_start (called by open_run_dir, for Ray and torchrun): a run_root that is a file,
    resume=false over checkpoints, and a resume with other model/precision/data settings are refused with the
    keys to restore; compatible changes (steps, lr, workers) pass; nothing in the run directory is touched."""
    from orchestration.config import to_dict
    from orchestration.driver.ray_job import open_run_dir
    from orchestration.driver.start_checks import check_start
    from orchestration.observability.events import RunDir

    def job(*overrides):
        return compose_job(f"run_root={tmp_path}", "model=debug_dense", *overrides)

    check_start(job(), "fresh")  # no run yet
    run = RunDir(tmp_path / "exp")
    run.write_config(to_dict(job()))
    check_start(job("model=debug_moe"), "exp")  # no checkpoints yet: nothing to resume, a fresh start is fine
    save_real_checkpoint(run.path / "checkpoints", 40)
    before = sorted((p.relative_to(run.path), p.stat().st_mtime_ns) for p in run.path.rglob("*"))

    check_start(job("train.steps=500", "train.lr=0.001", "cluster.max_workers=4", "cluster.min_workers=1"), "exp")
    with pytest.raises(ConfigError, match=r"model.name \(saved 'debug_dense', now 'debug_moe'\).*new run_name"):
        open_run_dir(job("model=debug_moe"), "exp")
    with pytest.raises(ConfigError, match=r"precision.name \(saved 'fp8', now 'bf16'\); "
                       r"precision.fp8_output_head \(saved True, now False\); data.seed \(saved 1234"):
        check_start(job("precision=bf16", "data.seed=5"), "exp")
    with pytest.raises(ConfigError, match=r"model.overrides \(saved \{\}, now \{'n_layers': 3\}\)"):
        check_start(job("+model.overrides.n_layers=3"), "exp")
    with pytest.raises(ConfigError, match=r"checkpoint.resume=false but run 'exp' already has checkpoints"):
        check_start(job("checkpoint.resume=false"), "exp")
    assert sorted((p.relative_to(run.path), p.stat().st_mtime_ns) for p in run.path.rglob("*")) == before

    # A run saved before a setting existed (no such key in its config.yaml) ran with the schema's default: resumable
    # with that value. fp8_output_head's schema default (False) is not precision=fp8's (true): named as a change.
    old_config = to_dict(job())
    del old_config["precision"]["fp8_experts"], old_config["precision"]["fp8_output_head"]
    run.write_config(old_config)
    check_start(job("precision.fp8_output_head=false"), "exp")
    with pytest.raises(ConfigError, match=r"precision.fp8_output_head \(saved False, now True\)"):
        check_start(job(), "exp")
    with pytest.raises(ConfigError, match=r"precision.fp8_experts \(saved True, now False\)"):
        check_start(job("precision.fp8_output_head=false", "precision.fp8_experts=false"), "exp")

    a_file = tmp_path / "not_a_dir"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        check_start(compose_job(f"run_root={a_file}"), "exp")


def test_train_lr_null_takes_the_models_peak_lr_and_an_explicit_one_wins():
    from models.registry import MODEL_FLAVORS

    assert compose_job().train.lr == 3e-3  # the default job: debug_moe
    assert compose_job("model=llama3_8b").train.lr == 3e-4
    assert compose_job("model=llama3_70b").train.lr == 1.5e-4
    assert compose_job("model=deepseek_moe16b").train.lr == 4.2e-4
    assert compose_job("model=deepseek_moe16b", "train.lr=1e-4").train.lr == 1e-4
    assert all(0 < f.peak_lr <= 3e-3 for f in MODEL_FLAVORS.values())
    assert compose_job("model=llama3_8b").train.lr_source == "model"
    assert compose_job("model=llama3_8b", "train.lr=1e-4").train.lr_source == "config"
    # validate() resolves too: a JobConfig built in code (lr left null) validates and gets the default
    from orchestration.config import JobConfig, to_dict
    from orchestration.validation import from_dict, validate

    job = JobConfig()
    validate(job)
    assert job.train.lr == MODEL_FLAVORS[job.model.name].peak_lr
    hand_built = to_dict(JobConfig())
    assert from_dict(hand_built).train.lr == MODEL_FLAVORS[hand_built["model"]["name"]].peak_lr
    with pytest.raises(ConfigError, match="train.lr_source"):
        compose_job("train.lr=1e-4", "train.lr_source=mine")


def test_a_resume_without_train_lr_keeps_the_saved_runs_lr(tmp_path):
    """The worker re-applies train.lr to every param group on resume: a default that changed since the run started
    (3e-3 for every model before train.lr=null) must not cut the lr mid-schedule; an lr given now wins."""
    from orchestration.config import to_dict
    from orchestration.driver.ray_job import open_run_dir
    from orchestration.observability.events import RunDir

    def job(*overrides):
        return compose_job(f"run_root={tmp_path}", "model=llama3_1b", *overrides)

    run = RunDir(tmp_path / "exp")
    saved = to_dict(job())
    saved["train"]["lr"] = 0.003  # a config.yaml that records the lr but not its source
    del saved["train"]["lr_source"]
    run.write_config(saved)
    save_real_checkpoint(run.path / "checkpoints", 40)
    resumed = job()
    assert resumed.train.lr == 3e-4
    open_run_dir(resumed, "exp")
    assert resumed.train.lr == 0.003 and resumed.train.lr_source == "config"
    assert (run.path / "config.yaml").read_text().count("lr: 0.003") == 1
    lowered = job("train.lr=0.0005")
    open_run_dir(lowered, "exp")
    assert lowered.train.lr == 0.0005
    # a fresh run (no checkpoints) takes the model's default whatever an earlier config.yaml said
    fresh = job()
    open_run_dir(fresh, "another")
    assert fresh.train.lr == 3e-4


def test_no_yaml_option_repeats_a_dataclass_default():
    """Each default lives once, in orchestration/config.py: a conf/ option holds its name and what differs."""
    import yaml

    from orchestration.config import JobConfig, to_dict

    defaults = to_dict(JobConfig())
    repeated = []
    for path in sorted((REPO / "conf").glob("*/*.yaml")):
        values = yaml.safe_load(path.read_text()) or {}
        group = defaults[path.parent.name]
        repeated += [f"{path.relative_to(REPO)}: {key}" for key, value in values.items()
                     if key != "name" and key in group and group[key] == value]
    assert repeated == []
