#!/usr/bin/env bash
# A change's cost on one GPU, measured in one call against the tree it started from: the llama-1b train step
# (benchmarks/throughput.py) and decoding at batch 1 and 32 (benchmarks/decode.py, ours only), each run for the
# baseline and for this tree in turn, ROUNDS times, every record labelled `before` or `after`.
#
#   git worktree add /tmp/base <commit>    # the baseline: any earlier checkout (mlm_jax/, benchmarks/, configs/)
#   benchmarks/before_after.sh /tmp/base RESULTS_DIR [train|decode|both] [ROUNDS]
#
# Records go to RESULTS_DIR/results.jsonl and RESULTS_DIR/RESULTS.md (merge them into benchmarks/ by hand).
set -euo pipefail
BASE=$(cd "$1" && pwd)
OUT=$(mkdir -p "$2" && cd "$2" && pwd)
WHAT=${3:-both}
ROUNDS=${4:-2}
HERE=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONUNBUFFERED=1

for round in $(seq "$ROUNDS"); do
  for side in before after; do
    tree=$HERE
    [ "$side" = before ] && tree=$BASE
    if [ "$WHAT" != decode ]; then
      (cd "$tree" && python benchmarks/throughput.py --config configs/llama-1b.yaml --steps 10 --warmup 3 \
        --label "$side, round $round" --results-dir "$OUT")
    fi
    if [ "$WHAT" != train ]; then
      (cd "$tree" && python benchmarks/decode.py --batches 1 32 --repeats 3 --skip-hf --results-dir "$OUT")
      echo "decode above: $side, round $round"
    fi
  done
done
