#!/bin/bash
# Run 77: the keys' bias of all of a sub-step's groups from one mma.sync (bias_rows) and the
# key vectors by 64-bit loads (vec64): their GPU cases (49-53), then an A/B in one process
# (each variant twice) at the anchor for 2-bit G=128 (W=4), 2-bit G=32 (W=3), 4-bit G=128.
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R=${RUN:-77}
timeout 170 python3 -m pytest -q -x -m gpu tests/test_kivi_decode_sm90.py \
  -k "49 or 50 or 51 or 52 or 53" 2>&1 | tail -4 | tee $OUT/pytest_gpu_${D}_run$R.txt
V="default;bias_rows=1;vec64=1;bias_rows=1,vec64=1"
timeout 200 python3 bench/point_compare.py --points 8x131072 --kbg 2:128,2:32 \
  --variants "$V;$V" 2>&1 | grep "^|" | tee $OUT/ab_${D}_run$R.txt
timeout 100 python3 bench/point_compare.py --points 8x131072 --kbg 4:128 \
  --variants "default;bias_rows=1,vec64=1;default;bias_rows=1,vec64=1" 2>&1 | grep "^|" \
  | tail -n +2 | tee -a $OUT/ab_${D}_run$R.txt
