#!/usr/bin/env bash
# Run 87 (one device call; branch byte-order, not run yet): the stored byte order (the middle
# bytes of every 4-byte group of a code row swapped, so that `_widen8` without exponent bits
# widens a word by one `shr` instead of two `prmt`): the kernel module's GPU tests, then an A/B
# at the anchor against main's kernel (the cache order without the swap; bench/scratch/kd_main.py
# = `git show main:pallas_kernels/kivi_decode_sm90.py`, carried: run with carry
# ["bench/scratch/kd_main.py"]). Random codes: both kernels read the same bytes.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
timeout 290 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -3 \
  | tee "$OUT/pytest_gpu_${D}_run87.txt"
timeout 270 python3 bench/point_compare.py --points 8x131072 --kbg 2:128,2:32,4:128 \
  --prev bench/scratch/kd_main.py --variants "prev;default;prev;default" \
  | tee "$OUT/ab_${D}_run87.txt"
