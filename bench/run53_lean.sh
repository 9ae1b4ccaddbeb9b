#!/bin/bash
# Run 53: the sub-step's overheads cut (run 52's SASS): u from log2 s_t instead of a division,
# no async-proxy fence before mma.sync reads P, a one-barrier cross-warp max, the ragged mask
# only on a row's last sub-step, P stored through movmatrix (32-bit stores). GPU tests of the
# kernel module and the attention/model kernel tests, then an A/B against the kernel at 9dd6799
# (bench/scratch/kd_9dd6799.py: `git show 9dd6799:pallas_kernels/kivi_decode_sm90.py`, not
# committed; the device call carries it) in one process at the anchor.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout 300 python3 -m pytest -q -x -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -6 \
  | tee $OUT/pytest_gpu_${D}_run${RUN:-53}.txt
timeout 150 python3 -m pytest -q -x tests/test_attention.py -k "pallas_kernel or tuning" \
  tests/test_models.py -k "pallas_kernel or tuning or unstack or layout" 2>&1 | tail -3 \
  | tee -a $OUT/pytest_gpu_${D}_run${RUN:-53}.txt
timeout 400 python3 bench/point_compare.py --points 8x131072 --kbg ${KBG:-2:128,2:32,4:128} \
  --prev bench/scratch/kd_9dd6799.py \
  --variants "${VARIANTS:-prev;default;prev:skip=loads;skip=loads;default}" 2>&1 | grep "^|" \
  | tee $OUT/ab_${D}_run${RUN:-53}.txt
