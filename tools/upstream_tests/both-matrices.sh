#!/bin/bash
# Both GPU matrices at once on one GPU host (docs/upstream-tests.md, "Session 21"):
#
#   OUT=DIR tools/upstream_tests/both-matrices.sh WALL_SECONDS [TEXT...]
#
# Installs the fork's wheel (and 0.19.8's when TEXT is given) from UT_CARRY and JIT-builds their ops once
# (offline-gpu.sh), then runs side by side, each with its own master ports, until WALL_SECONDS after the start:
#   gpu-zero     the fork's ledger shards without a result, their node ids in one pass (--together, ZW workers)
#   gpu-compile  the same for gpu-compile (its node ids left are mostly upstream's `sequential` ones, run one after
#                another: CT, the seconds a test may take, keeps one that waits from holding the pass)
#   verdicts     with TEXT: the gpu-compile node ids containing any TEXT, on the fork and on 0.19.8, outside the
#                ledger (e.g. the fork's failures of shards that are not complete yet)
# $OUT gets ut.tgz (logs, the shard summaries in s/ for --record, the verdict runs) and the summary on stdout.
# Back here: tools/upstream-tests --ledger tests/upstream/ledger.json --record EXTRACTED/s, then commit the ledger
# before the next command: a command run from the same ledger runs the same node ids again.
set -u
wall=${1:?usage: OUT=DIR both-matrices.sh WALL_SECONDS [TEXT...]}
shift
END=$(( $(date +%s) + wall ))
LEDGER=tests/upstream/ledger.json
# shellcheck source=tools/upstream_tests/gpu-common.sh
. "$(dirname "$0")/gpu-common.sh"
X=$OUT/x
mkdir -p "$X/s"
targets=fork
[ $# -gt 0 ] && targets="fork up"
OUT=$X bash "$(dirname "$0")/offline-gpu.sh" "$targets" 0  # installs and op builds only
ut() {  # TARGET ARGS...: gpu-common.sh's tool with the GPU matrices' conditions, until END
  tool "$1" --condition offline --condition edaa722 --condition gpu-forked --wall-timeout $(( END - $(date +%s) )) "${@:2}"
}
echo "[$(date +%T)] ops built, $(( END - $(date +%s) )) s left"
ut fork --matrix gpu-zero --ledger $LEDGER --next 999 --together --workers "${ZW:-16}" --out /tmp/ut-out/zero \
  --summary-dir "$X/s" -- --timeout 240 > "$X/log-zero.txt" 2>&1 &
ut fork --matrix gpu-compile --ledger $LEDGER --next 999 --together --workers 4 --port-base 40000 \
  --out /tmp/ut-out/compile --summary-dir "$X/s" -- --timeout "${CT:-90}" > "$X/log-compile.txt" 2>&1 &
if [ $# -gt 0 ]; then
  only=()
  for text in "$@"; do only+=(--only "$text"); done
  ut fork --matrix gpu-compile "${only[@]}" --workers 6 --port-base 45000 --out "$X/verdict-fork" -- --timeout 240 \
    > "$X/log-verdict-fork.txt" 2>&1 &
  ut up --matrix gpu-compile "${only[@]}" --workers 6 --port-base 50000 --out "$X/verdict-up" -- --timeout 240 \
    > "$X/log-verdict-up.txt" 2>&1 &
fi
wait
echo "[$(date +%T)] done"
for f in /tmp/ut-out/compile/pytest-*.log; do [ -f "$f" ] && cp "$f" "$X/compile-$(basename "$f")"; done
for f in "$X"/log-*.txt; do
  echo "=== $f"
  grep -h -e '^upstream-tests: matrix' -e '^upstream-tests: error' -e 'result: ' -e 'done in' "$f" | cut -c1-300 | uniq -c
done
for d in "$X"/verdict-*; do
  [ -f "$d/summary.json" ] || continue
  echo "=== $d"
  python3 -c "
import json, sys
s = json.load(open(sys.argv[1]))
print(s['counts'])
for r in s['tests']:
    print(r['verdict'], r['nodeid'], '|', r['message'][:200].replace(chr(10), ' '))" "$d/summary.json"
done
echo "$(find "$X/s" -name "*.json" | wc -l) shard summaries in s/"
(cd "$X" && tar czf "$OUT/ut.tgz" .) && rm -rf "$X"
