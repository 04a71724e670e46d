#!/usr/bin/env bash
# Set up remat for development on a fresh machine: torch (the CPU build, pinned, so that no
# newer release with its CUDA packages is downloaded), then remat with its test and benchmark
# extras (the dev extra brings transformers, for the Hugging Face tests, and mkdocs, for the
# docs site), in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev,bench]"
