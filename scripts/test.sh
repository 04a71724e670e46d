#!/usr/bin/env bash
# The checks a change must pass: lint, strict typing of the package, the test suite (which runs
# every python example of the README and docs/), and the docs site, built with --strict so that a
# broken link or anchor fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m ruff check src tests
"$PY" -m ruff format --check src tests
"$PY" -m mypy
"$PY" -m pytest -q "$@"
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
"$PY" -m mkdocs build --strict --quiet --site-dir "$site"
