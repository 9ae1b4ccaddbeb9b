#!/bin/bash
# Run 35: generation loop after the token-axis flush moved to advance() (one read of the
# residual per step, before the layers' writes) and the barrier-ordered channel write.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/a
timeout 100 python3 bench/scratch/loop_anatomy.py 2>&1 | grep -v "^W0000\|^I0000" | tee $OUT/loop_anatomy_run35.txt
timeout 420 python3 bench/generate.py --models llama-3-8b --points 16x4096,4x32768,1x4096 \
  --caches kivi2,kivi4 --impls auto --group-size 128 --no-max-batch --deadline 360 \
  --out $OUT/a 2>&1 | grep -v "^W0000\|^I0000" | tail -9
