#!/usr/bin/env bash
# Run 98 (one device call; stop 22): run 97 found fold_v_warp with 64-bit vector loads (vec64)
# at 2-bit G=32 on the anchor 0.2716/0.2722 -> 0.2463/0.2500 ms (fold_v_warp alone even).
# Before it becomes the default there: vec64 alone (which of the two does it), the pair
# across (B, T) at 2- and 4-bit G=32, the pair natively against the float32 twin over the
# cases where fold_v_warp applies, and release_slots=0 with the packed planes at three points
# (run 97: three pairs, -0.1..-3.4%).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
timeout 150 python3 bench/check_variant.py --flags fold_v_warp=1,vec64=1 \
  --cases 2:2:32:128,4:4:32:128,2:2:64:128,2:2:32:64,2:4:32:128 2>&1 | tail -8 \
  | tee "$OUT/check_${D}_run98.txt"
V="default;vec64=1;fold_v_warp=1,vec64=1"
timeout 120 python3 bench/point_compare.py --points 8x131072 --kbg 2:32 --variants "$V;$V" \
  | tee "$OUT/ab_${D}_run98.txt"
timeout 200 python3 bench/point_compare.py --points 1x8192,1x131072,8x8192,8x32768,32x32768,32x131072 \
  --kbg 2:32,4:32 --variants "default;fold_v_warp=1,vec64=1" | tee -a "$OUT/ab_${D}_run98.txt"
R="default;release_slots=0"
timeout 120 python3 bench/point_compare.py --points 8x131072,32x32768,1x131072 --kbg 2:128 \
  --variants "$R;$R" | tee -a "$OUT/ab_${D}_run98.txt"
