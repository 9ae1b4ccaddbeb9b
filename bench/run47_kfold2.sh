#!/bin/bash
# Run 47: fold_k on mma.sync: four warpgroups per block, stages, 512-token steps (registers from
# ptxas), and the precision of fold_k on library-quantized K/V (bench/lowbit_error.py).
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
D=$(date +%F)
mkdir -p $OUT/ptxas
MOSAIC_GPU_DUMP_TO="$OUT/ptxas" MOSAIC_GPU_DUMP_PTXAS=1 python3 bench/probe_kernel.py \
  --set ${SET:-kfold2} --pairs ${PAIRS:-2:128,2:32,4:128} 2>&1 | grep -v "^{" | tail -22
mv $OUT/probe_rows.json $OUT/probe_${D}_run${RUN:-47}_${SET:-kfold2}.json
rm -rf $OUT/ptxas
timeout 240 python3 bench/lowbit_error.py --kernel --ts 8192,131072 --variants 0,4,5 2>&1 \
  | grep "^|" | tee "$OUT/lowbit_error_${D}_run${RUN:-47}.txt"
