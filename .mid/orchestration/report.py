"""Command line of the run report (the report itself is orchestration/observability/report.py):

    python -m orchestration.report RUN_DIR [RUN_DIR ...] [--out OUT_DIR]
    python -m orchestration.report --gate BF16_RUN FP8_RUN [--max-rel-gap 0.01]   # FP8 quality gate
"""

import sys

from orchestration.observability.report import main

if __name__ == "__main__":
    sys.exit(main())
