#!/usr/bin/env bash
# Run 8 (one device call): GPU tests of the kernel, the G=32 per-warp-vector A/B at the anchor,
# then the G=32 columns of the grid against cuDNN fp16 (Hq=32, then Hq=64 as time allows).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
timeout 200 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -4 | tee "$OUT/pytest_gpu.txt"
MOSAIC_GPU_DUMP_TO=/tmp/ptx MOSAIC_GPU_DUMP_PTXAS=1 timeout 150 python3 bench/probe_kernel.py \
  --set g32 --pairs 2:32,4:32 --out "$OUT" 2>&1 | tail -7
timeout 170 python3 bench/decode_attention.py --mode grid --hq 32 --bits_g 2:32,4:32 \
  --fp16 cudnn --no_twin --budget_s 150 --out "$OUT" > "$OUT/grid32.log" 2>&1
tail -12 "$OUT/grid32.log"
