#!/bin/bash
# Run 31: anatomy of the Llama-3-8B decode step (stacked-weight scan vs unstacked layers vs
# dynamic-slice fusion; zero vs random cache for auto / auto-lowp).
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
P=${POINTS:-1x4096:fp16:reference,1x4096:fp16:reference:dsf,1x4096:fp16:reference:unstacked,1x4096:kivi2:auto,16x4096:kivi2:auto,16x4096:kivi2:auto-lowp,16x4096:kivi2:auto:random,16x4096:kivi2:auto-lowp:random,16x4096:kivi2:auto:unstacked,16x4096:kivi2:auto-lowp:unstacked,4x32768:kivi2:auto,4x32768:kivi2:auto:unstacked}
timeout 540 python3 bench/step_anatomy.py --label run31 --hlo --points $P 2>&1 \
  | grep -v "^W0000\|^I0000" | tee $OUT/step_anatomy_run31.txt
