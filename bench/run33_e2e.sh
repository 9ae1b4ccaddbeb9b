#!/bin/bash
# Run 33: generation throughput with per-layer weights (decode_layout) and the one-update
# residual write; Llama-3-8B random weights, KIVI G = 128.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/a $OUT/b
timeout 400 python3 bench/generate.py --models llama-3-8b --points 1x4096,16x4096,4x32768 \
  --caches fp16,kivi2,kivi4 --impls auto --group-size 128 --no-max-batch --deadline 330 \
  --out $OUT/a 2>&1 | grep -v "^W0000\|^I0000" | tail -20
timeout 170 python3 bench/generate.py --models llama-3-8b --points 16x4096,4x32768 \
  --caches kivi2 --impls auto-lowp --group-size 128 --no-max-batch --deadline 120 \
  --out $OUT/b 2>&1 | grep -v "^W0000\|^I0000" | tail -8
