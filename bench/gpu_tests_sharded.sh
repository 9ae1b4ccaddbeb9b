#!/usr/bin/env bash
# The kernel module's GPU cases and the dispatch tests natively, in SHARDS pytest processes side
# by side on the one GPU (default 6, each 0.8 / SHARDS of its memory; compiling is the CPU's,
# one core per process: the module in one process outgrew a call's time on a cold compile
# cache, run 94; four shards of 29-30 tests took 264-287 s in run 128). Summaries to $1; $2:
# each shard's time limit in seconds (default 260). For the run scripts (107-).
set -u
R=$1
LIMIT=${2:-260}
N=${SHARDS:-6}
FRAC=$(python3 -c "print(round(0.8 / $N, 3))")
{ python3 -m pytest -q -p no:cacheprovider --collect-only -m gpu tests/test_kivi_decode_sm90.py
  python3 -m pytest -q -p no:cacheprovider --collect-only tests/test_attention.py
} 2>/dev/null | grep "::" > /tmp/ids.txt
echo "$(wc -l < /tmp/ids.txt) tests in $N shards" | tee "$R"
for i in $(seq 0 $((N - 1))); do
  awk -v i=$i -v n=$N 'NR % n == i' /tmp/ids.txt > /tmp/shard$i.txt
  mapfile -t ids < /tmp/shard$i.txt  # node ids with spaces (the dispatch tests' configs)
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRAC timeout "$LIMIT" python3 -m pytest -q -p no:cacheprovider \
    "${ids[@]}" > /tmp/shard$i.log 2>&1 &
done
wait
for i in $(seq 0 $((N - 1))); do grep -iE "passed|failed|error" /tmp/shard$i.log | tail -8 \
  | sed "s/^/shard $i: /" | tee -a "$R"; done
