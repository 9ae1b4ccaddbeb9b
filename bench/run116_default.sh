#!/usr/bin/env bash
# Run 116 (stop 25; one device call): pack_zeros as choose_tuning's at 2-bit G = D. The GPU
# module (75 cases, among them 70-74 with pack_zeros; the anchor launches over both value-code
# forms) and the dispatch tests in four shards on the new defaults; A/B at the anchor in one
# process; the Hq=32 grid's 2-bit G=128 cells.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
bash bench/gpu_tests_sharded.sh "$OUT/pytest_gpu_${D}_run116.txt" 200
R="$OUT/ab_${D}_run116.txt"
V="default;pack_zeros=0"
env $M=0.95 timeout 60 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
  --variants "$V;$V" | tee -a "$R"
# the Hq=32 grid's 2-bit G=128 cells (the default that changed), as run 110b
mkdir -p "$OUT/g"
env $M=0.95 timeout 75 python3 bench/decode_attention.py --mode grid --hq 32 --batches 1,8,32 \
  --ts 131072,8192,32768 --bits_g 2:128 --fp16 cudnn --no_twin --lp 0 --budget_s 55 \
  --out "$OUT/g" 2>&1 | grep "^|"
