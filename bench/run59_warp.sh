#!/bin/bash
# Run 59: the per-warp softmax (`TuningConfig.warp_softmax`, `_warp_softmax`): ptxas registers
# of the anchor's kernel with it and without, the GPU tests of the kernel module, and A/B at
# the anchor in one process (warp_softmax=0 is the previous loop).
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R=${RUN:-59}
for fl in "" "warp_softmax=0"; do
  rm -rf /tmp/px; MOSAIC_GPU_DUMP_TO=/tmp/px MOSAIC_GPU_DUMP_PTXAS=1 timeout 120 \
    python3 bench/dump_ptx.py --kb 2 --G 128 --flags "$fl" > /tmp/px.log 2>&1
  echo "flags=[$fl]"; grep -rhoE "Used [0-9]+ registers|[0-9]+ bytes spill (stores|loads)" /tmp/px /tmp/px.log | sort | uniq -c
done 2>&1 | tee $OUT/ptxas_${D}_run$R.txt
timeout 200 python3 bench/point_compare.py --points 8x131072 --kbg 2:128,4:128 \
  --variants "default;warp_softmax=0;skip=loads;wg_per_block=3,stages=3,num_splits=6;default;warp_softmax=0" \
  2>&1 | grep "^|" | tee $OUT/ab_${D}_run$R.txt
timeout 250 python3 -m pytest -q -x -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -15 \
  | tee $OUT/pytest_gpu_${D}_run$R.txt
