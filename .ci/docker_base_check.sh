#!/usr/bin/env bash
# Stands in for `docker build` and a run of the image, on machines without a Docker engine.
#
# A fresh virtual environment gets exactly the torch and torchvision the Dockerfile's base image ships (its
# `ARG TORCH=` / `ARG TORCHVISION=` lines, the one place those versions are written), from PyPI. Then the
# Dockerfile's own install instruction (its `RUN` lines, run verbatim with the ARGs as variables) installs the
# package from a copy of what the Dockerfile COPYs, so pip resolves everything else as the image build would.
# Then: import the package, run the fast tests on it and `loko fit --config configs/debug.yaml` in a scratch
# working directory, offline.
#
#   .ci/docker_base_check.sh            the base image's torch/torchvision, newest everything else (CI runs this)
#   .ci/docker_base_check.sh --oldest   the oldest supported set: every dependency pinned to its pyproject floor
#
# Environment: BASE_CHECK_PYTEST_ARGS (pytest arguments, split on spaces; default: -m "not slow" without
# tests/test_readme.py and tests/test_benchmarks.py), BASE_CHECK_KEEP=1 keeps the scratch directory (venv included,
# several GB) for a look afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

MODE=image
case "${1:-}" in
    "") ;;
    --oldest) MODE=oldest ;;
    *) echo "usage: $0 [--oldest]" >&2; exit 2 ;;
esac

arg() {  # the default of `ARG NAME=value` in the Dockerfile
    local value
    value=$(sed -n "s/^ARG $1=\([^[:space:]]*\).*$/\1/p" Dockerfile | head -n 1)
    [ -n "$value" ] || { echo "Dockerfile has no 'ARG $1=...' line" >&2; exit 2; }
    printf '%s\n' "$value"
}
TORCH=$(arg TORCH)
TORCHVISION=$(arg TORCHVISION)
CUDA=$(arg CUDA)
PYTHON=$(arg PYTHON)
export TORCH TORCHVISION CUDA PYTHON
BASE_IMAGE=$(sed -n 's/^FROM[[:space:]]\+\([^[:space:]]*\).*$/\1/p' Dockerfile | head -n 1)
BASE_IMAGE=${BASE_IMAGE//\$\{TORCH\}/$TORCH}
BASE_IMAGE=${BASE_IMAGE//\$\{CUDA\}/$CUDA}

# The image's interpreter version: a venv on another Python would resolve other wheels.
INTERPRETER=$(command -v "python$PYTHON" || true)
if [ -z "$INTERPRETER" ]; then
    echo "python$PYTHON (the base image's Python) is not on PATH" >&2
    exit 2
fi

SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/loko-base-check.XXXXXX")
if [ "${BASE_CHECK_KEEP:-0}" = 1 ]; then
    echo "keeping $SCRATCH"
else
    trap 'rm -rf "$SCRATCH"' EXIT
fi
SECONDS=0
step() { printf '== [%4ds] %s\n' "$SECONDS" "$*"; }

step "base image $BASE_IMAGE: torch $TORCH, torchvision $TORCHVISION, Python $PYTHON, CUDA $CUDA ($MODE)"
"$INTERPRETER" -m venv "$SCRATCH/venv"
# shellcheck disable=SC1091
source "$SCRATCH/venv/bin/activate"
python -m pip install -q --upgrade pip
export PIP_QUIET=1  # the import step below prints what was resolved; pip's errors still show

if [ "$MODE" = oldest ]; then
    # Every dependency of the package (runtime and extras) at its floor, as pip constraints (names only, no
    # extras), so the Dockerfile's install line below resolves to the oldest supported set.
    python - "$SCRATCH/constraints.txt" <<'EOF'
import re
import sys
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
requirements = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
pins = {}
for requirement in requirements:
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?>=([^,;\s]+)", requirement.strip())
    if match is None:
        sys.exit(f"no '>=' floor to pin in {requirement!r}")
    pins[match.group(1).lower()] = match.group(2)
open(sys.argv[1], "w").write("".join(f"{name}=={version}\n" for name, version in sorted(pins.items())))
EOF
    TORCH=$(sed -n 's/^torch==//p' "$SCRATCH/constraints.txt")
    TORCHVISION=$(sed -n 's/^torchvision==//p' "$SCRATCH/constraints.txt")
    export PIP_CONSTRAINT="$SCRATCH/constraints.txt"
    step "oldest supported set (pip constraints):"
    sed 's/^/    /' "$SCRATCH/constraints.txt"
fi

step "what the base image ships: torch==$TORCH torchvision==$TORCHVISION from PyPI"
python -m pip install -q "torch==$TORCH" "torchvision==$TORCHVISION"

# The Dockerfile's COPY sources, at the image's paths relative to a scratch root.
mkdir -p "$SCRATCH/opt/loko" "$SCRATCH/work"
sed -n 's/^COPY[[:space:]]\+//p' Dockerfile | while read -r -a words; do
    unset 'words[${#words[@]}-1]'
    for source in "${words[@]}"; do cp -r "$ROOT/$source" "$SCRATCH/opt/loko/"; done
done

# The Dockerfile's RUN instructions, joined across continuation lines and run as written (ARGs as variables).
RUN_LINES=$(awk '
    /^RUN / { run = 1; sub(/^RUN /, "") }
    run { line = line $0; if ($0 ~ /\\$/) { sub(/\\$/, "", line) } else { print line; line = ""; run = 0 } }
' Dockerfile)
[ -n "$RUN_LINES" ] || { echo "Dockerfile has no RUN instruction" >&2; exit 2; }
while IFS= read -r instruction; do
    step "Dockerfile: RUN $instruction"
    (cd "$SCRATCH/opt/loko" && bash -euo pipefail -c "$instruction") || {
        step "FAILED: the Dockerfile's RUN instruction with the base image's torch $TORCH (the build would stop here)"
        exit 1
    }
done <<<"$RUN_LINES"

step "import (outside the source tree)"
status=0
(cd "$SCRATCH/work" && python - <<'EOF'
import os
import sys

import lightning
import peft
import timm
import torch
import torchvision

import loko_lightning

assert "site-packages" in loko_lightning.__file__, loko_lightning.__file__
assert torch.__version__.split("+")[0] == os.environ["TORCH"], torch.__version__
assert torchvision.__version__.split("+")[0] == os.environ["TORCHVISION"], torchvision.__version__
versions = {m.__name__: m.__version__ for m in (torch, torchvision, lightning, timm, peft)}
try:
    import transformers

    versions["transformers"] = transformers.__version__
except ImportError:
    pass
print("   ", " ".join(f"{name}=={version}" for name, version in versions.items()), "| Python", sys.version.split()[0])
if torch.version.cuda != os.environ["CUDA"]:
    print(f"    note: this PyPI torch is a CUDA {torch.version.cuda} build; the image's is CUDA {os.environ['CUDA']}")
EOF
) || status=$?
if [ "$status" -ne 0 ]; then
    step "FAILED: importing the package with the base image's torch $TORCH"
    exit 1
fi
python -m pip check || true  # informational, as in .ci/run

step "test dependencies (the test extra, torch and torchvision kept)"
python - >"$SCRATCH/test-requirements.txt" <<'EOF'
import tomllib

print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]))
EOF
python -m pip install -q -r "$SCRATCH/test-requirements.txt" "torch==$TORCH" "torchvision==$TORCHVISION"

# `pytest` (not `python -m pytest`) puts tests/ on sys.path, not the repository root: the tests import the
# installed package, as in the image.
# The fast tests; the README's snippets and the benchmark scripts run in the main suite only (CI time).
PYTEST_ARGS=(-m "not slow" --ignore=tests/test_readme.py --ignore=tests/test_benchmarks.py)
if [ -n "${BASE_CHECK_PYTEST_ARGS:-}" ]; then read -r -a PYTEST_ARGS <<<"$BASE_CHECK_PYTEST_ARGS"; fi
step "tests: pytest -q ${PYTEST_ARGS[*]}"
pytest -q -p no:cacheprovider "${PYTEST_ARGS[@]}" || status=$?
if [ "$status" -ne 0 ]; then
    step "FAILED: the fast tests (pytest exit $status) with the base image's torch $TORCH"
    exit 1
fi

step "loko fit --config /opt/loko/configs/debug.yaml (offline, in a scratch /work)"
(cd "$SCRATCH/work" && \
    HF_HOME="$SCRATCH/cache/huggingface" LOKO_CACHE="$SCRATCH/cache/loko" HF_HUB_OFFLINE=1 \
    loko fit --config "$SCRATCH/opt/loko/configs/debug.yaml") || {
    step "FAILED: loko fit with the base image's torch $TORCH"
    exit 1
}

step "OK: $BASE_IMAGE ($MODE) installs, imports, passes the fast tests and runs loko fit"
