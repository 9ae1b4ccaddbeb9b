#!/bin/bash
# Run 34: the generation loop's compile time (cold, then from the persistent cache) and its
# while loop's largest writes.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
for i in 1 2; do
  timeout 200 python3 bench/scratch/loop_anatomy.py $OUT/hlo$i 2>&1 | grep -v "^W0000\|^I0000" | tee -a $OUT/loop_anatomy_run34.txt
done
rm -rf $OUT/hlo2; gzip -9 $OUT/hlo1/*.txt
