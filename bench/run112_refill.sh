#!/usr/bin/env bash
# Its variants (early_refill, half_k_bias, mask_halves) are in commit a89a350 only (removed after
# it): run it on that tree, `git checkout a89a350 -- pallas_kernels/kivi_decode_sm90.py`.
# Run 112 (stop 25; one device call): 2-bit G=128 at the anchor sits at 5.0x of cuDNN with its
# compute alone (0.178 ms) and its load pipeline alone (0.164) within 8% of each other (run
# 109): two candidates. early_refill: a step's key copies refilled as soon as its cross-warp
# max has passed and the value codes waited for only before the value product (each copy about
# 1.5 steps to land instead of 1, same SMEM). half_k_bias: the key bias q . z_g on one mma of
# K = 64 instead of 128 (68 HMMA per step instead of 72). Both against the twin and the default
# launch (bench/check_variant.py), then A/B at the anchor in one process.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
D=$(date +%F)
R="$OUT/refill_${D}_run112.txt"
C=2:2:128:128,2:2:64:128,2:2:32:128
for f in early_refill=1 half_k_bias=1 early_refill=1,half_k_bias=1; do
  timeout 100 python3 bench/check_variant.py --flags "$f" --cases "$C" 2>&1 | grep -v Warn \
    | tee -a "$R"
done
V="default;early_refill=1;half_k_bias=1;early_refill=1,half_k_bias=1"
timeout 240 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
  --variants "$V;$V;lazy_rescale=1;early_refill=1,spread_copies=1" | tee -a "$R"
timeout 100 python3 bench/point_compare.py --points 8x131072 --kbg 2:32 \
  --variants "default;early_refill=1;default;early_refill=1" | tee -a "$R"
