#!/usr/bin/env bash
# Run 108 (stop 24; two device calls): pack_planes with fold_v_warp (opt-in) and the undefined
# rows g + 8 of two mma A operands (every fold_k launch). Call 1 (PART=ab): bench/check_variant.py
# with pack_planes=1 at 2-bit G=32/64 natively against the twin, then A/B in one process
# against main's previous module (bench/prev_kd_run108.py: `git show
# 6eab26b:pallas_kernels/kivi_decode_sm90.py > bench/prev_kd_run108.py`, not committed).
# Call 2 (PART=tests): the kernel module's GPU cases (67-69 the packed fold_v_warp launches)
# and the dispatch tests in four pytest shards side by side (as run 107b). (Run before the
# blocked value codes of run 110: bench caches are blocked at 2 bits since, which 6eab26b's
# kernel does not take.)
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
M=XLA_PYTHON_CLIENT_MEM_FRACTION
if [ "${PART:-ab}" = ab ]; then
  R="$OUT/ab_${D}_run108.txt"
  env $M=0.95 timeout 100 python3 bench/check_variant.py --flags pack_planes=1 \
    --cases 2:2:32:128,2:2:64:128,2:2:32:64 2>&1 | tail -5 | tee "$R"
  P=bench/prev_kd_run108.py
  env $M=0.95 timeout 200 python3 bench/point_compare.py --points 8x131072 --kbg 2:32,2:64 \
    --prev $P --variants "prev;default;pack_planes=1;prev;default;pack_planes=1" | tee -a "$R"
  env $M=0.95 timeout 130 python3 bench/point_compare.py --points 8x131072 --kbg 2:128,4:128 \
    --prev $P --variants "prev;default;prev;default" | tee -a "$R"
  env $M=0.95 timeout 110 python3 bench/point_compare.py --points 32x32768,1x131072 --kbg 2:32 \
    --prev $P --variants "prev;default;pack_planes=1" | tee -a "$R"
  exit 0
fi
R="$OUT/pytest_gpu_${D}_run108.txt"
bash bench/gpu_tests_sharded.sh "$R" 400
