"""Every process of a job on Ray (the TrainController actor, its PlacementGroupCleaner, Ray Train's state actor and the
workers): `prepare_worker_process` is Ray's worker_process_setup_hook. It points Ray's State API at this cluster and
keeps Ray Train's harmless shutdown records off the user's console.
"""

from __future__ import annotations

import logging
import os

# At the end of a run the controller stops its PlacementGroupCleaner actor with a timeout, and on a loaded machine
# the stop outlives it: Ray logs the GetTimeoutError with a ~30-line traceback, then the cleaner says its monitor
# thread did not exit in time. The controller has finished by then and removes the placement group itself; the
# cleaner only matters when the controller dies ungracefully. Both become debug records.
HARMLESS_AT_SHUTDOWN = {
    "ray.train.v2._internal.callbacks.placement_group_callback": "Failed to stop PlacementGroupCleaner gracefully",
    "ray.train.v2._internal.execution.controller.placement_group_cleaner": "Monitor thread did not exit within",
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
    pin_state_api_to_this_cluster()
    quiet_ray_train_shutdown()


def pin_state_api_to_this_cluster() -> None:
    """Ray Train's PlacementGroupCleaner and state actor ask the State API whether the controller is alive, with no
    address: Ray then looks for a cluster on the machine and, with two clusters on one host (another user's, or
    another job's), raises "Found multiple active Ray instances" in their monitor threads (a traceback in the
    console per check; the cleaner's thread dies of it). RAY_ADDRESS, read first by that lookup, names the cluster
    this process belongs to."""
    import ray

    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address


def quiet_ray_train_shutdown() -> None:
    import importlib.util

    spec = importlib.util.find_spec(REPORT_LOGGER_MODULE)
    if spec is not None and spec.origin:
        logging.getLogger(spec.origin).setLevel(logging.WARNING)
    for name, prefix in HARMLESS_AT_SHUTDOWN.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DebugLevel) for f in logger.filters):
            logger.addFilter(DebugLevel(prefix))
