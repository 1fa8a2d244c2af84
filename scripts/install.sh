#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Install nextn-runtime into the active Python environment (`make serve`, `make test`,
# `make lint` and `.ci/run` call this; run it by hand the same way):
#
#   bash scripts/install.sh serve    # torch, then the package (editable)
#   bash scripts/install.sh test     # torch, then the package with the `test` extra
#   bash scripts/install.sh lint     # ruff
#
# torch comes first so that pip never pulls a CUDA build onto a machine without CUDA: an
# installed torch (any build) is left alone; without one, a CUDA machine (`nvidia-smi -L`
# lists a GPU) gets pip's default build, any other machine $TORCH_CPU_SPEC
# (torch==2.13.0, which this project's package index serves as the CPU build; where the
# index serves CUDA builds under that name, point $TORCH_CPU_PIP_ARGS at a CPU wheel index).
#
# Rerunning is safe and quick: a step is skipped while its stamp (per Python environment,
# per extra, per content of setup.py) is present and `runtime` imports from this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."

what=${1:?usage: bash scripts/install.sh serve|test|lint}
python=${PYTHON:-python}
torch_cpu_spec=${TORCH_CPU_SPEC:-torch==2.13.0}
ruff_spec=${RUFF_SPEC:-ruff>=0.6}  # a developer tool, not a dependency of the package
pip=("$python" -m pip install --quiet)

install_torch() {
    if "$python" -c "import torch" 2>/dev/null; then
        return
    fi
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "install: torch (CUDA present: pip's default build)"
        "${pip[@]}" torch
    else
        echo "install: $torch_cpu_spec (no CUDA: the CPU build)"
        # shellcheck disable=SC2086  # extra pip flags are a list
        "${pip[@]}" ${TORCH_CPU_PIP_ARGS:-} "$torch_cpu_spec"
    fi
}

# A stamp names the Python environment, the extra and the content of setup.py.
stamp_for() {
    "$python" - "$1" <<'EOF'
import hashlib, pathlib, sys
key = "|".join([sys.prefix, sys.argv[1], pathlib.Path("setup.py").read_text()])
print(pathlib.Path(".install-stamps") / hashlib.sha256(key.encode()).hexdigest()[:16])
EOF
}

# True when `runtime` imports from this checkout with the working directory elsewhere, i.e.
# the editable install points here and not at another clone.
runtime_is_here() {
    local found
    found=$(cd / && "$python" -c "import runtime, os; print(os.path.dirname(runtime.__file__))" \
        2>/dev/null) || return 1
    [ "$found" = "$PWD/runtime" ]
}

install_package() {  # $1: pip target, $2: stamp name
    local stamp
    stamp=$(stamp_for "$2")
    if [ -f "$stamp" ] && runtime_is_here; then
        echo "install: $1 is up to date"
        return
    fi
    echo "install: $1"
    "${pip[@]}" -e "$1"
    mkdir -p "$(dirname "$stamp")"
    touch "$stamp"
}

case "$what" in
    serve) install_torch && install_package "." serve ;;
    test) install_torch && install_package ".[test]" test ;;
    lint)
        if "$python" -m ruff --version >/dev/null 2>&1; then
            echo "install: ruff is installed"
        else
            echo "install: $ruff_spec"
            "${pip[@]}" "$ruff_spec"
        fi
        ;;
    *)
        echo "usage: bash scripts/install.sh serve|test|lint" >&2
        exit 2
        ;;
esac
