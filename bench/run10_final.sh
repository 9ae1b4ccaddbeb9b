#!/usr/bin/env bash
# Run 10 (one device call, < 600 s): GPU dispatch tests, the grid with the final kernel
# (Hq=32 all 9 shapes; Hq=64 as time allows, 128k and 8k first) for 2/4-bit x G 128/32 vs
# cuDNN fp16, then the end-to-end decode benchmark with implementation="auto".
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 90 python3 -m pytest -q tests/test_attention.py -k pallas_kernel_through 2>&1 | tail -2 | tee "$OUT/pytest_gpu_attention.txt"
mkdir -p "$OUT/g32" "$OUT/g64" "$OUT/gen"
timeout 280 python3 bench/decode_attention.py --mode grid --hq 32 --fp16 cudnn --no_twin \
  --budget_s 265 --out "$OUT/g32" > "$OUT/g32/log.txt" 2>&1; tail -3 "$OUT/g32/log.txt"
timeout 150 python3 bench/decode_attention.py --mode grid --hq 64 --fp16 cudnn --no_twin \
  --ts 131072,8192 --budget_s 135 --out "$OUT/g64" > "$OUT/g64/log.txt" 2>&1; tail -3 "$OUT/g64/log.txt"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 110 python3 bench/generate.py --models llama-3-8b \
  --points 16x4096,4x32768 --caches fp16,kivi2,kivi4 --impls auto --no-max-batch \
  --deadline 80 --out "$OUT/gen" > "$OUT/gen/log.txt" 2>&1; tail -12 "$OUT/gen/log.txt"
