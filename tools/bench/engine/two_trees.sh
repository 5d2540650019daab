#!/usr/bin/env bash
# The engine and served benchmarks of two source trees back to back in one call, on one GPU machine:
# this tree and an earlier one unpacked beside it (`mkdir prev && git archive REV | tar -x -C prev`).
# Each tree is installed into a site folder of its own (not editable), so neither sees the other.
#
#   tools/bench/engine/two_trees.sh PREV_DIR decode       # batch-1 decode, Qwen3-8B and SmolLM2-135M, A B A B
#   tools/bench/engine/two_trees.sh PREV_DIR throughput   # 1000 x (1000 in, 1000 out), fp8 KV, max_num_seqs 512
#   tools/bench/engine/two_trees.sh PREV_DIR serve TOK    # served idle TTFT and the 4,096-token prefix, A B A B
#                                                         # (TOK: serve.py --export-tokenizer's folder)
#
# Wheels the machine lacks come from .whl/ (../shared/gpu/wheels.sh); rows go to $OUT/*.jsonl.
# Both trees run with a sitecustomize that settles transformers' hub-kernels check before a
# script puts its checkout's root on sys.path: an older tree's tools do, and there its kernels/
# folder would pass for the `kernels` package where that package is not installed.
set -uo pipefail
prev=$1 what=$2 tok=${3:-}
out=${OUT:-/tmp}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null || exit 1
for tree in new prev; do
  src=.; [ $tree = prev ] && src=$prev
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target /tmp/${tree}_site "$src" \
    >/dev/null 2>&1 || { echo "installing $src failed"; exit 1; }
done
custom=/tmp/two_trees_custom
mkdir -p $custom
printf 'try:\n    import transformers.integrations.hub_kernels  # noqa: F401\nexcept Exception:\n    pass\n' \
  > $custom/sitecustomize.py
run() {  # label tree site new-path old-path args...
  local label=$1 tree=$2 site=$3 bench=$4; shift 4
  [ -f "$tree/$bench" ] || bench=$1  # a tree from before tools/bench/
  shift
  echo "=== $label ($tree): $bench $*"
  (cd "$tree" && PYTHONPATH=$custom:$site:/tmp/site python3 $bench "$@" --results "$out/$label-$what.jsonl" 2>&1 | tail -12)
}
both() {  # new-path old-path args...
  run prev "$prev" /tmp/prev_site "$@"
  run new . /tmp/new_site "$@"
}
case $what in
  decode)
    for _ in 1 2; do both tools/bench/engine/engine.py tools/bench_engine.py --decode qwen3-8b,smollm2-135m; done
    PYTHONPATH=/tmp/new_site:/tmp/site python3 tools/bench/engine/stats.py ;;
  throughput)
    both tools/bench/engine/engine.py tools/bench_engine.py --throughput --kv-cache-dtype fp8 --max-num-seqs 512 ;;
  serve)
    [ -d "$tok" ] || { echo "serve needs the tokenizer folder: $0 PREV_DIR serve TOK"; exit 2; }
    tok=$(cd "$tok" && pwd)
    for _ in 1 2; do both tools/bench/serve/serve.py tools/bench_serve.py --rows ttft,prefix --tokenizer-dir "$tok"; done ;;
  *) echo "usage: $0 PREV_DIR decode|throughput|serve [TOK]"; exit 2 ;;
esac
