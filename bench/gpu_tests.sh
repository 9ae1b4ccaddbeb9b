#!/usr/bin/env bash
# The GPU tests natively, in SHARDS pytest processes side by side on the one GPU.
#
#     SHARDS=6 bash bench/gpu_tests.sh SUMMARY [LIMIT_S]
#
# Runs every test marked `gpu` (the kernel's native cases) and all of tests/test_attention.py
# (the dispatch tests, which take the Pallas path where a Hopper GPU is present), split round
# robin over SHARDS processes (default 6), each with 0.8 / SHARDS of the GPU's memory and at
# most LIMIT_S seconds (default 260). Shards because compiling is the CPU's work, one core per
# process: on a cold compile cache the kernel module's cases in one process outlast a 10-minute
# device call. Writes the test count and each shard's pytest summary to SUMMARY; exits 1 if a
# shard failed or timed out. Needs a Hopper GPU; runs from anywhere (it changes to the repo).
set -euo pipefail
summary=$(realpath -m "${1:?usage: bash bench/gpu_tests.sh SUMMARY [LIMIT_S]}")
cd "$(dirname "$0")/.."
limit=${2:-260}
n=${SHARDS:-6}
py=${PYTHON:-python3}
frac=$("$py" -c "print(round(0.8 / $n, 3))")
work=$(mktemp -d)
{ "$py" -m pytest -q -p no:cacheprovider --collect-only -m gpu tests || true
  "$py" -m pytest -q -p no:cacheprovider --collect-only tests/test_attention.py || true
} 2>/dev/null | { grep "::" || true; } | sort -u > "$work/ids.txt"
[ -s "$work/ids.txt" ] || { echo "no tests collected" >&2; exit 1; }
echo "$(wc -l < "$work/ids.txt") tests in $n shards" | tee "$summary"
pids=()
for i in $(seq 0 $((n - 1))); do
  awk -v i="$i" -v n="$n" 'NR % n == i' "$work/ids.txt" > "$work/shard$i.txt"
  mapfile -t ids < "$work/shard$i.txt"  # node ids may hold spaces (parametrized configs)
  if [ "${#ids[@]}" -gt 0 ]; then
    XLA_PYTHON_CLIENT_MEM_FRACTION=$frac timeout "$limit" "$py" -m pytest -q -p no:cacheprovider \
      "${ids[@]}" > "$work/shard$i.log" 2>&1 &
    pids+=($!)
  fi
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done  # a failed or timed-out shard
for i in $(seq 0 $((n - 1))); do
  [ -f "$work/shard$i.log" ] || continue
  { grep -iE "passed|failed|error" "$work/shard$i.log" || echo "no summary"; } | tail -8 \
    | sed "s/^/shard $i: /" | tee -a "$summary"
done
exit $status
