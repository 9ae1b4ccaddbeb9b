#!/bin/bash
# Run 37: the dense baseline with "auto" (K/V read in bf16, float32 accumulation) and
# per-layer weights; its largest batch at 32k.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/d
timeout 330 python3 bench/generate.py --models llama-3-8b --points 16x4096,4x32768,1x4096 \
  --caches fp16 --group-size 128 --max-batch-context 32768 --deadline 230 \
  --out $OUT/d 2>&1 | grep -v "^W0000\|^I0000" | tail -6
