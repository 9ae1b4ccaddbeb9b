#!/bin/bash
# Run 74: the floors again with the kernel of this commit: the load pipeline alone for four
# cache layouts (bench/page_probe.py: six, four, two or one copy per 256-token step), and at
# the anchor the compute without the copies' issue (skip="copies") beside the compute with
# L2-resident copies (skip="loads") and the load pipeline alone (skip="compute").
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R=${RUN:-74}
timeout 150 python3 bench/page_probe.py 2>&1 | grep "^|" | tee $OUT/page_probe_${D}_run$R.txt
timeout 200 python3 bench/point_compare.py --points 8x131072 --kbg 2:128 \
  --variants "default;skip=copies;skip=loads;skip=compute;default;skip=copies" 2>&1 \
  | grep "^|" | tee $OUT/ab_${D}_run$R.txt
timeout 150 python3 bench/point_compare.py --points 8x131072 --kbg 2:32,4:128 \
  --variants "default;skip=copies;skip=compute" 2>&1 | grep "^|" \
  | tail -n +2 | tee -a $OUT/ab_${D}_run$R.txt
