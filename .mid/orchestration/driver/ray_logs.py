"""What reaches the user's console from Ray: our lines and Ray's real errors, not records that report nothing wrong.

Every process of a job on Ray (the TrainController actor, its PlacementGroupCleaner, Ray Train's state actor and the
workers): `prepare_worker_process` is Ray's worker_process_setup_hook. It points Ray's State API at this cluster and
keeps Ray's harmless records of these processes off the console. In the driver, `filter_forwarded_output` drops
the forwarded lines that no setting in those processes can silence (a C++ core worker's log line).
"""

from __future__ import annotations

import logging
import os
import re
import warnings

# At the end of a run the controller stops its PlacementGroupCleaner actor with a timeout, and on a loaded machine
# the stop outlives it: Ray logs the GetTimeoutError with a ~30-line traceback, then the cleaner says its monitor
# thread did not exit in time. The controller has finished by then and removes the placement group itself; the
# cleaner only matters when the controller dies ungracefully. Both become debug records.
HARMLESS_AT_SHUTDOWN = {
    "ray.train.v2._internal.callbacks.placement_group_callback": "Failed to stop PlacementGroupCleaner gracefully",
    "ray.train.v2._internal.execution.controller.placement_group_cleaner": "Monitor thread did not exit within",
}
# At the start the controller asks Ray's autoscaling coordinator, an actor started for it a moment before, for the
# workers' resources and waits 5 s; on a loaded machine that actor is still starting, and Ray logs the timeout with a
# traceback (its message: safe to ignore when transient). The request is sent again every 20 s; the worker group
# starts either way. A debug record too.
HARMLESS_AT_START = {
    "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client":
        "Failed to send resource request for",
}


class DebugLevel(logging.Filter):
    """Turns records starting with `prefix` into debug records without their traceback."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(self.prefix):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            record.exc_info = record.exc_text = None
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


# Ray Train's worker logs "Reporting training result N: TrainingReport(...)" at INFO for every report of every rank,
# through a logger named by its file path (outside `ray.train`, so RunConfig's LoggingConfig does not reach it); the
# console shows the job's own progress line instead.
REPORT_LOGGER_MODULE = "ray.train.v2._internal.execution.context"


def prepare_worker_process() -> None:
    from orchestration.training.process_group import keep_store_on_loopback

    keep_store_on_loopback()  # not a log matter: this hook is the one code every worker runs before Ray's rendezvous
    pin_state_api_to_this_cluster()
    quiet_harmless_ray_train_records()
    # Ray Train's controller builds Ray Data's default ExecutionOptions, whose constructor warns about a parameter
    # that Ray itself passes; nothing in this job uses Ray Data.
    warnings.filterwarnings("ignore", message=r"`ExecutionOptions\.exclude_resources` is deprecated")


# Lines of the job's processes that Ray forwards to the driver and that report nothing wrong with the run.
FORWARDED_NOISE = (
    # Ray Train's controller starts its PreemptionWatcher actor with arguments in the object store and restarts
    # allowed; Ray's core worker logs at ERROR, on every run, that a restart would fail if those arguments were lost
    # (https://github.com/ray-project/ray/issues/53727). Nothing here loses them; a real failure logs its own error.
    re.compile(r"core_worker\.cc:\d+: Actor with class name: 'PreemptionWatcher' .* has constructor arguments in the "
               r"object store and max_restarts > 0"),
)


def is_forwarded_noise(line: str) -> bool:
    return any(pattern.search(line) for pattern in FORWARDED_NOISE)


def filter_forwarded_output() -> bool:
    """In the driver, after ray.init: the handler that prints the job's forwarded lines skips FORWARDED_NOISE.
    Ray has no public hook for this; returns False (nothing filtered) where its dispatcher is not as expected."""
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    handlers = getattr(dispatcher, "handlers", None)
    if not isinstance(handlers, list):
        return False

    def filtered(handle):
        def handle_kept(data: dict) -> None:
            lines = [line for line in data.get("lines", []) if not is_forwarded_noise(line)]
            if lines:
                handle({**data, "lines": lines})

        handle_kept.filters_noise = True
        return handle_kept

    replaced = False
    for i, (name, handle) in enumerate(list(handlers)):
        if name == "ray_print_logs" and not getattr(handle, "filters_noise", False):
            handlers[i] = (name, filtered(handle))
            replaced = True
    return replaced or any(getattr(h, "filters_noise", False) for _, h in handlers)


def pin_state_api_to_this_cluster() -> None:
    """Ray Train's PlacementGroupCleaner and state actor ask the State API whether the controller is alive, with no
    address: Ray then looks for a cluster on the machine and, with two clusters on one host (another user's, or
    another job's), raises "Found multiple active Ray instances" in their monitor threads (a traceback in the
    console per check; the cleaner's thread dies of it). RAY_ADDRESS, read first by that lookup, names the cluster
    this process belongs to."""
    import ray

    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address


def quiet_harmless_ray_train_records() -> None:
    import importlib.util

    spec = importlib.util.find_spec(REPORT_LOGGER_MODULE)
    if spec is not None and spec.origin:
        logging.getLogger(spec.origin).setLevel(logging.WARNING)
    for name, prefix in {**HARMLESS_AT_SHUTDOWN, **HARMLESS_AT_START}.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DebugLevel) for f in logger.filters):
            logger.addFilter(DebugLevel(prefix))
