#!/usr/bin/env bash
# Creates the project's virtual environment without ever pulling CUDA wheels onto a CPU-only machine.
# Usage: tools/setup_venv.sh VENV_DIR [EXTRAS]
#   EXTRAS: the project's extras to install on top of its dependencies (default: dev).
#   `make demo` asks for `demo` (what the demo imports), `make test` for `dev` (demo's plus pytest, ...).
set -euo pipefail
venv=${1:-.venv}
extras=${2:-dev}
# The interpreter's own path, asked once: a pyenv-style shim costs a fraction of a second per call.
python=$("${PYTHON:-python3}" -c 'import sys; print(sys.executable)')

# A venv made with pip in it spends seconds in ensurepip (which byte-compiles pip); pip >= 22.3 of the
# base interpreter can install into a venv without pip (--python), and puts the pip ensurepip would
# have put there in with everything else.
if [ ! -x "$venv/bin/python" ]; then
    if "$python" -c 'import sys, pip; sys.exit(tuple(map(int, pip.__version__.split(".")[:2])) < (22, 3))' 2>/dev/null; then
        "$python" -m venv --without-pip "$venv"
    else
        "$python" -m venv "$venv"
    fi
fi
# torch comes with numpy (torch imports it when present, so does towerflow) and setuptools (which
# builds the project in place below, without an isolated build environment to set up).
first=(numpy "setuptools>=77.0.3")  # 77.0.3: the SPDX `license` string of pyproject.toml
if "$venv/bin/python" -m pip --version >/dev/null 2>&1; then
    pip=("$venv/bin/python" -m pip --disable-pip-version-check)
else
    pip=("$python" -m pip --python "$venv/bin/python" --disable-pip-version-check)
    first+=("$("$python" -c 'import ensurepip; print("pip==" + ensurepip.version())' 2>/dev/null || echo pip)")
fi

# Every install is --no-compile: pip byte-compiles each file it installs, one at a time, and torch
# alone has thousands that nothing here imports (the end of this script compiles what is imported).
if present=$("$venv/bin/python" -c "import torch; print(torch.__version__)" 2>/dev/null); then
    echo "setup: torch $present already present"
    "${pip[@]}" install -q --no-compile "${first[@]}"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found, installing torch with CUDA"
    "${pip[@]}" install -q --no-compile "torch>=2.4" "${first[@]}"
else
    # CPU-only machine: the pinned CPU build. Check first that the resolver would not bring CUDA
    # packages, then install exactly what it chose (no second resolver run).
    report=$(mktemp)
    "${pip[@]}" install -q --dry-run --ignore-installed --report "$report" torch==2.13.0 "${first[@]}"
    if grep -q '"name": "nvidia-' "$report"; then
        index=${TOWERFLOW_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
        echo "setup: no GPU here and the default torch wheel needs CUDA packages; using the CPU index $index"
        "${pip[@]}" install -q --no-compile torch==2.13.0 --index-url "$index"
        "${pip[@]}" install -q --no-compile "${first[@]}"
    else
        echo "setup: no GPU here, installing the CPU build of torch 2.13.0"
        chosen=()
        while IFS= read -r url; do chosen+=("$url"); done < <("$venv/bin/python" -c '
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    info = item["download_info"]
    sha256 = info.get("archive_info", {}).get("hashes", {}).get("sha256")
    print(info["url"] + (f"#sha256={sha256}" if sha256 else ""))' "$report")
        "${pip[@]}" install -q --no-compile --no-deps "${chosen[@]}"
    fi
    rm -f "$report"
fi

# What the demo imports gets compiled by importing it once, with bytecode writing on
# (PYTHONDONTWRITEBYTECODE would leave every task compiling it again); an optimizer's first
# construction imports torch._dynamo, so one is built. Failing here only costs time.
warm() {
    local log
    log=$(mktemp)
    env -u PYTHONDONTWRITEBYTECODE "$venv/bin/python" -W ignore -c "$1" >"$log" 2>&1 \
        || { echo "setup: byte-compiling ($1) failed; the demo will compile on the fly:"; cat "$log"; }
    rm -f "$log"
}

# Then the project and its extras, while the other core compiles what every task imports (torch and
# towerflow, from src/ where the editable install points); then what the report is drawn with.
(export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
 warm "import torch, towerflow, towerflow.demos.cluster_digits; torch.optim.Adam([torch.zeros(1, requires_grad=True)])") &
"${pip[@]}" install -q --no-compile --no-build-isolation -e ".[$extras]"
warm "import matplotlib; matplotlib.use('Agg'); import matplotlib.pyplot"
wait $!

# The tests import much more of torch and the rest: compile all of the venv, on every core. A few
# files are for other Python versions and do not compile; pip's own compile skips them the same way.
case ",$extras," in
    *,dev,*)
        site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        env -u PYTHONDONTWRITEBYTECODE "$venv/bin/python" -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true ;;
esac
