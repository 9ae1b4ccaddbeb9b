#!/bin/bash
# Run 40: mma.sync products: warpgroups per block, splits, floors, mixed products.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
D=$(date +%F)
mkdir -p $OUT
python3 bench/probe_kernel.py --set ${SET:-mma2} --pairs ${PAIRS:-2:128,4:128,2:32} 2>&1 | grep -v "^{" | tail -25
cp probe_rows.json $OUT/probe_${D}_run${RUN:-40}_${SET:-mma2}.json
