"""FP8 only where it pays: the size rule per GEMM, which layers of a model it keeps in bf16, and that only GPU jobs
apply it (on CPU FP8 is emulated for correctness: every eligible layer converts)."""

from __future__ import annotations

import pytest
import torch

import fp8
from fp8 import size_rule
from fp8.size_rule import LINEAR_RULE, SizeRule, expert_group_pays, linear_pays
from orchestration.machine_defaults import Machine
from tests.test_machine_defaults import resolve

H100 = Machine(gpu_vendor="cuda", gpu_count=1, gpu_memory_gb=79.1, gpu_name="H100", source="test")


def test_the_rule_compares_forward_flops_and_the_smaller_weight_dim():
    rule = SizeRule(min_gflop=10.0, min_dim=1024)
    assert rule.pays(4096, 1024, 2048)  # 2 * 4096 * 1024 * 2048 = 17.2 GFLOP
    assert not rule.pays(1024, 1024, 2048)  # 4.3 GFLOP
    assert not rule.pays(65536, 512, 4096)  # large, but a 512-wide weight
    # routed experts: judged on the average rows per expert (tokens x top-k / E) and the w2 GEMM (hidden -> dim)
    # 16384 tokens x top-6 / 64 experts = 1536 rows; w2 1408 -> 2048: 2 * 1536 * 1408 * 2048 = 8.86 GFLOP
    assert expert_group_pays(16384, 6, 64, 2048, 1408, SizeRule(min_gflop=8.8, min_dim=1024))
    assert not expert_group_pays(16384, 6, 64, 2048, 1408, SizeRule(min_gflop=8.9, min_dim=1024))
    assert linear_pays(8192, 4096, 4096) == LINEAR_RULE.pays(8192, 4096, 4096)


def _planned(machine, *overrides):
    from orchestration.driver.plan import build_job_plan

    job, notes = resolve(machine, *overrides, enforce=False)
    return job, build_job_plan(job, notes)


def test_a_gpu_plan_keeps_the_layers_too_small_to_pay_in_bf16_and_the_worker_converts_the_rest(monkeypatch):
    """debug_moe at 16 x 128 = 2048 tokens a micro-batch: its 128 x 128 attention GEMMs (67 MFLOP forward) and
    experts fall under a 0.1 GFLOP rule, its 128 <-> 256 FFN and head GEMMs (134 MFLOP) pay. The plan and the
    converted model agree on which layers stay bf16; a CPU job converts all of them."""
    monkeypatch.setattr(size_rule, "LINEAR_RULE", SizeRule(min_gflop=0.1, min_dim=0))
    monkeypatch.setattr(size_rule, "EXPERT_GROUP_RULE", SizeRule(min_gflop=0.1, min_dim=0))
    overrides = ("model=debug_moe", "precision=fp8", "data.seq_len=128", "train.global_batch_size=16",
                 "train.micro_batch_size=16")
    job, plan = _planned(H100, *overrides)
    kept = plan["fp8_layers"]["kept_bf16"]
    assert {name.rsplit(".", 1)[-1] for name in kept} == {"wq", "wk", "wv", "wo", "experts", "w1", "w2", "w3"}
    assert all(size == "linear 128->128" for name, size in kept.items() if ".attention." in name)
    assert not any(name.startswith("layers.0.feed_forward") or name == "output" for name in kept)  # 256-wide
    assert plan["fp8_layers"]["converted"] == plan["fp8_layers"]["eligible"] - len(kept) > 0

    from orchestration.training.model_setup import build_training_model, plan_fp8

    again = plan_fp8(job, on_gpu=True)
    assert again.kept_bf16 == kept and again.eligible == plan["fp8_layers"]["eligible"]
    model = build_training_model(job, world_size=1, device=torch.device("cpu"), size_rule=True).model
    converted = set(fp8.precision_state(model)["modules"])
    assert converted and not converted & set(kept) and converted == set(again.converted)
    assert len(converted) == plan["fp8_layers"]["converted"]

    _, cpu_plan = _planned(Machine(), *overrides)
    assert cpu_plan["fp8_layers"]["kept_bf16"] == {}
    assert cpu_plan["fp8_layers"]["converted"] == len(kept) + len(converted)


def test_a_gpu_job_where_no_layer_pays_trains_in_bf16_and_the_plan_says_why(monkeypatch):
    monkeypatch.setattr(size_rule, "LINEAR_RULE", SizeRule(min_gflop=1e6, min_dim=0))
    monkeypatch.setattr(size_rule, "EXPERT_GROUP_RULE", SizeRule(min_gflop=1e6, min_dim=0))
    job, notes = resolve(H100, "model=debug_moe", "precision=fp8", enforce=False)
    assert job.precision.name == "bf16" and job.precision.fp8_output_head is False
    assert any(n.startswith("precision bf16: no layer of debug_moe is large enough for FP8 to pay") for n in notes)
    cpu_job, _ = resolve(Machine(), "model=debug_moe", "precision=fp8")
    assert cpu_job.precision.name == "fp8"  # emulated FP8 on CPU is for correctness: kept as asked


@pytest.mark.parametrize("model", ["deepseek_moe16b", "llama3_8b"])
def test_at_the_gpu_defaults_every_layer_of_the_mission_models_pays(model):
    """At the shapes the machine picks on one H100 (16k tokens a micro-batch), the measured rule keeps nothing in
    bf16: the product's GPU default is FP8 everywhere it can be."""
    _, plan = _planned(H100, f"model={model}", "+model.overrides.n_layers=4")
    assert plan["fp8_layers"]["kept_bf16"] == {}
    assert plan["fp8_layers"]["converted"] == plan["fp8_layers"]["eligible"] > 0


def test_at_sixteen_sequences_of_128_tokens_only_the_lm_head_is_large_enough_for_fp8():
    """The shape where FP8 ran at 0.70x bf16 on an H100 (DeepSeek-MoE-16B width, 2048 tokens a micro-batch): every
    block GEMM falls under the rule and stays bf16; the 2048 -> 102400 head (859 GFLOP) still pays."""
    _, plan = _planned(H100, "model=deepseek_moe16b", "+model.overrides.n_layers=4", "data.seq_len=128",
                       "train.global_batch_size=16")
    assert plan["micro_batch_size"] == 16
    layers = plan["fp8_layers"]
    assert layers["converted"] == 1 and "output" not in layers["kept_bf16"]
    assert len(layers["kept_bf16"]) == layers["eligible"] - 1
