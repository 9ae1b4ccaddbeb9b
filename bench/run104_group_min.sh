#!/usr/bin/env bash
# Run 104 (one device call; prepared in stop 22, branch group-min): fold_v_warp's minimums term
# split over the warps by tokens (`_group_min_mma`: one m16n8k16 per plane and warp, A = every
# group's minimums from one 64-bit load, instead of four with an A operand of moves; the warps'
# partials added once per split, `_warp_group_sum`): the checks and A/B of
# bench/run105_group_min.sh on that first version (commit ebfae91, wrong: see runs 105-106),
# then main's kernel then on GPU case 66 (fold_v_warp at 32 query heads per kv head; stop 22
# ran it cross-lowered only). First:
#   git show e3543e9:pallas_kernels/kivi_decode_sm90.py > bench/prev_kd_run104.py
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
T=tests/test_kivi_decode_sm90.py::test_gpu_matches_reference_and_is_deterministic
RUN=104 bash bench/run105_group_min.sh
cp pallas_kernels/kivi_decode_sm90.py /tmp/kd_group_min.py
cp bench/prev_kd_run104.py pallas_kernels/kivi_decode_sm90.py
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu \
  "$T[66]" 2>&1 | tail -2 | sed 's/^/main: /' | tee -a "$OUT/pytest_gpu_${D}_run104.txt"
cp /tmp/kd_group_min.py pallas_kernels/kivi_decode_sm90.py
