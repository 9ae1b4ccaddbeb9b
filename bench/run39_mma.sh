#!/bin/bash
# Run 39: the kernel with warp-level mma.sync products (mma_sync) against wgmma: the mma GPU
# test cases natively, then the anchor (B=8, 32/8/128, T=128k) for 2b G128, 4b G128, 2b G32.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
D=$(date +%F)
mkdir -p $OUT
T=tests/test_kivi_decode_sm90.py::test_gpu_matches_reference_and_is_deterministic
timeout 240 python3 -m pytest -q -m gpu "$T[0]" "$T[25]" "$T[26]" "$T[27]" "$T[28]" "$T[29]" 2>&1 | tail -15 | tee $OUT/pytest_gpu_${D}_run39.txt
python3 bench/probe_kernel.py --set mma --pairs 2:128,4:128,2:32 2>&1 | grep -v "^{" | tail -25
cp probe_rows.json $OUT/probe_${D}_run39_mma.json 2>/dev/null || true
