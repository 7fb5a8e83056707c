#!/usr/bin/env bash
# One command that builds the environment the project runs and tests in: a venv at .venv with
# stock SGLang (pinned), this package (editable) and the test extras. Idempotent: a second run
# only re-installs the package itself.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
# This machine's pip config lists local wheel folders that lack most packages; pip warns about
# each one. Keep those lines out of the log, keep everything else (and pip's exit status).
quiet_pip() { "$VENV/bin/pip" "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }; }
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import sglang, sys; sys.exit(0 if sglang.__version__ == '0.5.23' else 1)" 2>/dev/null; then
  echo "[setup] installing sglang 0.5.23 and torch 2.14.1 (several minutes, ~11 GB)"
  quiet_pip install --progress-bar off -q "torch==2.14.1" "torchvision==0.29.1" "sglang==0.5.23"
fi
echo "[setup] installing sglang-dsv4-ascend (editable) with test extras"
quiet_pip install --progress-bar off -q -e ".[test]"
echo "[setup] done: $("$VENV/bin/python" -c 'import sglang, torch; print("sglang", sglang.__version__, "torch", torch.__version__)')"
