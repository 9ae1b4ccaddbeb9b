#!/usr/bin/env bash
# Run 107 (one device call; stop 23, group-min in main): the kernel module's GPU cases and the
# dispatch tests natively as a whole, in four pytest processes side by side (the module in one
# process outgrew a call's time on a cold compile cache, run 94: compiling is the CPU's, one
# core per process), then the Hq=32 grid with the new default. Run 107 lost
# the tests to word splitting; run 107b (GRID=0) ran them.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R="$OUT/pytest_gpu_${D}_run107.txt"
bash bench/gpu_tests_sharded.sh "$R" 290
[ "${GRID:-1}" = 1 ] || exit 0  # GRID=0: the tests only (run 107b)
mkdir -p "$OUT/g32"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 240 python3 bench/decode_attention.py --mode grid \
  --hq 32 --batches 1,8,32 --ts 131072,8192,32768 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn \
  --no_twin --lp 0 --budget_s 215 --out "$OUT/g32" 2>&1 | grep "^|"
