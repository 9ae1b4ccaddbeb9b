#!/usr/bin/env bash
# Run 113 (stop 25; one device call): run 112 found neither earlier refills nor fewer HMMA
# moving 2-bit G=128 off 0.198-0.203 ms, 11% over its compute alone (0.178, skip=copies) with
# its load pipeline alone at 0.164. Does the full kernel run at a lower SM clock than its
# floors (power)? bench/clock_probe.py: SM clock, power and clock-event reasons sampled while
# each variant runs back to back, cuDNN fp16 too.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
D=$(date +%F)
R="$OUT/clock_${D}_run113.txt"
timeout 200 python3 bench/clock_probe.py --point 8x131072 --kbg 2:128,2:32 --cudnn \
  --variants "default;skip=copies;skip=compute;skip=loads" 2>&1 | grep -v Warn | tee "$R"
