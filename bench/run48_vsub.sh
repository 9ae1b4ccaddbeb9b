#!/bin/bash
# Run 48: value code fields as fp16 subnormals against a running max over logit + log2 s_t
# (subnormal_values), logits in log2 units, fold_k and W = 4 as defaults: GPU tests of the
# kernel module, the anchor probe (registers from ptxas), the precision of the new default.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
D=$(date +%F)
mkdir -p $OUT/ptxas
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py ${TESTK:+-k "$TESTK"} 2>&1 | tail -15 \
  | tee $OUT/pytest_gpu_${D}_run${RUN:-48}.txt
MOSAIC_GPU_DUMP_TO="$OUT/ptxas" MOSAIC_GPU_DUMP_PTXAS=1 python3 bench/probe_kernel.py \
  --set ${SET:-vsub} --pairs ${PAIRS:-2:128,2:32,4:128} 2>&1 | grep -v "^{" | tail -16
mv $OUT/probe_rows.json $OUT/probe_${D}_run${RUN:-48}_${SET:-vsub}.json
rm -rf $OUT/ptxas
timeout 200 python3 bench/lowbit_error.py --kernel --ts 8192,131072 --variants 0,7 2>&1 \
  | grep "^|" | tee "$OUT/lowbit_error_${D}_run${RUN:-48}.txt"
