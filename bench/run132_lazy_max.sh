#!/usr/bin/env bash
# Run 132 (stop 32): lazy_max (the common step's cross-warp max a vote at the P barrier, one
# warpgroup barrier and ~28 instructions per step fewer at the anchor's 2-bit G=128 launch):
# the GPU tests, the twin on the anchor launch, A/B in one process, back to back at the cap.
#   bash bench/run132_lazy_max.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
R="$OUT/lazy_max_${D}_run132.txt"
Q="--query-gpu=name,uuid,serial,temperature.gpu,power.draw,power.limit,clocks.sm --format=csv"
nvidia-smi $Q | tee "$R"
env $M=0.8 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_kivi_decode_sm90.py \
  -k "lazy_max" 2>&1 | tail -4 | tee -a "$R"
env $M=0.8 timeout 90 python3 bench/check_variant.py --flags lazy_max=1 --cases 2:2:128:128 \
  2>&1 | grep -v "^W\|^I0" | tail -4 | tee -a "$R"
env $M=0.95 timeout 150 python3 bench/point_compare.py --points 8x131072,32x32768 \
  --kbg 2:128 --variants "default;lazy_max=1" --rounds 3 | grep "^|" | tee -a "$R"
env $M=0.95 timeout 60 python3 bench/clock_probe.py --point 8x131072 --kbg 2:128 --cudnn \
  --variants "default;lazy_max=1" 2>&1 | grep -v Warn | tee -a "$R"
nvidia-smi $Q | tee -a "$R"
