#!/bin/bash
# Run 67: the kernel after the helper refactor (one movmatrix helper `_transpose8x8` for P's
# store and the per-warp B operand, one per-warp column max `_warp_col_max` for the shared and
# the per-warp max): the GPU tests of the kernel, attention and model modules, and an A/B in
# one process against the kernel of runs 62-66 (2d523c2, bench/scratch/kd_2d523c2.py).
# The earlier module: git show 2d523c2:pallas_kernels/kivi_decode_sm90.py >
# bench/scratch/kd_2d523c2.py (carried to the device, not committed).
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R=${RUN:-67}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout 240 python3 -m pytest -q -x -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -15 \
  | tee $OUT/pytest_gpu_${D}_run$R.txt
timeout 100 python3 -m pytest -q tests/test_attention.py -k "pallas_kernel or tuning" \
  tests/test_models.py -k "pallas_kernel or tuning or unstack or layout" 2>&1 | tail -2 \
  | tee $OUT/pytest_gpu_attention_models_run$R.txt
timeout 200 python3 bench/point_compare.py --points 8x131072,1x131072 --kbg 2:128,4:128 \
  --prev bench/scratch/kd_2d523c2.py --variants "default;prev;default;prev" 2>&1 | grep "^|" \
  | tee $OUT/ab_${D}_run$R.txt
