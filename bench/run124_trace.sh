#!/usr/bin/env bash
# Run 124 (stop 29): a CUPTI trace of the benchmark's call at the anchor (bench/gap_trace.py):
# run 122 had the kernel's launch at 173 us + 5 us back to back, run 123 the benchmark's call
# at 0.196-0.198 ms in either loop structure: what runs and idles in between.
#   bash bench/run124_trace.sh             # 2-bit G=128; KBG="2:128 4:128" for more
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R="$OUT/trace_${D}_run124.txt"
nvidia-smi --query-gpu=name,uuid,power.limit,clocks.sm --format=csv | tee "$R"
for kbg in ${KBG:-2:128}; do
  env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 150 python3 bench/gap_trace.py \
    --point 8x131072 --kbg $kbg --out "/tmp/tr_$kbg" 2>&1 | grep -v "^W\|^I0\|^E0" | tee -a "$R"
done
