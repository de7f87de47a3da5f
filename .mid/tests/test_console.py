"""The driver's console lines (orchestration/observability/console.py) from records written the way the workers write
them: the divergence policy's own decision records through a real run directory, each agreed decision written by
both workers and printed once."""

import json
import os

from orchestration.divergence.monitor import Finding
from orchestration.divergence.policy import FallbackToBF16, RetryFP8, Rollback, SkipStep
from orchestration.observability.console import ConsoleLines, RunDirTail, duration
from orchestration.observability.events import EVENTS_FILE, METRICS_FILE, RunDir


def write_decision(run_dir: RunDir, decision, **extra_events) -> None:
    """As training/decisions.py does: the decision's records, then what the loop adds, on both workers."""
    for rank in (0, 1):
        for record in decision.events():
            name, step = record.pop("event"), record.pop("step")
            run_dir.event(name, step, worker_rank=rank, **record)
        for name, fields in extra_events.items():
            run_dir.event(name, decision.step, worker_rank=rank, **fields)


def test_one_line_per_agreed_decision_with_its_cause(tmp_path):
    run_dir = RunDir(tmp_path)
    tail = RunDirTail(tmp_path / EVENTS_FILE, since_time=0)
    lines = ConsoleLines(total_steps=60, every_s=5)
    spike = Finding("loss_spike", rank=0, value=512.25, threshold=6.125, step=40)
    run_dir.event("worker_group_start", 0, world_size=2, grad_accum=2, backend="gloo", device="cpu",
                  precision="fp8")
    write_decision(run_dir, SkipStep(step=40, evidence=(spike,)),
                   step_skipped={"reason": "loss_spike"})
    write_decision(run_dir, FallbackToBF16(step=41, evidence=(Finding("loss_spike", 0, 480.5, 6.0, 41),),
                                           until_step=61))
    write_decision(run_dir, Rollback(step=42, evidence=(Finding("loss_spike", 0, 470.0, 6.0, 42),), bad_step=42,
                                     skip_samples_window=16, lr_scale=0.5))
    for rank in (0, 1):  # written after the restore, at the step restored (training/decisions.py)
        run_dir.event("rollback", 30, worker_rank=rank, to_step=30, from_step=42, skipped_samples=120,
                      skipped_range=[240, 360], lr_scale=0.5)
    write_decision(run_dir, RetryFP8(step=61))
    run_dir.event("checkpoint_failed", 50, checkpoint_step=50, error="OSError: [Errno 28] No space left on device",
                  out_of_space=True)
    run_dir.event("worker_lost", 20, previous_world_size=2, world_size=1, worker_rank=0)
    run_dir.event("resume", 20, from_step=20, world_size=1, downtime_s=41.26, origin="restart")
    run_dir.event("workers_added", 40, previous_world_size=1, world_size=2)
    run_dir.event("eval_gap_exceeded", 50, worker_rank=0, eval_loss_fp8=2.5, eval_loss_bf16=2.0, rel_gap=0.25,
                  threshold=0.05)
    run_dir.event("checkpoint_saved", 50, path="x", good=True)  # routine: no line

    printed = [line for record in tail.read() if (line := lines.event(record)) is not None]
    assert printed == [
        "[event] step 0: 2 workers started (gloo on cpu, fp8, grad accumulation 2)",
        "[event] step 40: update skipped (loss_spike 512.2 > 6.125 on rank 0)",
        ("[event] step 41: FP8 -> BF16 for the whole model until step 61, update dropped (loss_spike 480.5 > 6 on "
         "rank 0)"),
        ("[event] step 42: rolled back to step 30 (loss_spike 470 > 6 on rank 0); 120 samples skipped [240, 360), "
         "learning rate x0.5"),
        "[event] step 61: BF16 -> FP8 again for the whole model",
        "[event] step 50: checkpoint of step 50 failed: OSError: [Errno 28] No space left on device",
        "[event] step 20: a worker was lost: restarted with 1 workers (was 2)",
        "[event] step 20: restarted from checkpoint step 20 on 1 workers, 41.3 s after the last step",
        "[event] step 40: resized: 1 -> 2 workers",
        "[event] step 50: eval FP8/BF16 gap +25.00% over the limit 5.00% (FP8 2.5000, BF16 2.0000)",
    ]


def metrics(step: int, t: float, **extra) -> dict:
    return {"step": step, "loss": 5.0 - step / 100, "tokens_per_s": 2048.0, "step_time_s": 0.5, "world_size": 2,
            "precision": "fp8", "time": t, **extra}


def test_progress_first_line_at_the_first_step_then_paced_with_seconds_per_step_and_eta():
    lines = ConsoleLines(total_steps=100, every_s=5)
    # step 1 ends at t=1000 after 0.5 s: a line at once, timed by its own step time
    assert lines.metrics(metrics(1, 1000.0), now=1000.1) == [
        "[progress] step      1/100  loss 4.9900  0.50 s/step  ETA 50 s  tok/s 2,048  world 2  fp8"]
    assert lines.metrics(metrics(2, 1002.0), now=1002.1) == []  # 2 s later: not yet
    # 10 steps in the 20 s since the last line: 2 s a step, 89 steps left
    out = lines.metrics(metrics(11, 1020.0, eval_loss=4.5, eval_loss_bf16=4.4, eval_gap=0.0227), now=1020.2)
    assert out == ["[event] step 11: eval loss 4.5000 (BF16 4.4000, FP8/BF16 gap +2.27%)",
                   "[progress] step     11/100  loss 4.8900  2.00 s/step  ETA 2m58s  tok/s 2,048  world 2  fp8"]
    # a rollback back to step 5: timed again from there, not across the jump
    assert lines.metrics(metrics(6, 1030.0), now=1030.1) == [
        "[progress] step      6/100  loss 4.9400  0.50 s/step  ETA 47 s  tok/s 2,048  world 2  fp8"]
    assert lines.last(metrics(6, 1030.0), now=1031.0) is None  # printed already
    assert lines.last(metrics(7, 1031.0), now=1031.5).startswith("[progress] step      7/100  loss 4.9300  1.00 s/step")


def test_tail_returns_complete_new_lines_once_and_follows_a_replaced_file(tmp_path):
    path = tmp_path / METRICS_FILE
    tail = RunDirTail(path, since_time=100.0)
    assert tail.read() == []  # not written yet
    with open(path, "w") as f:
        f.write(json.dumps({"step": 0, "time": 50.0}) + "\n")  # an earlier start's line
        f.write(json.dumps({"step": 1, "time": 101.0}) + "\n" + '{"step": 2, "ti')  # the last line half written
    assert [r["step"] for r in tail.read()] == [1]
    with open(path, "a") as f:
        f.write('me": 102.0}\n')
    assert [r["step"] for r in tail.read()] == [2]
    assert tail.read() == []
    # a resume rewrites the file without the steps it trains again, then appends
    tmp = tmp_path / "rewrite"
    tmp.write_text("".join(json.dumps({"step": s, "time": t}) + "\n" for s, t in ((0, 50.0), (1, 101.0))))
    os.replace(tmp, path)
    with open(path, "a") as f:
        f.write(json.dumps({"step": 2, "time": 110.0}) + "\n")
    assert [(r["step"], r["time"]) for r in tail.read()] == [(2, 110.0)]


def test_tail_keeps_lines_of_concurrent_writers_whose_times_are_out_of_order(tmp_path):
    """Each worker appends its own copy of a decision: worker 1's line can land first with a later time."""
    tail = RunDirTail(tmp_path / EVENTS_FILE, since_time=100.0)
    lines = (("divergence_detected", 1, 200.5), ("divergence_detected", 0, 200.4), ("step_skipped", 1, 200.6),
             ("step_skipped", 0, 200.45))
    fields = {"step": 7, "rank": 0, "detector": "loss_spike", "value": 9.0, "threshold": 4.0, "reason": "loss_spike"}
    (tmp_path / EVENTS_FILE).write_text("".join(
        json.dumps({"time": t, "event": name, "worker_rank": rank, **fields}) + "\n" for name, rank, t in lines))
    records = tail.read()
    assert [(r["event"], r["worker_rank"]) for r in records] == [(n, rank) for n, rank, _ in lines]
    console = ConsoleLines(total_steps=10, every_s=5)
    assert [line for r in records if (line := console.event(r))] == [
        "[event] step 7: update skipped (loss_spike 9 > 4 on rank 0)"]


def test_duration():
    assert [duration(s) for s in (0, 59.4, 60, 245, 3599, 7380)] == ["0 s", "59 s", "1m00s", "4m05s", "59m59s",
                                                                     "2h03m"]


PREEMPTION_WATCHER_LINE = (
    "[2026-12-06 19:55:51,280 E 19182 19300] core_worker.cc:2465: Actor with class name: 'PreemptionWatcher' and ID: "
    "'eec5f59563a5caab326a454601000000' has constructor arguments in the object store and max_restarts > 0. If the "
    "arguments in the object store go out of scope or are lost, the actor restart will fail. See "
    "https://github.com/ray-project/ray/issues/53727 for more details.")


def test_forwarded_noise_is_dropped_and_real_errors_kept():
    """Ray's own dispatcher of forwarded worker lines, with the driver's filter installed on its print handler."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher

    from orchestration.driver.ray_logs import filter_forwarded_output

    printed: list[dict] = []
    dispatcher.add_handler("ray_print_logs", printed.append)
    try:
        assert filter_forwarded_output()
        assert filter_forwarded_output()  # installed once
        error = ("[2026-12-06 19:55:51,280 E 19182 19300] core_worker.cc:2465: Actor with class name: 'Other' died: "
                 "out of memory")
        dispatcher.emit({"lines": [PREEMPTION_WATCHER_LINE, error], "pid": 1, "is_err": True})
        dispatcher.emit({"lines": [PREEMPTION_WATCHER_LINE], "pid": 1, "is_err": True})  # nothing left to print
    finally:
        dispatcher.remove_handler("ray_print_logs")
    assert [d["lines"] for d in printed] == [[error]]


def test_ray_trains_start_timeout_warning_is_a_debug_record_without_traceback():
    """Ray Train's own client, its coordinator not answering (a loaded machine at the start): the record it logs with
    a traceback reaches no console handler once a job process ran the setup hook's quieting; other warnings do."""
    import logging

    from ray.train import ScalingConfig
    from ray.train.v2._internal.execution.scaling_policy import autoscaling_coordinator_client as client_module

    from orchestration.driver.ray_logs import quiet_harmless_ray_train_records

    class Unanswered:
        class request_resources:  # an actor method's shape: .remote(...)
            @staticmethod
            def remote(**kwargs):
                raise TimeoutError("Get timed out: some object(s) not ready.")

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    client_module.logger.addHandler(handler)
    try:
        quiet_harmless_ray_train_records()
        client = client_module.TrainAutoscalingCoordinatorClient("train-run")
        client.__dict__["_autoscaling_coordinator"] = Unanswered()
        client.send_resource_request(ScalingConfig(num_workers=2), 2)
        assert not [r for r in records if r.levelno >= logging.WARNING]
        client_module.logger.warning("another warning")
    finally:
        client_module.logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["another warning"]
