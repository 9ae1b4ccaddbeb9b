#!/usr/bin/env bash
# Run 20 (one device call): the GPU tests' multi-warpgroup cases, fold_k under the W=3 register
# cap, then the Hq=32 grid with one and three warpgroups per block side by side.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py -k "14 or 15 or 16 or 17" 2>&1 | tail -2 | tee "$OUT/pytest_gpu.txt"
mkdir -p /tmp/ptx "$OUT/p" "$OUT/g"
MOSAIC_GPU_DUMP_TO=/tmp/ptx MOSAIC_GPU_DUMP_PTXAS=1 timeout 90 python3 bench/probe_kernel.py \
  --set wg --pairs 2:128 --only "default,W3 S6,W3 fold_k" --out "$OUT/p" 2>&1 | grep "^|\\|cuDNN"
timeout 330 python3 bench/decode_attention.py --mode grid --hq 32 --fp16 cudnn --no_twin \
  --bits_g 2:32,4:128,2:128 --wg 1,3 --budget_s 320 --out "$OUT/g" > "$OUT/g/log.txt" 2>&1
grep "^|" "$OUT/g/log.txt" | tail -60
