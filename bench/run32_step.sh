#!/bin/bash
# Run 32: decode step after the one-update residual write; cuBLAS / dynamic-slice fusion for the
# stacked-weight scan; GEMV bandwidth, Triton against cuBLAS.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 200 python3 bench/scratch/gemv.py 2>&1 | grep -v "^W0000\|^I0000" | tee $OUT/gemv_run32b.txt
P=1x4096:fp16:reference,1x4096:fp16:reference:cublas,1x4096:fp16:reference:cublas:dsf,16x4096:kivi2:auto,16x4096:kivi2:auto-lowp,16x4096:kivi2:auto:cublas:dsf,16x4096:kivi2:auto-lowp:cublas:dsf,16x4096:kivi2:auto:unstacked,4x32768:kivi2:auto:cublas:dsf
timeout 380 python3 bench/step_anatomy.py --label run32 --dump $OUT/hlo --points $P 2>&1 \
  | grep -v "^W0000\|^I0000" | tee $OUT/step_anatomy_run32.txt
gzip -9 $OUT/hlo/*.txt
