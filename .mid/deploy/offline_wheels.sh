#!/usr/bin/env bash
# Install the project's Python dependencies on a GPU machine that has no network, from wheels carried to it.
#
# Air-gapped GPU images usually hold torch, triton, numpy, pyarrow, aiohttp and the like, but not Ray, Hydra or
# their small helpers. Transfers to such machines are often size-limited per copy (64 MiB where this was built),
# and the Ray wheel alone is 79 MB, so large wheels are split into parts that can travel in separate copies.
#
#   deploy/offline_wheels.sh download DIR [PART_MB]  # on a machine with pip access: wheels for CPython 3.12 x86-64,
#                                                   # minus what a CUDA PyTorch image already has; wheels larger
#                                                   # than PART_MB (default 39) are split into DIR/parts/
#   deploy/offline_wheels.sh install DIR TARGET     # on the GPU machine: rejoin split wheels, pip install --target
#                                                   # TARGET (then export PYTHONPATH=TARGET)
#   deploy/offline_wheels.sh stage DIR STAGE        # copy what DIR holds into STAGE (e.g. /tmp) so a later copy
#                                                   # can bring the remaining parts
#
# W&B is left out of the default list (its wheels are 25 MB more): fetch them into a directory of their own with
# PACKAGES="wandb==0.31.0" and install it in its own copy, or run with logging.wandb=false. PACKAGES="name==version
# ..." replaces the list below (make bench-wheels: what the GPU benchmarks need); PIP names the pip to run (default
# python3 -m pip).
set -euo pipefail

# Packages the project needs beyond a CUDA PyTorch image (torch, triton, numpy, pyyaml, aiohttp, grpcio, pyarrow,
# prometheus_client, tokenizers and matplotlib are there). Versions match pyproject.toml.
read -r -a REQUIREMENTS <<< "${PACKAGES:-ray[default,train]==2.60.0 hydra-core==1.3.8 omegaconf==2.3.1}"
read -r -a PIP_CMD <<< "${PIP:-python3 -m pip}"
# Already in the image: downloading them again would only pin different versions over the image's own.
IN_IMAGE='^(aiohappyeyeballs|aiohttp|aiosignal|attrs|certifi|charset_normalizer|click|filelock|frozenlist|fsspec|grpcio|idna|msgpack|multidict|numpy|packaging|pandas|prometheus_client|propcache|protobuf|pyarrow|python_dateutil|pyyaml|requests|six|typing_extensions|urllib3|wrapt|yarl|py_spy)-'
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

download() {
    local dir=$1 part_mb=${2:-39}
    mkdir -p "$dir/parts"
    local all; all=$(mktemp -d)
    # hydra-core pins antlr4-python3-runtime 4.9.*, published only as an sdist: build its (pure Python) wheel here.
    "${PIP_CMD[@]}" wheel -q --no-deps -w "$all" "antlr4-python3-runtime==4.9.3"
    "${PIP_CMD[@]}" download -q --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
        --find-links "$all" -d "$all" "${REQUIREMENTS[@]}"
    local f name
    for f in "$all"/*.whl; do
        name=$(basename "$f")
        if [[ $name =~ $IN_IMAGE ]]; then continue; fi
        if [ "$(stat -c %s "$f")" -gt $((part_mb * 1024 * 1024)) ]; then
            split -b "${part_mb}M" -d "$f" "$dir/parts/$name.part"
        else
            cp "$f" "$dir/"
        fi
    done
    rm -rf "$all"
    echo "wheels in $dir ($(du -sh "$dir" | cut -f1)); split parts: $(ls "$dir/parts" | wc -l)"
}

stage() {
    local dir=$1 stage_dir=$2
    mkdir -p "$stage_dir/parts"
    cp -r "$dir"/. "$stage_dir/"
}

install() {
    local dir=$1 target=$2
    local joined; joined=$(mktemp -d)
    cp "$dir"/*.whl "$joined/" 2>/dev/null || true
    local first whl
    for first in "$dir"/parts/*.part00; do
        [ -e "$first" ] || continue
        whl=$(basename "${first%.part00}")
        cat "${first%00}"* > "$joined/$whl"
        python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).testzip()" "$joined/$whl" \
            || { echo "error: $whl is incomplete: bring every part of it into $dir/parts" >&2; exit 2; }
    done
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" \
        "$joined"/*.whl
    rm -rf "$joined"
    echo "installed into $target: export PYTHONPATH=$target"
}

case "${1:-}" in
    download) shift; download "$@" ;;
    stage) shift; stage "$@" ;;
    install) shift; install "$@" ;;
    *) sed -n '2,19p' "$0"; exit 2 ;;
esac
