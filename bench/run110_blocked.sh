#!/usr/bin/env bash
# Run 110 (stop 24; two device calls): the value codes stored in blocks of 64 byte columns
# (the cache's layout since this stop) and packed planes at 2-bit G < D (choose_tuning).
# PART=check: the kernel module's GPU cases (on blocked codes; 70-73 blocked == unblocked bit
# for bit) and the dispatch tests in four shards, then A/B at the anchor against the previous
# default (unblocked rows, no packing at G < D: "vrows:pack_planes=0"), and packing at G=64.
# PART=grid: the Hq=32 grid and the generation benchmark (Llama-3-8B shapes, KIVI-2 G=128,
# implementation="auto"), as run 83/95.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
M=XLA_PYTHON_CLIENT_MEM_FRACTION
if [ "${PART:-check}" = check ]; then
  R="$OUT/pytest_gpu_${D}_run110.txt"
  bash bench/gpu_tests_sharded.sh "$R" 260
  A="$OUT/ab_${D}_run110.txt"
  V="default;vrows:pack_planes=0"
  env $M=0.95 timeout 200 python3 bench/point_compare.py --points 8x131072 \
    --kbg 2:32,2:128,4:128 --variants "$V;$V" | tee "$A"
  env $M=0.95 timeout 70 python3 bench/point_compare.py --points 8x131072 --kbg 2:64 \
    --variants "pack_planes=0;default;pack_planes=0;default" | tee -a "$A"
  exit 0
fi
mkdir -p "$OUT/g" "$OUT/e"
env $M=0.95 timeout 235 python3 bench/decode_attention.py --mode grid --hq 32 --batches 1,8,32 \
  --ts 131072,8192,32768 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn --no_twin --lp 0 \
  --budget_s 210 --out "$OUT/g" 2>&1 | grep "^|"
env $M=0.95 timeout 200 python3 bench/generate.py --models llama-3-8b --points 16x4096,4x32768 \
  --caches kivi2 --impls auto --group-size 128 --no-max-batch --deadline 150 --out "$OUT/e" \
  2>&1 | tail -8
