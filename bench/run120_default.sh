#!/usr/bin/env bash
# Run 120 (stop 27; one device call): dense_bias as choose_tuning's at 2-bit G=128 with four
# warpgroups. The native tests that take choose_tuning's launches (the dense_bias identity,
# blocked == unblocked, the anchor's GPU cases, the dispatch tests through decode_attention),
# one A/B pair at the anchor, and the 2-bit G=128 cells of the Hq=32 and Hq=64 grids.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 KIVI_JAX_CACHE_DIR=/tmp/kc
M=XLA_PYTHON_CLIENT_MEM_FRACTION
D=$(date +%F)
T="$OUT/pytest_gpu_${D}_run120.txt"
K=tests/test_kivi_decode_sm90.py
env $M=0.3 timeout 200 python3 -m pytest -q -p no:cacheprovider "$K" -m gpu \
  -k "dense_bias or unblocked" > /tmp/t0.log 2>&1 &
env $M=0.3 timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_attention.py \
  -k "pallas or tuning or auto" > /tmp/t1.log 2>&1 &
wait
for i in 0 1; do grep -E "passed|failed|error" /tmp/t$i.log | tail -6 | sed "s/^/t$i: /" \
  | tee -a "$T"; done
R="$OUT/default_${D}_run120.txt"
env $M=0.95 timeout 60 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
  --variants "default;dense_bias=0" | tee -a "$R"
mkdir -p "$OUT/g32" "$OUT/g64"
for h in 32 64; do
  env $M=0.95 timeout 110 python3 bench/decode_attention.py --mode grid --hq $h \
    --batches 1,8,32 --ts 131072,8192,32768 --bits_g 2:128 --fp16 cudnn --no_twin --lp 0 \
    --budget_s 95 --out "$OUT/g$h" 2>&1 | grep "^|" | tee -a "$R"
done
