#!/usr/bin/env bash
# The main job (README): set up, write the tiny checkpoint, serve it with stock SGLang + this
# plugin on whatever this machine has, and show a completion.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python examples/serve_tiny.py "$@"
