#!/usr/bin/env bash
# Run 15 (one device call): GPU tests with the final defaults (fold_v at G = D, fold_k opt-in),
# then the grid of the configurations whose kernel changed (2/4-bit G=128; G=32 takes the
# run-10 kernel path unchanged) against cuDNN fp16, Hq=32 and Hq=64.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 170 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -4 | tee "$OUT/pytest_gpu.txt"
mkdir -p "$OUT/g32" "$OUT/g64"
timeout 150 python3 bench/decode_attention.py --mode grid --hq 32 --fp16 cudnn --no_twin \
  --bits_g 2:128,4:128 --budget_s 140 --out "$OUT/g32" > "$OUT/g32/log.txt" 2>&1; grep "^|" "$OUT/g32/log.txt" | tail -30
timeout 150 python3 bench/decode_attention.py --mode grid --hq 64 --fp16 cudnn --no_twin \
  --bits_g 2:128,4:128 --budget_s 140 --out "$OUT/g64" > "$OUT/g64/log.txt" 2>&1; grep "^|" "$OUT/g64/log.txt" | tail -30
