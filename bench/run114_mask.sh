#!/usr/bin/env bash
# Its variants (early_refill, half_k_bias, mask_halves) are in commit a89a350 only (removed after
# it): run it on that tree, `git checkout a89a350 -- pallas_kernels/kivi_decode_sm90.py`.
# Run 114 (stop 25; one device call): run 113 found the full kernel at the H200's 700 W power
# cap (SM clock median 1800 MHz against 1980 for its floors). mask_halves: the unused half of
# every packed mma's B zeroed (the tensor cores multiply zeros there), at 64-96 more selects per
# step. Checked against the twin, A/B at the anchor in one process, then SM clock and power
# sustained (bench/clock_probe.py).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
D=$(date +%F)
R="$OUT/mask_${D}_run114.txt"
timeout 100 python3 bench/check_variant.py --flags mask_halves=1 \
  --cases 2:2:128:128,2:2:64:128,2:2:32:128 2>&1 | grep -v Warn | tee -a "$R"
V="default;mask_halves=1"
timeout 200 python3 bench/point_compare.py --points 8x131072 --kbg 2:128,2:32 \
  --variants "$V;$V;$V" | tee -a "$R"
timeout 120 python3 bench/clock_probe.py --point 8x131072 --kbg 2:128,2:32 \
  --variants "$V" 2>&1 | grep -v Warn | tee -a "$R"
