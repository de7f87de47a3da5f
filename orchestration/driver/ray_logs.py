"""Ray Train log records that reach the user's console at shutdown but report nothing wrong with the run.

Installed in every process of the job (the TrainController actor included) as Ray's worker_process_setup_hook.
"""

from __future__ import annotations

import logging

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


def quiet_ray_train_shutdown() -> None:
    import importlib.util

    spec = importlib.util.find_spec(REPORT_LOGGER_MODULE)
    if spec is not None and spec.origin:
        logging.getLogger(spec.origin).setLevel(logging.WARNING)
    for name, prefix in HARMLESS_AT_SHUTDOWN.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, DebugLevel) for f in logger.filters):
            logger.addFilter(DebugLevel(prefix))
    from orchestration.training.distributed import keep_store_on_loopback

    keep_store_on_loopback()  # not a log matter: this hook is the one code every worker runs before Ray's rendezvous
