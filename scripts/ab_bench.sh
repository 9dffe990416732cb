#!/usr/bin/env bash
# Two trees timed against each other in one device call, alternating: `bench` of tree A, then of
# tree B, ROUNDS times (folders holding cupymoe/ and cuda/: the checkout `.` and, say, `.old` from
# `git archive REV cupymoe cuda | tar x -C .old`, carried). Each tree runs as `PYTHONPATH=<tree>
# python3 -P -m cupymoe`: plain `-m` puts the working folder first on sys.path, so from the
# checkout's root both runs would be the checkout's own package. The trees' source digests
# (jit.tree_digest, also in each result's meta) are compared first: the same digest stops the
# script (exit 3) before any GPU work. The rounds are scripts/trees_bench.sh's; logs and JSON as
# $OUT/ab.tgz.
#
#   OUT=/tmp/out A=.old B=. bash scripts/ab_bench.sh --preset qwen3-30b-a3b --format fp8_block --tokens 4096
#   (ROUNDS, default 2; NAMES, default "a b": the runs' file names; any bench option passes through)
set -u
DEST=${OUT:?set OUT to a folder for the logs}
A=${A:?A: the first tree}; B=${B:?B: the second tree}
read -r NA NB <<< "${NAMES:-a b}"
digest() { PYTHONPATH=$1 python3 -P -c "from cupymoe import jit; print(jit.tree_digest())"; }
DA=$(digest "$A") || exit 2
DB=$(digest "$B") || exit 2
echo "trees: $NA = $A (sources $DA), $NB = $B (sources $DB)"
if [ "$DA" = "$DB" ]; then
  echo "the two trees hold the same sources: nothing to compare" >&2
  exit 3
fi
W=$(mktemp -d)
trap 'tar czf "$DEST/ab.tgz" -C "$W" .' EXIT
for t in "$A" "$B"; do
  PYTHONPATH=$t timeout 200 python3 -P -m cupymoe kernels > "$W/kernels-$(basename "$t").log" 2>&1 || echo "kernels of $t failed"
done
OUT=$W TEST_K="" TREES="$NA:$A $NB:$B" ROUNDS=${ROUNDS:-2} bash "$(dirname "$0")/trees_bench.sh" "$@"
