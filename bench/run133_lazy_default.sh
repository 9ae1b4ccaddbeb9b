#!/usr/bin/env bash
# Run 133 (stop 32): lazy_max choose_tuning's at 2-bit G=128 with four warpgroups (the
# anchor, B=32 T=32k and B=32 T=128k of the grid; the other cells' launches are unchanged):
# the GPU module + the dispatch tests in 8 shards, then those three cells against lazy_max=0
# in two processes (cuDNN in each round), then the anchor back to back at the power cap.
#   bash bench/run133_lazy_default.sh
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
Q="--query-gpu=name,uuid,serial,temperature.gpu,power.draw,power.limit,clocks.sm --format=csv"
nvidia-smi $Q | tee "$OUT/gpu_${D}_run133.txt"
SHARDS=8 bash bench/gpu_tests_sharded.sh "$OUT/pytest_gpu_${D}_run133.txt" 270
R="$OUT/anchor_${D}_run133.txt"
for i in 1 2; do
  echo "process $i" | tee -a "$R"
  env $M=0.95 timeout 100 python3 bench/point_compare.py --points 8x131072,32x32768,32x131072 \
    --kbg 2:128 --variants "default;lazy_max=0" --rounds 2 | grep "^|" | tee -a "$R"
done
env $M=0.95 timeout 50 python3 bench/clock_probe.py --point 8x131072 --kbg 2:128 --cudnn \
  --variants "default" 2>&1 | grep -v Warn | tee -a "$R"
nvidia-smi $Q | tee -a "$OUT/gpu_${D}_run133.txt"
