# shellcheck shell=bash
# Sourced by offline-gpu.sh and fork-then-upstream.sh: what every run of tools/upstream-tests on an offline GPU host
# shares. `tool TARGET ARGS...` runs it on the package offline-gpu.sh installed for TARGET (fork or up), with that
# target's own op and Inductor folders; UT_TESTS is upstream's tests/ (default UT_CARRY/tests).
UT_CARRY=${UT_CARRY:-.upstream-tests/gpu-carry}
UT_TESTS=${UT_TESTS:-$UT_CARRY/tests}
UT_UP_ARCH=${UT_UP_ARCH:-9.0}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# no internet: a test that downloads from huggingface.co fails at once instead of retrying until its run is cut
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TORCHINDUCTOR_COMPILE_THREADS=1
# The GPU image has no libaio, so the async_io op is "not compatible" and the NVMe offload tests skip; the carry
# folder may bring one (UT_CARRY/libaio/{include,lib}: docs/upstream-tests.md, "The carry folder"), found by gcc
# through CPATH and LIBRARY_PATH (the op's compatibility check and build) and by the loader through LD_LIBRARY_PATH.
if [ -f "$UT_CARRY/libaio/include/libaio.h" ]; then
  aio=$(cd "$UT_CARRY/libaio" && pwd)
  export CPATH=$aio/include${CPATH:+:$CPATH} LIBRARY_PATH=$aio/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
  export LD_LIBRARY_PATH=$aio/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

# the image's own TORCH_CUDA_ARCH_LIST for the fork; UT_UP_ARCH for upstream
arch() { if [ "$1" = up ]; then echo "TORCH_CUDA_ARCH_LIST=$UT_UP_ARCH"; else env | grep '^TORCH_CUDA_ARCH_LIST='; fi; }
tool() {  # target args...: tools/upstream-tests on the target's package
  local t=$1
  shift
  # shellcheck disable=SC2046  # arch prints one NAME=VALUE word or none
  env $(arch "$t") PYTHONPATH=/tmp/ut-deps TORCH_EXTENSIONS_DIR="/tmp/ut-ext-$t" \
    TORCHINDUCTOR_CACHE_DIR="/tmp/ut-inductor-$t" python3 tools/upstream-tests "$UT_TESTS" --deepspeed-path "/tmp/ut-$t" "$@"
}
