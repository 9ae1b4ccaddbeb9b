#!/bin/bash
# Run 72: the kernel's own pipeline (`_pipeline`, one warp issuing the copies, no auto
# barriers) also for one-warpgroup blocks (copy_warp, in place of plgpu.emit_pipeline): the
# GPU tests of the kernel module, then an A/B in one process against copy_warp=0 (the
# emit_pipeline path) at one-warpgroup points.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R=${RUN:-72}
timeout 205 python3 -m pytest -q -x -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -6 \
  | tee $OUT/pytest_gpu_${D}_run$R.txt
timeout 105 python3 bench/point_compare.py --points 8x131072,1x131072,1x8192 --kbg 4:128 \
  --variants "default;copy_warp=0;default;copy_warp=0" 2>&1 | grep "^|" \
  | tee $OUT/ab_${D}_run$R.txt
