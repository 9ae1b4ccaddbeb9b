#!/bin/bash
# Run 78: the GPU tests with the final defaults of this session (spread_copies with three
# warpgroups; bias_rows / vec64 opt-in): the kernel module (54 cases), then the attention and
# model modules' kernel cases.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R=${RUN:-78}
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout 275 python3 -m pytest -q -x -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -4 \
  | tee $OUT/pytest_gpu_${D}_run$R.txt
timeout 80 python3 -m pytest -q tests/test_attention.py -k "pallas_kernel or tuning" \
  tests/test_models.py -k "pallas_kernel or tuning or unstack or layout" 2>&1 | tail -2 \
  | tee $OUT/pytest_gpu_attention_models_run$R.txt
