"""BENCHMARKS.md cites only result files that are in benchmarks/results/: a figure whose file is gone must say so
(and name the commit that holds it) instead of pointing at a file a reader cannot open."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"

# A result file is cited by its name, with or without the results/ folder; `<name>.json` is the runner's pattern.
_CITED_JSON = re.compile(r"(?<![\w<>.-])([A-Za-z0-9_]+\.json)\b")


def cited_result_files(text: str) -> set[str]:
    """Every `X.json` file name the text mentions."""
    return set(_CITED_JSON.findall(text))


def test_citation_pattern_finds_bare_and_folder_names_and_skips_the_runner_pattern():
    text = ("`make bench-gpu SUITE=dense` (`results/train_step_dense.json`, `train_step_moe.json`; "
            "writes `benchmarks/results/<name>.json`), MoE fp8 (quality_moe.json) -0.01 %")
    assert cited_result_files(text) == {"train_step_dense.json", "train_step_moe.json", "quality_moe.json"}


def test_every_result_file_benchmarks_md_cites_exists():
    cited = cited_result_files((REPO / "BENCHMARKS.md").read_text())
    assert len(cited) >= 10  # the document cites the current runs; an empty match would prove nothing
    missing = sorted(name for name in cited if not (RESULTS / name).is_file())
    assert not missing, f"BENCHMARKS.md cites result files not in benchmarks/results/: {missing}"
