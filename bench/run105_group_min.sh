#!/usr/bin/env bash
# Runs 105 and 106 (RUN=106; one device call each; run 104 through it too): run 104's checks
# and A/B again after its fix (run 104 paired z's tokens with other tokens of P: rel. err.
# 3e-2). Run 105 read B by two 32-bit loads in P's `_PERM16` order, run 106 (committed) A by
# two 32-bit loads once. GPU cases with fold_v_warp (50-53, the default launches 62-64, 66 at
# 32 query heads per kv head), bench/check_variant.py, A/B against main's module then
# (bench/prev_kd_run104.py: `git show e3543e9:pallas_kernels/kivi_decode_sm90.py`) at 2-bit
# G=32 and G=64.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
T=tests/test_kivi_decode_sm90.py::test_gpu_matches_reference_and_is_deterministic
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
  "$T[50]" "$T[51]" "$T[52]" "$T[53]" "$T[62]" "$T[63]" "$T[64]" "$T[66]" 2>&1 | tail -3 \
  | tee "$OUT/pytest_gpu_${D}_run${RUN:-105}.txt"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 150 python3 bench/check_variant.py \
  --flags fold_v_warp=1,vec64=1 --cases 2:2:32:128,2:2:64:128,2:2:32:64,4:4:32:128 2>&1 \
  | tail -6 | tee -a "$OUT/pytest_gpu_${D}_run${RUN:-105}.txt"
V="prev;default"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 130 python3 bench/point_compare.py \
  --points 8x131072 --kbg 2:32 --prev bench/prev_kd_run104.py --variants "$V;$V;$V" \
  | tee "$OUT/ab_${D}_run${RUN:-105}.txt"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 130 python3 bench/point_compare.py \
  --points 32x32768,1x131072 --kbg 2:32,2:64 --prev bench/prev_kd_run104.py --variants "$V" \
  | tee -a "$OUT/ab_${D}_run${RUN:-105}.txt"
