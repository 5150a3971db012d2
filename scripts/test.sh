#!/usr/bin/env bash
# Installs (if needed) and runs the default test suite: unit + integration, no slow tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -m "not slow" "$@"
