#!/usr/bin/env bash
# Run 81 (one device call): the cache order of stop 19 (each warp's rows of a 256-token block
# are 64 consecutive tokens): the kernel module's GPU tests, then an A/B at the anchor against
# the previous kernel (27ba8ad, planar token order, bench/scratch/kd_27ba8ad.py = `git show
# 27ba8ad:pallas_kernels/kivi_decode_sm90.py`) in one process.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout 290 python3 -m pytest -q -x -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -4 \
  | tee "$OUT/pytest_gpu_${D}_run81.txt"
timeout 270 python3 bench/point_compare.py --points 8x131072 --kbg 2:128,2:32 \
  --prev bench/scratch/kd_27ba8ad.py --variants "prev;default;prev;default" \
  | tee "$OUT/ab_${D}_run81.txt"
