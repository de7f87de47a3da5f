# Commands (README): make setup | make train | make test
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-12)
# Never let pip resolve torch unpinned: that pulls a multi-GB CUDA build. 2.13.0 is the CPU wheel on disk.
TORCH_PIN ?= torch==2.13.0

.PHONY: setup system-tools train test test-churn lint clean monitor

# The Python environment only: no system package is installed or changed by `make setup` or `make train`.
setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q "$(TORCH_PIN)" -e ".[dev]"
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

# Programs that `make monitor` and the dashboard tests (`make test`) run besides Python: Prometheus (scrapes Ray's
# metrics) and headless Chromium (renders the Ray dashboard). Only those targets install them, only when missing,
# and only as root with apt-get: --no-install-recommends, nothing upgraded but what the missing packages depend on,
# which is listed before it happens. Elsewhere a message says what to install.
SYSTEM_TOOLS := prometheus chromium

system-tools:
	@missing=""; for tool in $(SYSTEM_TOOLS); do command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "make $(MAKECMDGOALS) needs$$missing: apt-get install --no-install-recommends$$missing (system packages)"; \
		apt-get update -qq || exit 1; \
		upgrades=$$(apt-get install -s --no-install-recommends$$missing | awk '/^Inst .*\[/ {print $$2}' | xargs); \
		if [ -n "$$upgrades" ]; then echo "apt-get also upgrades, as$$missing requires: $$upgrades"; fi; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends$$missing; \
	else \
		echo "warning: missing$$missing (Debian/Ubuntu: sudo apt-get install --no-install-recommends$$missing);" \
			"make monitor and tests/test_dashboard_*.py need them" >&2; \
	fi

train: setup
	$(BIN)/python launch.py $(ARGS)

# Prometheus on 127.0.0.1:9090 scraping one run's Ray cluster until Ctrl-C: RUN=<run name or directory>, by default
# the newest run under runs/ (orchestration/observability/prometheus.py; MONITOR_ARGS="--port 9091" and so on).
monitor: setup system-tools
	$(BIN)/python -m orchestration.observability.prometheus $(if $(RUN),--run "$(RUN)") $(MONITOR_ARGS)

test: setup system-tools
	$(BIN)/python -m pytest -q -ra --durations=20 tests $(PYTEST_ARGS)

# Spot nodes joining and leaving an autoscaled cluster on this machine for over ten minutes (tests/test_autoscale_churn.py,
# part of `make test` too), alone and with its figures printed.
test-churn: setup
	$(BIN)/python -m pytest -q -s -ra -m churn tests/test_autoscale_churn.py $(PYTEST_ARGS)

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
