#!/usr/bin/env bash
# Run 116 (stop 25; one device call): pack_zeros as choose_tuning's at 2-bit G = D. The GPU
# module (74 cases, among them 70-74 with pack_zeros; the anchor launches over both value-code
# forms) and the dispatch tests in four shards on the new defaults; then A/B at the anchor and
# at B=32 T=32k in one process, and back to back (bench/clock_probe.py) at B=32 T=32k.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
bash bench/gpu_tests_sharded.sh "$OUT/pytest_gpu_${D}_run116.txt" 230
R="$OUT/ab_${D}_run116.txt"
V="default;pack_zeros=0"
env $M=0.95 timeout 120 python3 bench/point_compare.py --points 8x131072,32x32768 --kbg 2:128 \
  --variants "$V;$V" | tee -a "$R"
env $M=0.95 timeout 60 python3 bench/clock_probe.py --point 32x32768 --kbg 2:128 \
  --variants "$V" --seconds 3 2>&1 | grep -v Warn | tee -a "$R"
