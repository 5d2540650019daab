#!/usr/bin/env bash
# The engine benchmarks of two source trees back to back in one call, on one GPU machine:
# this tree and an earlier one unpacked beside it (`mkdir prev && git archive REV | tar -x -C prev`).
# Each tree is installed into a site folder of its own (not editable), so neither sees the other.
#
#   tools/bench/engine/two_trees.sh PREV_DIR decode       # batch-1 decode, Qwen3-8B and SmolLM2-135M, A B A B
#   tools/bench/engine/two_trees.sh PREV_DIR throughput   # 1000 x (1000 in, 1000 out), fp8 KV, max_num_seqs 512
#
# Wheels the machine lacks come from .whl/ (../shared/gpu/wheels.sh); rows go to $OUT/*.jsonl.
set -uo pipefail
prev=$1 what=$2
out=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
for tree in new prev; do
  src=.; [ $tree = prev ] && src=$prev
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/${tree}_site "$src" \
    >/dev/null 2>&1 || { echo "installing $src failed"; exit 1; }
done
run() {  # label tree site engine-benchmark-args...
  local label=$1 tree=$2 site=$3 bench=tools/bench/engine/engine.py; shift 3
  [ -f "$tree/$bench" ] || bench=tools/bench_engine.py  # a tree from before tools/bench/
  echo "=== $label ($tree): $bench $*"
  (cd "$tree" && PYTHONPATH=$site:/tmp/site python3 $bench "$@" --results "$out/$label-$what.jsonl" 2>&1 | tail -12)
}
case $what in
  decode)
    for _ in 1 2; do
      run prev "$prev" /tmp/prev_site --decode qwen3-8b,smollm2-135m
      run new . /tmp/new_site --decode qwen3-8b,smollm2-135m
    done
    PYTHONPATH=/tmp/new_site:/tmp/site python3 tools/bench/engine/stats.py ;;
  throughput)
    run prev "$prev" /tmp/prev_site --throughput --kv-cache-dtype fp8 --max-num-seqs 512
    run new . /tmp/new_site --throughput --kv-cache-dtype fp8 --max-num-seqs 512 ;;
  *) echo "usage: $0 PREV_DIR decode|throughput"; exit 2 ;;
esac
