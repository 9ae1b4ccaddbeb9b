#!/usr/bin/env bash
# Run 119 (stop 27; two device calls on the final defaults, dense_bias off).
#   PART=tests bash bench/run119_final.sh   # the GPU module (80 cases, dense_bias identity)
#                                           # and the dispatch tests, four shards
#   PART=ab bash bench/run119_final.sh      # dense_bias A/B again (run 118's was mixed), the
#                                           # Hq=32 grid's missing 2-bit G=128 cell, generation
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
if [ "${PART:-tests}" = tests ]; then
  bash bench/gpu_tests_sharded.sh "$OUT/pytest_gpu_${D}_run119.txt" 290
  exit 0
fi
R="$OUT/dense_bias_${D}_run119.txt"
V="default;dense_bias=1"
env $M=0.95 timeout 90 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
  --variants "$V;$V" | tee -a "$R"
env $M=0.95 timeout 100 python3 bench/clock_probe.py --point 8x131072 --kbg 2:128 --cudnn \
  --variants "$V;$V" 2>&1 | grep -v Warn | tee -a "$R"
mkdir -p "$OUT/g" "$OUT/e"
env $M=0.95 timeout 80 python3 bench/decode_attention.py --mode grid --hq 32 --batches 32 \
  --ts 32768 --bits_g 2:128 --fp16 cudnn --no_twin --lp 0 --budget_s 60 --out "$OUT/g" \
  2>&1 | grep "^|" | tee -a "$R"
env $M=0.95 timeout 190 python3 bench/generate.py --models llama-3-8b --points 16x4096,4x32768 \
  --caches kivi2 --impls auto --group-size 128 --no-max-batch --deadline 150 --out "$OUT/e" \
  2>&1 | tail -8 | tee -a "$R"
