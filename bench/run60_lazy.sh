#!/bin/bash
# Run 60: the per-warp softmax with the conditional rescale (`lazy_rescale`, `_lazy_rescale`)
# and the ordered merge of the warps' outputs (`_merge_warp_rows`, deterministic): A/B at the
# anchor in one process, then the GPU tests of the kernel module.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R=${RUN:-60}
timeout 230 python3 bench/point_compare.py --points 8x131072 --kbg 2:128,4:128 \
  --variants "default;lazy_rescale=0;warp_softmax=0;skip=loads;default;warp_softmax=0" \
  2>&1 | grep "^|" | tee $OUT/ab_${D}_run$R.txt
timeout 300 python3 -m pytest -q -x -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -15 \
  | tee $OUT/pytest_gpu_${D}_run$R.txt
