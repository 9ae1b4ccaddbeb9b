#!/usr/bin/env bash
# Run 111 (stop 24; one device call): 4-bit value codes back in rows (value_codes_blocked: the
# blocks cost the 4-bit kernel 2-3%, runs 109-110). The kernel module's GPU cases and the
# dispatch tests in four shards, then the Hq=32 grid's 4-bit columns.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
M=XLA_PYTHON_CLIENT_MEM_FRACTION
R="$OUT/pytest_gpu_${D}_run111.txt"
bash bench/gpu_tests_sharded.sh "$R" 230
mkdir -p "$OUT/g"
env $M=0.95 timeout 130 python3 bench/decode_attention.py --mode grid --hq 32 --batches 8,1,32 \
  --ts 131072,8192,32768 --bits_g 4:128,4:32 --fp16 cudnn --no_twin --lp 0 --budget_s 110 \
  --out "$OUT/g" 2>&1 | grep "^|"
