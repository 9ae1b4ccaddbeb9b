#!/bin/bash
# Run 36: GPU tests touching the cache write and the per-layer layout; auto-lowp end to end;
# the largest batch at 32k with per-layer weights (KIVI G = 128).
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/b $OUT/c
timeout 120 python3 -m pytest -q -x tests/test_attention.py -k "pallas_kernel or tuning" \
  tests/test_models.py -k "pallas_kernel or tuning or unstack or layout" 2>&1 | tail -3 | tee $OUT/pytest_run36.txt
timeout 150 python3 bench/generate.py --models llama-3-8b --points 16x4096,4x32768 \
  --caches kivi2 --impls auto-lowp --group-size 128 --no-max-batch --deadline 110 \
  --out $OUT/b 2>&1 | grep -v "^W0000\|^I0000" | tail -3
timeout 230 python3 bench/generate.py --models llama-3-8b --points "" --caches kivi2,fp16 \
  --impls auto --group-size 128 --max-batch-context 32768 --deadline 200 \
  --out $OUT/c 2>&1 | grep -v "^W0000\|^I0000" | tail -4
