#!/usr/bin/env bash
# Run 50 (one device call): the attention and model modules' kernel tests natively, the kernel
# at the generation benchmark's shapes (16 x 4k, 4 x 32k) with and without this session's
# flags, and the 16 x 4k generation loop again (run 49 gave 2079.9 tok/s, run 42 2164.0).
set -u
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 KIVI_JAX_CACHE_DIR=/tmp/kc
mkdir -p "$OUT/a"
timeout 150 python3 -m pytest -q -x tests/test_attention.py -k "pallas_kernel or tuning" \
  tests/test_models.py -k "pallas_kernel or tuning or unstack or layout" 2>&1 | tail -3 \
  | tee "$OUT/pytest_gpu_attention_models_run50.txt"
timeout 120 python3 bench/point_compare.py --points 16x4096,4x32768 --kbg 2:128 \
  --variants "default;fold_k=0;subnormal_values=0;fold_k=0,subnormal_values=0" 2>&1 | grep "^|" \
  | tee "$OUT/point_compare_run50.txt"
timeout 100 python3 bench/generate.py --models llama-3-8b --points 16x4096 \
  --caches kivi2 --impls auto --group-size 128 --no-max-batch --deadline 80 \
  --out "$OUT/a" 2>&1 | grep -v "^W0000\|^I0000" | tail -3
