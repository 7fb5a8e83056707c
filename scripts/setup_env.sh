#!/usr/bin/env bash
# One command that builds the environment the project runs and tests in: a venv at .venv with
# stock SGLang (pinned), this package (editable) and the test extras. Idempotent: a second run
# only re-installs the package itself.
# Installs go through uv (from PyPI, into the venv): it resolves the same pinned versions as pip
# (checked: identical `pip freeze`) and lays down torch + SGLang's ~11 GB in about a minute where
# pip took 4-5 (measured on the 2-core CI machine kind): most of CI's setup time. If uv cannot be
# installed or fails, pip does the same installs.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
# This machine's pip config lists local wheel folders that lack most packages; pip warns about
# each one. Keep those lines out of the log, keep everything else (and pip's exit status).
quiet_pip() { "$VENV/bin/pip" "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }; }
install() {
  if [ -x "$VENV/bin/uv" ] && "$VENV/bin/uv" pip install --python "$VENV/bin/python" -q "$@"; then
    return 0
  fi
  [ -x "$VENV/bin/uv" ] && echo "[setup] uv failed; installing with pip"
  quiet_pip install --progress-bar off -q "$@"
}
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
if [ ! -x "$VENV/bin/uv" ]; then
  quiet_pip install --progress-bar off -q "uv==0.13.9" || echo "[setup] uv unavailable; installing with pip"
fi
if ! "$VENV/bin/python" -c "import sglang, sys; sys.exit(0 if sglang.__version__ == '0.5.23' else 1)" 2>/dev/null; then
  echo "[setup] installing sglang 0.5.23 and torch 2.14.1 (~11 GB; about a minute with uv)"
  install "torch==2.14.1" "torchvision==0.29.1" "sglang==0.5.23"
  rm -f "$VENV/.bytecode-compiled"
fi
echo "[setup] installing sglang-dsv4-ascend (editable) with test extras"
install -e ".[test]"
# Bytecode once per venv (scripts/precompile.py says why: PYTHONDONTWRITEBYTECODE=1 here made
# every process compile SGLang and torch from source).
if [ ! -f "$VENV/.bytecode-compiled" ]; then
  echo "[setup] compiling bytecode for the modules servers and tests import"
  PYTHONDONTWRITEBYTECODE= "$VENV/bin/python" scripts/precompile.py
  touch "$VENV/.bytecode-compiled"
fi
echo "[setup] done: $("$VENV/bin/python" -c 'import sglang, torch; print("sglang", sglang.__version__, "torch", torch.__version__)')"
