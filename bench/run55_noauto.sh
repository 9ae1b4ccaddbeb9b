#!/bin/bash
# Run 55: the kernel compiled without Mosaic's auto barriers where each hand-over has its own
# (`_no_auto_barriers`: one barrier before a step's six TMA copies instead of one per copy),
# and 4-bit with three or four warpgroups on 128-token steps. GPU tests of the kernel module,
# then A/B in one process against the kernels at 9dd6799 (prev) and 582ff8c (prev2):
# bench/scratch/kd_<rev>.py = `git show <rev>:pallas_kernels/kivi_decode_sm90.py` (not
# committed; the device call carries them).
set -x
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 PYTHONPATH=. KIVI_JAX_CACHE_DIR=/tmp/kc
D=$(date +%F)
R=${RUN:-55}
timeout 300 python3 -m pytest -q -x -m gpu tests/test_kivi_decode_sm90.py 2>&1 | tail -6 \
  | tee $OUT/pytest_gpu_${D}_run$R.txt
P=bench/scratch/kd_9dd6799.py,bench/scratch/kd_582ff8c.py
timeout 250 python3 bench/point_compare.py --points 8x131072 --kbg 2:128,2:32 --prev $P \
  --variants "prev;prev2;default;skip=loads;prev2;default" 2>&1 | grep "^|" \
  | tee $OUT/ab_${D}_run$R.txt
timeout 250 python3 bench/point_compare.py --points 8x131072 --kbg 4:128 --prev $P \
  --variants "prev2;default;wg_per_block=3,stages=3,block_tokens=128,num_splits=6;wg_per_block=3,stages=2,block_tokens=128,num_splits=6;wg_per_block=4,stages=2,block_tokens=128,num_splits=8;default" \
  2>&1 | grep "^|" | tail -n +2 | tee -a $OUT/ab_${D}_run$R.txt
