#!/usr/bin/env bash
# Run 89 (one device call): Nsight Compute instruction mix of the byte-order kernel (2-bit
# G=128 and G=32 at B=8 T=128k; without XLA's 95% preallocation, which left ncu no memory to
# save the launch for its replays in run 88).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
PAIRS="2:128 2:32" timeout 260 bash bench/ncu_sass.sh 2>&1 | grep -v "^==PROF==\|WARNING" | tail -80
for f in "$OUT"/sass_mix_*.txt; do mv "$f" "${f%.txt}_${D}_run89.txt"; done
rm -f "$OUT"/ncu_*_sass.csv
