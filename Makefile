# Commands (README): make setup | make train | make test
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-12)
# Never let pip resolve torch unpinned: that pulls a multi-GB CUDA build. 2.13.0 is the CPU wheel on disk.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup system-tools train test lint clean monitor

setup: $(STAMP) system-tools

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q "$(TORCH_PIN)" -e ".[dev]"
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

# Programs the dashboard tests and `make monitor` run besides Python: Prometheus (scrapes Ray's metrics) and headless
# Chromium (renders the Ray dashboard). Installed with apt-get when missing and run as root (CI); otherwise a message
# says what to install.
SYSTEM_TOOLS := prometheus chromium

system-tools:
	@missing=""; for tool in $(SYSTEM_TOOLS); do command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing$$missing with apt-get"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq$$missing; \
	else \
		echo "warning: missing$$missing (Debian/Ubuntu: sudo apt-get install -y$$missing); make monitor and" \
			"tests/test_dashboard_*.py need them" >&2; \
	fi

train: setup
	$(BIN)/python launch.py $(ARGS)

# Prometheus on 127.0.0.1:9090 scraping the newest local Ray session's metrics targets, until Ctrl-C
# (orchestration/observability/prometheus.py; MONITOR_ARGS="--port 9091 --data-dir /tmp/prom" and so on).
monitor: setup
	$(BIN)/python -m orchestration.observability.prometheus $(MONITOR_ARGS)

test: setup
	$(BIN)/python -m pytest -q -ra --durations=20 tests $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check .

clean:
	rm -rf runs outputs .pytest_cache

# GPU benchmarks (BENCHMARKS.md): run on the GPU machine's own Python, which has torch and triton; what it lacks
# comes from the wheels in .whl/ (make bench-wheels, here). One JSON per benchmark lands in benchmarks/results/.
SUITE ?= all
BENCH_PY ?= python3

.PHONY: bench-gpu bench-wheels

bench-gpu:
	$(BENCH_PY) benchmarks/run_suite.py $(SUITE) $(BENCH_ARGS)

bench-wheels: $(STAMP)
	PACKAGES="torchao==0.18.0 hydra-core==1.3.8 omegaconf==2.3.1" PIP="$(BIN)/python -m pip" \
		bash deploy/offline_wheels.sh download .whl
