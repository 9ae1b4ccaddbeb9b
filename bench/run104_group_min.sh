#!/usr/bin/env bash
# Run 104 (one device call; prepared in stop 22, branch group-min): fold_v_warp's minimums term
# split over the warps by tokens (`_group_min_mma`: one m16n8k16 per plane and warp, A = every
# group's minimums from one 64-bit load, instead of four with an A operand of moves; the warps'
# partials added once per split, `_warp_group_sum`). Natively against the twin (the GPU cases
# with fold_v_warp: 50-53 with 32-bit loads, 62-64 the default launches at G=32, G=64, D=64,
# 66 at 32 query heads per kv head (a larger scratch);
# bench/check_variant.py over the cases where it applies), A/B against main's module at 2-bit
# G=32 and G=64, and main's kernel on GPU case 66. First:
#   git show e3543e9:pallas_kernels/kivi_decode_sm90.py > bench/prev_kd_run104.py
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
T=tests/test_kivi_decode_sm90.py::test_gpu_matches_reference_and_is_deterministic
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu \
  "$T[50]" "$T[51]" "$T[52]" "$T[53]" "$T[62]" "$T[63]" "$T[64]" "$T[66]" 2>&1 | tail -3 \
  | tee "$OUT/pytest_gpu_${D}_run104.txt"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 150 python3 bench/check_variant.py \
  --flags fold_v_warp=1,vec64=1 --cases 2:2:32:128,2:2:64:128,2:2:32:64,4:4:32:128 2>&1 \
  | tail -6 | tee -a "$OUT/pytest_gpu_${D}_run104.txt"
V="prev;default"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 130 python3 bench/point_compare.py \
  --points 8x131072 --kbg 2:32 --prev bench/prev_kd_run104.py --variants "$V;$V;$V" \
  | tee "$OUT/ab_${D}_run104.txt"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 130 python3 bench/point_compare.py \
  --points 32x32768,1x131072 --kbg 2:32,2:64 --prev bench/prev_kd_run104.py --variants "$V" \
  | tee -a "$OUT/ab_${D}_run104.txt"
# main's kernel on case 66 (fold_v_warp at 32 query heads per kv head; stop 22 ran it
# cross-lowered only). The PTX comes from the deviceless compile (bench/aot_ptx.py) instead.
cp pallas_kernels/kivi_decode_sm90.py /tmp/kd_group_min.py
cp bench/prev_kd_run104.py pallas_kernels/kivi_decode_sm90.py
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu \
  "$T[66]" 2>&1 | tail -2 | sed 's/^/main: /' | tee -a "$OUT/pytest_gpu_${D}_run104.txt"
cp /tmp/kd_group_min.py pallas_kernels/kivi_decode_sm90.py
