"""models/scaling.py: the FSDP2 scaling model against published runs, its communication arithmetic, and the dry-run
planner's prediction from 1 to 1,024 GPUs."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from models import scaling

REPO = Path(__file__).resolve().parent.parent
ERROR_BOUND = 0.15


@pytest.mark.parametrize("run", scaling.PUBLISHED_RUNS, ids=lambda r: r.name[:60])
def test_prediction_within_bound_of_published_run(run):
    (row,) = scaling.validate_published((run,))
    assert abs(row["error"]) <= ERROR_BOUND, row


def test_ring_collective_is_bandwidth_plus_hop_latency():
    f = scaling.FABRICS["nvlink_ib400"]
    gb = 1e9
    # 2 GPUs in a node: half the bytes over NVLink, one hop
    assert scaling.ring_collective_s(gb, 2, f) == pytest.approx(0.5 * gb / (f.intra_node_gbs * 1e9) + f.intra_hop_us * 1e-6)
    # 16 GPUs span two nodes: the NIC is the bottleneck, 15 hops
    assert scaling.ring_collective_s(gb, 16, f) == pytest.approx(15 / 16 * gb / (f.inter_node_gbs * 1e9)
                                                                 + 15 * f.inter_hop_us * 1e-6)
    assert scaling.ring_collective_s(gb, 1, f) == 0.0


def test_fp8_all_gather_halves_the_gathered_bytes_of_linears():
    w = dataclasses.replace(scaling.PUBLISHED_RUNS[0].workload, compute_s=1.0, fp8_compute_speedup=1.3)
    f = scaling.FABRICS["aws_efa"]
    plain = scaling.predict_step(w, scaling.Precision(True, False, 2, 4), f, 64)
    gathered = scaling.predict_step(w, scaling.Precision(True, True, 2, 4), f, 64)
    ag_bf16 = scaling.ring_collective_s(w.params_per_layer * 2, 64, f)
    ag_fp8 = scaling.ring_collective_s(w.params_per_layer * (w.fp8_gather_fraction + 2 * (1 - w.fp8_gather_fraction)),
                                       64, f)
    # two gathers per block a step (forward, backward)
    assert plain.comm_s - gathered.comm_s == pytest.approx(2 * w.layers * (ag_bf16 - ag_fp8))
    assert gathered.tokens_per_s_per_gpu > plain.tokens_per_s_per_gpu
    assert plain.compute_s == gathered.compute_s


# On MI300X precision.recipe=auto is rowwise_gw_hp, whose weights have no one fp8 copy to gather: no fp8 all-gather curve.
@pytest.mark.parametrize("model,fabric,curves", [
    ("llama3_8b", "nvlink_ib400", {"bf16", "fp8", "fp8 + fp8 all-gather"}),
    ("deepseek_moe16b", "mi300x_roce400", {"bf16", "fp8"})])
def test_dry_run_predicts_one_to_1024_gpus(model, fabric, curves):
    proc = subprocess.run([sys.executable, "launch.py", f"model={model}", "dry_run=true", f"cluster.fabric={fabric}",
                           "cluster.min_workers=8", "cluster.max_workers=8", "data.seq_len=4096",
                           "train.micro_batch_size=1", "train.global_batch_size=8"],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=300)
    plan = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("PLAN "))[5:])
    sp = plan["scaling"]
    assert sp["fabric"] == fabric and sp["world_size"] == 8 and sp["tokens_per_gpu"] == 4096
    assert set(sp["curves"]) == curves
    for rows in sp["curves"].values():
        assert [r["world_size"] for r in rows] == [2**i for i in range(11)]
        assert rows[0]["scaling_efficiency"] == 1.0 and rows[0]["exposed_comm_s"] == 0.0
        # leaving the node (8 -> 16 GPUs) moves the collectives from NVLink / Infinity Fabric to the NIC
        assert rows[4]["comm_s"] > rows[3]["comm_s"]
        for r in rows:
            assert r["step_s"] == pytest.approx(4096 / r["tokens_per_s_per_gpu"])
    fp8, bf16 = sp["curves"]["fp8"], sp["curves"]["bf16"]
    assert fp8[0]["step_s"] < bf16[0]["step_s"]  # the measured single-GPU FP8 speedup
    assert "scaling on " + fabric in proc.stdout


def test_plot_scaling_draws_every_precision(tmp_path):
    from orchestration.observability.report_plots import plot_scaling

    w = dataclasses.replace(scaling.PUBLISHED_RUNS[0].workload, compute_s=1.0, fp8_compute_speedup=1.3)
    f = scaling.FABRICS["nvlink_ib400"]
    curves = {p.label: [s.to_dict() for s in scaling.scaling_curve(w, p, f)]
              for p in (scaling.Precision(False, False), scaling.Precision(True, True))}
    fig = plot_scaling({"fabric": f.name, "tokens_per_gpu": 8192, "curves": curves}, tmp_path / "scaling.png")
    assert (tmp_path / "scaling.png").stat().st_size > 0
    drawn = {line.get_gid() for ax in fig.axes for line in ax.get_lines()}
    assert drawn == {"data:bf16", "data:fp8 + fp8 all-gather"}
    xs = fig.axes[0].get_lines()[0].get_xdata()
    assert list(xs) == list(scaling.WORLD_SIZES)
