#!/bin/bash
# tools/upstream-tests on an offline GPU host, from wheels only (docs/upstream-tests.md, "GPU matrices").
#
#   tools/upstream_tests/offline-gpu.sh "TARGET..." WALL_SECONDS TOOL_ARGS...
#
# TARGET: fork (the fork's wheel) or up (upstream's 0.19.8 wheel). For each, in this order: installs the wheel
# with `pip --target`, JIT-builds the ops the GPU matrices load (DeepCompile, FusedAdam, CPUAdam; all targets
# at once, before any test runs), then runs `tools/upstream-tests UT_TESTS TOOL_ARGS --deepspeed-path ...
# --wall-timeout WALL_SECONDS --out UT_OUTDIR/TARGET --summary-dir $OUT` and prints its summary. Exit status:
# the worst of the runs. WALL_SECONDS written @S is a budget for the whole script: each run's wall-clock limit
# is then S less the seconds spent so far (installs, op builds, earlier targets), so it ends within S; 0 installs
# and builds only. gpu-common.sh holds the environment and the `tool` function the runs share.
# UT_OUTDIR (default $OUT): where each run's full output directory goes; a GPU loan returns at most 8 files of
# $OUT, so ledger runs (--ledger) put it elsewhere and keep in $OUT only the logs and one summary per shard.
# What it uses, by default from one directory UT_CARRY (.upstream-tests/gpu-carry, git-ignored):
#   UT_CARRY/tests/            upstream's tests/ (UT_TESTS)
#   UT_CARRY/wheels/fork/      the fork's wheel (UT_FORK)
#   UT_CARRY/wheels/upstream/  upstream's 0.19.8 wheel (UT_UP)
#   UT_CARRY/wheels/deps/      wheels the host lacks: deepspeed's hjson, pydantic (+ pydantic_core,
#                              annotated_types, typing_inspection); pytest-forked, pytest-xdist, execnet,
#                              pytest-timeout
# UT_UP_ARCH: TORCH_CUDA_ARCH_LIST for upstream, 9.0 (0.19.8 cannot JIT-build for the 9.0a of CUDA 13 images).
# UT_OPS: the op builders to JIT-build first (default: DeepCompileBuilder FusedAdamBuilder CPUAdamBuilder).
set -u
targets=$1 wall=$2
shift 2
OUT=${OUT:-/tmp/upstream-tests-out}
UT_OUTDIR=${UT_OUTDIR:-$OUT}
# shellcheck source=tools/upstream_tests/gpu-common.sh
. "$(dirname "$0")/gpu-common.sh"
UT_FORK=${UT_FORK:-$(echo "$UT_CARRY"/wheels/fork/deepspeed-*.whl)}
UT_UP=${UT_UP:-$(echo "$UT_CARRY"/wheels/upstream/deepspeed-*.whl)}
UT_OPS=${UT_OPS-DeepCompileBuilder FusedAdamBuilder CPUAdamBuilder}
T0=$(date +%s)
stamp() { echo "[$(($(date +%s) - T0)) s] $*"; }
pipt() { python3 -m pip install -q --no-index --no-deps --no-compile --target "$@"; }
mkdir -p "$OUT"

nvidia-smi -L
python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__)"
rm -rf /tmp/ut-deps && pipt /tmp/ut-deps "$UT_CARRY"/wheels/deps/*.whl || exit 2
for t in $targets; do
  wheel=$([ "$t" = up ] && echo "$UT_UP" || echo "$UT_FORK")
  rm -rf "/tmp/ut-$t" && pipt "/tmp/ut-$t" "$wheel" || exit 2
  echo "$t: $(basename "$wheel"), $(grep -c "\.patch'" "/tmp/ut-$t/deepspeed/fork_info.py" 2>/dev/null || echo 0) fork patches"
done
stamp installed

# the ops of every target at once, each in the tree its tests will use (the tool's --prebuild)
if [ -n "$UT_OPS" ]; then
  for t in $targets; do
    # shellcheck disable=SC2086  # UT_OPS is a list of names
    tool "$t" --matrix gpu-compile --wall-timeout 200 --prebuild $UT_OPS --prebuild-only > "$OUT/build-$t.log" 2>&1 &
  done
  wait
  grep -h '^upstream-tests: prebuil' "$OUT"/build-*.log
  # a build cut off by the time limit leaves its lock, on which every later load of that op would wait
  find /tmp/ut-ext-* -maxdepth 2 -name lock -print -delete
fi
stamp "ops built"
[ "$wall" = 0 ] && exit 0  # installs and op builds only (fork-then-upstream.sh runs the tests)

worst=0
for t in $targets; do
  limit=$wall
  [ "${wall#@}" != "$wall" ] && limit=$(( ${wall#@} - $(date +%s) + T0 ))
  [ "$limit" -lt 60 ] && { stamp "$t: not run, ${limit} s left of $wall"; worst=2; continue; }
  tool "$t" --wall-timeout "$limit" --out "$UT_OUTDIR/$t" --summary-dir "$OUT" "$@" > "$OUT/log-$t.txt" 2>&1
  rc=$?
  [ $rc -gt $worst ] && worst=$rc
  stamp "$t: exit $rc"
  grep -h -e '^upstream-tests: matrix' -e 'not started' -e '^upstream-tests: error' "$OUT/log-$t.txt"
  sed -n '/^=== upstream-tests/,/result: /p' "$OUT/log-$t.txt"
done
exit $worst
