#!/usr/bin/env bash
# Run 128 (stop 31): what stop 30 did not rerun on its final default (4f61827: the split merge,
# the q prologue and PDL inside the kernel at the anchor's 2-bit G=128 launch).
#   PART=tests bash bench/run128_verify.sh   # the whole GPU module + the dispatch tests, 4 shards
#   PART=grid32 bash bench/run128_verify.sh  # the Hq=32 grid in one process; generation
#   PART=grid64 bash bench/run128_verify.sh  # the Hq=64 grid in one process
#   PART=ab bash bench/run128_verify.sh      # the anchor in two processes x 3 rounds; back to back
#                                            # (run 128b: the same on the next call's card)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
Q="--query-gpu=name,uuid,serial,temperature.gpu,power.draw,power.limit,clocks.sm --format=csv"
P=${PART:-tests}
nvidia-smi $Q | tee "$OUT/gpu_${D}_run128_$P.txt"
if [ "$P" = tests ]; then
  bash bench/gpu_tests_sharded.sh "$OUT/pytest_gpu_${D}_run128.txt" 300
elif [ "$P" = grid32 ] || [ "$P" = grid64 ]; then
  h=${P#grid}
  mkdir -p "$OUT/g$h"
  env $M=0.95 timeout 300 python3 bench/decode_attention.py --mode grid --hq $h \
    --batches 1,8,32 --ts 131072,8192,32768 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn \
    --no_twin --lp 0 --budget_s 270 --out "$OUT/g$h" 2>&1 | grep "^|"
  if [ "$h" = 32 ]; then
    mkdir -p "$OUT/e"
    env $M=0.95 timeout 170 python3 bench/generate.py --models llama-3-8b \
      --points 16x4096,4x32768 --caches kivi2 --impls auto --group-size 128 --no-max-batch \
      --deadline 140 --out "$OUT/e" 2>&1 | tail -8
  fi
else
  R="$OUT/anchor_${D}_run128.txt"
  for i in 1 2; do
    echo "process $i" | tee -a "$R"
    env $M=0.95 timeout 90 python3 bench/point_compare.py --points 8x131072 \
      --kbg 2:128,2:32,4:128 --variants default --rounds 3 | grep "^|" | tee -a "$R"
  done
  env $M=0.95 timeout 60 python3 bench/clock_probe.py --point 8x131072 --kbg 2:128 --cudnn \
    --variants "default" 2>&1 | grep -v Warn | tee -a "$R"
fi
nvidia-smi $Q | tee -a "$OUT/gpu_${D}_run128_$P.txt"
