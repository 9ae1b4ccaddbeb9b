#!/bin/bash
# Run 46: fold_k on mma.sync (code fields as fp16 subnormals, q * s_g per register, q . z_g by
# one mma.sync per two planes): GPU tests of the kernel module, then the anchor probe.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=.
D=$(date +%F)
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -m pytest -q -m gpu tests/test_kivi_decode_sm90.py ${TESTK:+-k "$TESTK"} 2>&1 | tail -15 \
  | tee $OUT/pytest_gpu_${D}_run${RUN:-46}.txt
python3 bench/probe_kernel.py --set ${SET:-kfold} --pairs ${PAIRS:-2:128,2:32,4:128} 2>&1 \
  | grep -v "^{" | tail -25
mv $OUT/probe_rows.json $OUT/probe_${D}_run${RUN:-46}_${SET:-kfold}.json
