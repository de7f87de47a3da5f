"""benchmarks/train_step.py times the product's train_step: run it on CPU (FP8 emulated) at the debug size and check
its first-step losses against train_step called directly on the same model and batch."""

import json

import pytest
import torch

from benchmarks import train_step as bench
from orchestration.config import JobConfig, ModelConfig, MonitorConfig, PrecisionConfig, TrainConfig
from orchestration.divergence.guard import StepGuard
from orchestration.training.loop import build_training_model
from orchestration.training.optimizer import make_optimizer
from orchestration.training.step import MicroBatch, StepModel, train_step
from orchestration.validation import validate

BATCH, SEQ = 2, 32  # the benchmark's "debug" config
VARIANTS = ("bf16", "ours:tensorwise", "ours_head:tensorwise", "ours_nocheck:tensorwise", "torchao:tensorwise",
            "torchao_head:tensorwise")


def reference_first_loss(precision: str, recipe: str = "auto") -> float:
    """Step 0's loss from the product's own pieces: the worker's model build, optimizer, guard and train_step, on
    the benchmark's first batch (uniform tokens from a CPU generator seeded 0)."""
    job = JobConfig(model=ModelConfig(name="debug_dense"), precision=PrecisionConfig(name=precision, recipe=recipe),
                    train=TrainConfig(global_batch_size=BATCH, micro_batch_size=BATCH, sharding="none"),
                    monitor=MonitorConfig())
    job.data.seq_len = SEQ
    validate(job)
    device = torch.device("cpu")
    torch.manual_seed(job.train.seed)
    model, fp8_recipe = build_training_model(job, 1, device)[:2]
    optimizer = make_optimizer(job, device, model)
    sm = StepModel(model, optimizer, device, torch.bfloat16, False, False, 1, "none", job.train.grad_clip)
    guard = StepGuard(job.monitor, model, fp8_run=fp8_recipe is not None)
    tokens = torch.randint(0, model.args.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    batch = [MicroBatch(tokens[:, :-1], tokens[:, 1:], 1.0, 1.0)]
    result = train_step(sm, batch, 0, guard)
    assert result.updated
    return float(result.loss)


def test_benchmark_times_the_product_step_on_cpu(tmp_path):
    result = bench.main(["--configs", "debug", "--device", "cpu", "--steps", "2", "--warmup", "1",
                         "--only", ",".join(VARIANTS), "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "train_step.json").read_text())
    assert saved["configs"][0]["rows"] == json.loads(json.dumps(result["configs"][0]["rows"]))
    rows = {r["variant"]: r for r in saved["configs"][0]["rows"]}
    assert tuple(rows) == VARIANTS
    try:
        import torchao  # noqa: F401
        have_torchao = True
    except ImportError:
        have_torchao = False
    for variant, row in rows.items():
        if variant.startswith("torchao") and not have_torchao:
            assert row["error"].startswith("skipped: torchao is not installed"), row
            continue
        assert "error" not in row, row
        assert len(row["times_ms"]) == 2 and all(t > 0 for t in row["times_ms"]), row
        assert row["ms"] > 0 and row["tokens_per_s"] == pytest.approx(BATCH * SEQ / (row["ms"] / 1e3))
        assert len(row["losses"]) == 3 and row["updates_applied"] == 3 and row["decisions"] == ["proceed"], row
    assert rows["bf16"]["divergence_check"] and rows["ours:tensorwise"]["divergence_check"]
    assert not rows["ours_nocheck:tensorwise"]["divergence_check"]
    assert rows["bf16"]["speedup_vs_bf16"] == 1.0

    bf16_ref = reference_first_loss("bf16")
    fp8_ref = reference_first_loss("fp8", "tensorwise")
    assert rows["bf16"]["losses"][0] == bf16_ref
    assert rows["ours:tensorwise"]["losses"][0] == fp8_ref
    # The check only decides (every step proceeds here): without it the same losses, step for step.
    assert rows["ours_nocheck:tensorwise"]["losses"] == rows["ours:tensorwise"]["losses"]
    # Emulated FP8 is not bf16 (the rows are not the same computation), and the FP8 head changes the loss further.
    assert fp8_ref != bf16_ref and abs(fp8_ref - bf16_ref) / bf16_ref < 1e-2
    assert rows["ours_head:tensorwise"]["losses"][0] != fp8_ref


def test_bad_variant_fails_before_building_anything(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--configs", "debug", "--device", "cpu", "--only", "ours+tadam", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="recipe 'blockwise' is not one of"):
        bench.Variant.parse("ours:blockwise")
    with pytest.raises(ValueError, match="bf16 takes no recipe"):
        bench.Variant.parse("bf16:tensorwise")
    assert not (tmp_path / "train_step.json").exists()


@pytest.mark.parametrize("config", ["dense", "moe"])
def test_the_gpu_rows_configs_pass_the_products_checks(config):
    """The GPU configurations build a JobConfig the product accepts for a CUDA worker (one GPU each): a check that
    only runs on the GPU machine otherwise (every row once failed there with 'cluster.gpus_per_worker: must be > 0
    when cluster.device=cuda', and the dense rows' batch of 1 with the default of 2 workers)."""
    for text in bench.CONFIGS[config]["variants"]:
        job = bench.job_for(bench.CONFIGS[config], bench.Variant.parse(text), eager=False, device=torch.device("cuda"))
        assert job.cluster.device == "cuda" and job.cluster.gpus_per_worker == 1.0 and job.cluster.max_workers == 1
        assert job.data.seq_len == bench.CONFIGS[config]["seq"]


@pytest.mark.parametrize("counts", [(5, 0, 17, 16, 1), (0, 0, 3), (16,), (0, 7, 0)])
def test_padded_token_groups_give_the_unpadded_experts_output_and_gradients(counts):
    """torchao's FP8 grouped GEMMs need 16-row token groups: the benchmark pads them around the experts' forward,
    which must not change what the experts compute."""
    from benchmarks.train_step import aligned_group_rows, pad_token_groups, padded_rows
    from models.deepseek_moe import GroupedExperts

    torch.manual_seed(0)
    experts = GroupedExperts(len(counts), dim=8, hidden_dim=8)
    experts.init_weights(0.5, 0.5)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), 8, requires_grad=True)
    y = experts(x, offs)
    y.square().sum().backward()
    grads = x.grad.clone(), experts.w13.grad.clone(), experts.w2.grad.clone()

    dest, padded_offs = aligned_group_rows(offs, x.shape[0], 16)
    ends = padded_offs.tolist()
    starts = [0] + ends[:-1]
    assert ends[-1] == padded_rows(x.shape[0], len(counts), 16) and all(e % 16 == 0 for e in ends)
    assert all(b - a >= n for a, b, n in zip(starts, ends, counts))  # every group fits its padded slot
    assert sorted(dest.tolist()) == dest.tolist() and len(set(dest.tolist())) == x.shape[0]

    x.grad = experts.w13.grad = experts.w2.grad = None
    pad_token_groups(experts, 16)
    y_padded = experts(x, offs)
    y_padded.square().sum().backward()
    torch.testing.assert_close(y_padded, y)
    for padded, reference in zip((x.grad, experts.w13.grad, experts.w2.grad), grads):
        torch.testing.assert_close(padded, reference)


def test_fp8_health_gauges_read_without_autograd_warnings():
    """The guard's FP8 saturation/underflow gauges after a real FP8 step: plain floats, read without torch's
    "Converting a tensor with requires_grad=True to a scalar" warning (it reached every run's console)."""
    import warnings

    job = JobConfig(model=ModelConfig(name="debug_moe"), precision=PrecisionConfig(name="fp8"),
                    train=TrainConfig(global_batch_size=BATCH, micro_batch_size=BATCH, sharding="none"),
                    monitor=MonitorConfig())
    job.data.seq_len = SEQ
    validate(job)
    device = torch.device("cpu")
    torch.manual_seed(job.train.seed)
    model, fp8_recipe = build_training_model(job, 1, device)[:2]
    sm = StepModel(model, make_optimizer(job, device, model), device, torch.bfloat16, False, False, 1,
                   "none", job.train.grad_clip)
    guard = StepGuard(job.monitor, model, fp8_run=fp8_recipe is not None)
    tokens = torch.randint(0, model.args.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    train_step(sm, [MicroBatch(tokens[:, :-1], tokens[:, 1:], 1.0, 1.0)], 0, guard)
    assert guard.last_fp8_health is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gauges = guard.fp8_health_gauges()
    assert set(gauges) == {"fp8_saturated_frac", "fp8_underflow_frac"}
    assert all(type(v) is float and 0.0 <= v <= 1.0 for v in gauges.values()), gauges
