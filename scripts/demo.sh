#!/usr/bin/env bash
# Installs (if needed) and runs the main job: the node-runtime demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/dsec demo "$@"
