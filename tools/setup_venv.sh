#!/usr/bin/env bash
# Creates the project's virtual environment without ever pulling CUDA wheels onto a CPU-only machine.
# Usage: tools/setup_venv.sh VENV_DIR
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)

if "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "setup: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)') already present"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found, installing torch with CUDA"
    "${pip[@]}" install -q "torch>=2.4"
else
    # CPU-only machine: the pinned CPU build. Check first that the resolver would not bring CUDA packages.
    report=$(mktemp)
    "${pip[@]}" install -q --dry-run --ignore-installed --report "$report" torch==2.13.0
    if grep -q '"name": "nvidia-' "$report"; then
        index=${TOWERFLOW_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
        echo "setup: no GPU here and the default torch wheel needs CUDA packages; using the CPU index $index"
        "${pip[@]}" install -q torch==2.13.0 --index-url "$index"
    else
        echo "setup: no GPU here, installing the CPU build of torch 2.13.0"
        "${pip[@]}" install -q torch==2.13.0
    fi
    rm -f "$report"
fi
"${pip[@]}" install -q -e ".[dev]"
