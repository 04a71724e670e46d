#!/usr/bin/env bash
# The checks a change must pass: lint, strict typing of the package, and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check src tests
"$PY" -m ruff format --check src tests
"$PY" -m mypy
"$PY" -m pytest -q "$@"
