#!/usr/bin/env bash
# The test command (README, .ci/run): set up the environment if needed, then run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
set +e
.venv/bin/python -m pytest -q -rs tests "$@"
rc=$?
set -e
# pytest's "no tests collected" (5) must not pass as green.
[ "$rc" -eq 5 ] && { echo "no tests were collected" >&2; exit 1; }
exit "$rc"
