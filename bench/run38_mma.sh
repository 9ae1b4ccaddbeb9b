#!/bin/bash
# Run 38: warp-level mma.sync against wgmma at the kernel's tile shape; the GPU test modules.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
D=$(date +%F)
mkdir -p $OUT
python3 bench/mma_rate.py 2>&1 | tee $OUT/mma_rate_${D}_run38.txt
timeout 300 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py tests/test_attention.py \
    tests/test_models.py -x 2>&1 | tail -30 | tee $OUT/pytest_gpu_${D}_run38.txt
