#!/usr/bin/env bash
# The test command (README, .ci/run): set up the environment if needed, then run the tests.
#   bash scripts/test.sh           every test (what CI runs)
#   bash scripts/test.sh --quick   the unit tests and one end-to-end smoke test (the inner loop)
# ruff (lint, then format --check) runs first; a finding fails the run. Further arguments go to
# pytest (a path or -k narrows the run). Two pytest-xdist workers by
# default (SGLANG_DSV4_TEST_WORKERS, 0 = one process): the end-to-end groups
# (tests/e2e/conftest.py SCHEDULE) each on one worker, the unit tests on whichever is free, one
# torch thread per worker (two workers of two OpenMP threads on two cores spin in each other's
# barriers: measured, test_dspark's sampling tests ran for 45+ minutes). Measured on the 2-core
# machine from a clean clone, setup included: 918 s (the machine's speed varies by about 25 %);
# one process was about 40 % slower when last measured. Every run ends with
# its 15 slowest tests, the server starts and the total time.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/setup_env.sh
# Lint and format first (pyproject.toml [tool.ruff]): a finding fails the run before any test.
echo "[test] ruff check and ruff format --check"
.venv/bin/ruff check sglang_dsv4_ascend tests
.venv/bin/ruff format --check sglang_dsv4_ascend tests
select=()
if [ "${1:-}" = "--quick" ]; then
  shift
  select=(-m "not e2e or smoke")
fi
workers=${SGLANG_DSV4_TEST_WORKERS:-2}
xdist=()
if [ "$workers" -gt 0 ]; then
  xdist=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
  export OMP_NUM_THREADS=1
fi
set +e
.venv/bin/python -m pytest -q -rfEs --durations=15 "${xdist[@]}" "${select[@]}" tests "$@"
rc=$?
set -e
echo "[test] total $((SECONDS - start)) s (setup included), pytest exit $rc"
# pytest's "no tests collected" (5) must not pass as green.
[ "$rc" -eq 5 ] && { echo "no tests were collected" >&2; exit 1; }
exit "$rc"
