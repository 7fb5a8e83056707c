#!/usr/bin/env bash
# Prefill/decode disaggregation of the shipped trained tiny DeepSeek-V4 on one machine: a prefill
# server and a decode server (SGLang's --disaggregation-mode, NIXL over UCX) behind SGLang's
# router, DSpark (adaptive verify) on both sides; sends one prompt through the router, prints the
# completion with its speculative statistics, and stops all three (sglang_dsv4_ascend/tools/pd.py).
# Further arguments go to both servers (e.g. --speculative-algorithm nextn ... on the NextN
# checkpoint: --model "$(python -c 'import sglang_dsv4_ascend as p; print(p.TINY_NEXTN_MODEL_PATH)')").
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m sglang_dsv4_ascend.tools.pd --speculative-algorithm dspark --speculative-dspark-block-size 4 "$@"
