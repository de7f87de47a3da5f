# Sourced by the device scripts that run the product loop (benchmarks/worker_throughput.py) from the repository root:
# installs the carried hydra/omegaconf wheels (.whl) into /tmp/site, sets PYTHONPATH, and picks ROOT, the run root:
# /dev/shm when it has room (checkpoints of 8B-width runs are tens of GB), else /tmp.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ROOT=/tmp/wt; avail=$(df --output=avail -k /dev/shm | tail -1); [ "${avail:-0}" -gt 62000000 ] && ROOT=/dev/shm/wt
