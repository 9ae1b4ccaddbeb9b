#!/usr/bin/env bash
# Run 49 (one device call): the Hq=32 grid with this session's defaults (fold_k on mma.sync,
# subnormal value fields, W = 4 at 2-bit G=128), the GPU tests of the attention and model
# modules, and the generation loop (Llama-3-8B shapes, KIVI-2 G=128) at 16 x 4k.
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
mkdir -p "$OUT/g" "$OUT/a"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 290 python3 bench/decode_attention.py --mode grid --hq 32 --batches 1,8,32 \
  --ts 131072,8192,32768 --bits_g 2:128,2:32,4:128,4:32 --fp16 cudnn --no_twin --lp 0,1 \
  --budget_s 270 --out "$OUT/g" 2>&1 | grep "^|"
timeout 130 python3 -m pytest -q -m gpu tests/test_attention.py tests/test_models.py 2>&1 \
  | tail -4 | tee "$OUT/pytest_gpu_attention_models.txt"
timeout 150 python3 bench/generate.py --models llama-3-8b --points 16x4096 \
  --caches kivi2 --impls auto,auto-lowp --group-size 128 --no-max-batch --deadline 130 \
  --out "$OUT/a" 2>&1 | grep -v "^W0000\|^I0000" | tail -6
