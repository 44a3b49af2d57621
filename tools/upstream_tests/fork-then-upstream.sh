#!/bin/bash
# The last node ids of both GPU matrices on one GPU host (docs/upstream-tests.md):
#
#   OUT=DIR tools/upstream_tests/fork-then-upstream.sh WALL_SECONDS
#
# Installs the fork's and 0.19.8's wheels and JIT-builds their ops once (offline-gpu.sh), then in two phases on a
# copy of the ledger, each run with its own master ports:
#   1. until MID (after 3/5 of the time left): the fork's node ids without a result in gpu-zero and gpu-compile,
#      beside 0.19.8 on the fork's failures of the shards complete so far;
#   2. the fork's summaries recorded into the copy, so that the shards the fork completed in phase 1 get their
#      0.19.8 selection: 0.19.8 on everything it has left, until WALL_SECONDS after the start.
# ZW: xdist workers of the fork's gpu-zero run (default 16, for 4 GPUs; 12 suits 2); CT: the seconds a gpu-compile
# test may take (its node ids left are mostly upstream's `sequential` ones, run one after another: a test that waits
# must not hold the pass). $OUT gets ut.tgz (logs, the summaries in s1/ and s2/) and the summary on stdout. Back
# here: record s1, then s2 (tools/upstream-tests --ledger tests/upstream/ledger.json --record EXTRACTED/s1, then
# EXTRACTED/s2), and commit the ledger before the next command, which otherwise runs the same node ids again.
set -u
wall=${1:?usage: OUT=DIR fork-then-upstream.sh WALL_SECONDS}
END=$(( $(date +%s) + wall ))
# shellcheck source=tools/upstream_tests/gpu-common.sh
. "$(dirname "$0")/gpu-common.sh"
X=$OUT/x
mkdir -p "$X/s1" "$X/s2"
OUT=$X bash "$(dirname "$0")/offline-gpu.sh" "fork up" 0  # installs and op builds only
L=$X/ledger.json
cp tests/upstream/ledger.json "$L"
MID=$(( $(date +%s) + (END - $(date +%s)) * 3 / 5 ))
ut() {  # TARGET MATRIX PHASE UNTIL PORT_BASE ARGS...: one ledger run of the remaining shards, in one pass
  tool "$1" --matrix "$2" --ledger "$L" --next 999 --together --condition offline --condition edaa722 \
    --condition gpu-forked --wall-timeout $(( $4 - $(date +%s) )) --port-base "$5" --out "/tmp/ut-out/$1-$2-$3" \
    --summary-dir "$X/s$3" "${@:6}" > "$X/log-$3-$1-$2.txt" 2>&1
}
echo "[$(date +%T)] ops built; phase 1 until $(date -d @$MID +%T), phase 2 until $(date -d @$END +%T)"
ut fork gpu-zero 1 "$MID" 20000 --workers "${ZW:-16}" -- --timeout 240 &
ut fork gpu-compile 1 "$MID" 30000 --workers 4 -- --timeout "${CT:-200}" &
ut up gpu-zero 1 "$MID" 40000 --workers 6 -- --timeout 240 &
ut up gpu-compile 1 "$MID" 50000 --workers 6 -- --timeout "${CT:-200}" &
wait
python3 tools/upstream-tests --ledger "$L" --record "$X/s1" | cut -c1-200
echo "[$(date +%T)] phase 2"
ut up gpu-zero 2 "$END" 40000 --workers 6 -- --timeout 240 &
ut up gpu-compile 2 "$END" 50000 --workers 6 -- --timeout "${CT:-200}" &
wait
python3 tools/upstream-tests --ledger "$L" --record "$X/s2" | cut -c1-200
echo "[$(date +%T)] done"
for f in "$X"/log-*.txt; do
  echo "=== $f"
  grep -h -e '^upstream-tests: matrix' -e '^upstream-tests: error' -e 'result: ' -e 'FAILED' -e 'done in' "$f" |
    cut -c1-300 | uniq -c
done
python3 tools/upstream-tests --ledger "$L" --status | grep -e 'node ids have a result' -e '^| `gpu-[a-z]*` | [fu]'
(cd "$X" && tar czf "$OUT/ut.tgz" --exclude ledger.json .) && rm -rf "$X"
