#!/usr/bin/env bash
# Run 131 (stop 32): run 124's CUPTI trace (bench/gap_trace.py) on the current default (the split
# merge, the q prologue and PDL inside the kernel since stop 30): what still runs and idles
# around the kernel in the benchmark's call at the anchor.
#   bash bench/run131_trace.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R="$OUT/trace_${D}_run131.txt"
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.sm --format=csv | tee "$R"
env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 200 python3 bench/gap_trace.py \
  --point 8x131072 --kbg 2:128 --out /tmp/tr131 2>&1 | grep -v "^W\|^I0\|^E0" | tee -a "$R"
