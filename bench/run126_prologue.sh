#!/usr/bin/env bash
# Run 126 (stop 30): the query's prologue inside the kernel (q_prologue) on top of run 125's
# merge_splits and pdl. The GPU tests of the three paths (native numerics, poisoned outputs,
# the same bits), then 2-bit G=128 at the anchor (B=8 T=128k, 32/8/128), four variants, three
# rounds, in one process.
#   bash bench/run126_prologue.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
Q="--query-gpu=name,uuid,serial,temperature.gpu,power.draw,power.limit,clocks.sm --format=csv"
R="$OUT/prologue_${D}_run126.txt"
nvidia-smi $Q | tee "$R"
timeout 250 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py -k "merge_splits_and_pdl" \
  2>&1 | tail -12 | tee -a "$R"
env $M=0.95 timeout 300 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
  --variants "default;merge_splits=1,pdl=1;q_prologue=1;merge_splits=1,pdl=1,q_prologue=1" \
  --rounds 3 2>&1 | tee "$OUT/a.log" | grep "^|" | tee -a "$R"
nvidia-smi $Q | tee -a "$R"
