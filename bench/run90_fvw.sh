#!/usr/bin/env bash
# Run 90 (one device call): fold_v_warp (G < D: each warp's value scale folded into its B
# operand, subnormal value fields, the minimums by one mma.sync per plane) against the twin,
# an A/B against the previous kernel (bench/scratch/kd_main.py = `git show
# 4dcdcbe:pallas_kernels/kivi_decode_sm90.py`, carried), then the kernel module's GPU tests.
# (bench/scratch/fvw_check.py is at 6444631; bench/check_variant.py --flags fold_v_warp=1 does
# the same check now that the flag is opt-in.)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
timeout 120 python3 bench/scratch/fvw_check.py 2>&1 | grep -v Warn | tee "$OUT/fvw_check_${D}_run90.txt"
grep -q "ALL OK" "$OUT/fvw_check_${D}_run90.txt" || exit 1
timeout 150 python3 bench/point_compare.py --points 8x131072 --kbg 2:32,4:32 \
  --prev bench/scratch/kd_main.py --variants "prev;default;prev;default" \
  | tee "$OUT/ab_${D}_run90.txt"
timeout 300 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -3 \
  | tee "$OUT/pytest_gpu_${D}_run90.txt"
