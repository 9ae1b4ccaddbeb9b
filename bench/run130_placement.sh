#!/usr/bin/env bash
# Run 130 (stop 32): does the cache's placement in device memory move the kernel's time?
# (run 128b: process 2 ran the anchor 4-7% faster than process 1, cuDNN equal in both)
#   bash bench/run130_placement.sh   # placement probe in one process; then the anchor in two
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
Q="--query-gpu=name,uuid,serial,temperature.gpu,power.draw,power.limit,clocks.sm --format=csv"
R="$OUT/placement_${D}_run130.txt"
nvidia-smi $Q | tee "$OUT/gpu_${D}_run130.txt"
env $M=0.95 timeout 200 python3 bench/placement_probe.py --point 8x131072 --kbg 2:128 \
  --allocs 6 --rounds 3 2>&1 | grep -v Warn | tee "$R"
for i in 1 2; do
  echo "process $i" | tee -a "$R"
  env $M=0.95 timeout 90 python3 bench/point_compare.py --points 8x131072 \
    --kbg 2:128 --variants default --rounds 3 | grep "^|" | tee -a "$R"
done
nvidia-smi $Q | tee -a "$OUT/gpu_${D}_run130.txt"
