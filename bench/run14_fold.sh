#!/usr/bin/env bash
# Run 14 (one device call): GPU tests with both scales folded (fold_k at G >= 128, fold_v at
# G = D), the fold A/B at the anchor (2/4-bit G=128), then the grid of the two changed
# configurations (2/4-bit G=128, Hq=32 all 9 shapes, Hq=64 as time allows) against cuDNN fp16.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 170 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -4 | tee "$OUT/pytest_gpu.txt"
mkdir -p /tmp/ptx "$OUT/g32" "$OUT/g64"
MOSAIC_GPU_DUMP_TO=/tmp/ptx MOSAIC_GPU_DUMP_PTXAS=1 timeout 130 python3 bench/probe_kernel.py \
  --set fold --pairs 2:128,4:128 --out "$OUT" 2>&1 | grep "^|\|cuDNN"
timeout 150 python3 bench/decode_attention.py --mode grid --hq 32 --fp16 cudnn --no_twin \
  --bits_g 2:128,4:128 --budget_s 140 --out "$OUT/g32" > "$OUT/g32/log.txt" 2>&1; grep "^|" "$OUT/g32/log.txt" | tail -12
timeout 110 python3 bench/decode_attention.py --mode grid --hq 64 --fp16 cudnn --no_twin \
  --bits_g 2:128,4:128 --budget_s 100 --out "$OUT/g64" > "$OUT/g64/log.txt" 2>&1; grep "^|" "$OUT/g64/log.txt" | tail -12
