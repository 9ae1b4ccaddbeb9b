#!/usr/bin/env bash
# Run 121 (stop 28; four device calls on HEAD, dense_bias the default at 2-bit G=128).
#   PART=tests bash bench/run121_final.sh   # the GPU module and the dispatch tests, four shards
#                                           # (the copy warp passed to _pipeline, 9537bec, had
#                                           # not run natively)
#   PART=grid bash bench/run121_final.sh    # both grids on HEAD, each in one process
#   PART=card bash bench/run121_final.sh    # the anchor in two processes on the call's card
#   PART=ab bash bench/run121_final.sh      # the anchor in four fresh processes, cuDNN and the
#                                           # kernel in turn three times in each; the three
#                                           # targets' configurations; back to back; generation
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
Q="--query-gpu=name,uuid,serial,temperature.gpu,power.draw,power.limit,clocks.sm --format=csv"
if [ "${PART:-tests}" = tests ]; then
  nvidia-smi $Q | tee "$OUT/gpu_${D}_run121_tests.txt"
  bash bench/gpu_tests_sharded.sh "$OUT/pytest_gpu_${D}_run121.txt" 280
  exit 0
fi
if [ "${PART}" = card ]; then  # the anchor again on whichever card the call gets
  R="$OUT/card_${D}_run121.txt"
  nvidia-smi $Q | tee "$R"
  for i in 1 2; do
    echo "process $i" | tee -a "$R"
    env $M=0.95 timeout 75 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
      --variants default --rounds 3 | grep "^|" | tee -a "$R"
  done
  env $M=0.95 timeout 60 python3 bench/clock_probe.py --point 8x131072 --kbg 2:128 --cudnn \
    --variants "default" 2>&1 | grep -v Warn | tee -a "$R"
  nvidia-smi $Q | tee -a "$R"
  exit 0
fi
if [ "${PART}" = grid ]; then
  nvidia-smi $Q | tee "$OUT/gpu_${D}_run121_grid.txt"
  for h in 32 64; do
    mkdir -p "$OUT/g$h"
    env $M=0.95 timeout 260 python3 bench/decode_attention.py --mode grid --hq $h \
      --batches 1,8,32 --ts 131072,8192,32768 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn \
      --no_twin --lp 0 --budget_s 235 --out "$OUT/g$h" 2>&1 | grep "^|"
  done
  exit 0
fi
R="$OUT/anchor_${D}_run121.txt"
nvidia-smi $Q | tee "$R"
for i in 1 2 3 4; do
  echo "process $i" | tee -a "$R"
  env $M=0.95 timeout 75 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
    --variants default --rounds 3 | grep "^|" | tee -a "$R"
done
echo "targets" | tee -a "$R"
env $M=0.95 timeout 90 python3 bench/point_compare.py --points 8x131072 --kbg 2:128,2:32,4:128 \
  --variants default --rounds 2 | grep "^|" | tee -a "$R"
env $M=0.95 timeout 60 python3 bench/clock_probe.py --point 8x131072 --kbg 2:128 --cudnn \
  --variants "default" 2>&1 | grep -v Warn | tee -a "$R"
nvidia-smi $Q | tee -a "$R"
mkdir -p "$OUT/e"
env $M=0.95 timeout 170 python3 bench/generate.py --models llama-3-8b --points 16x4096,4x32768 \
  --caches kivi2 --impls auto --group-size 128 --no-max-batch --deadline 140 --out "$OUT/e" \
  2>&1 | tail -8 | tee -a "$R"
