# Sourced by drive.sh: the GPU host's paths and environment (or a dry run's: KG_DRY=1, see dry_run.sh).
ROOT=${KG_ROOT:-/tmp}
KG=$ROOT/kg           # everything the run writes; `pack` returns it after every call
STAGE=$ROOT/stage     # the carried payload parts, gathered across calls
SITE=$ROOT/site       # vLLM 0.26.0 and its light dependencies (payload A + B)
KVSITE=$ROOT/kvsite   # kvgate's wheel and the dependencies the host lacks
GPU_SRC=${GPU_SRC:-$REPO/.gpu}   # what this call carried (only the folders named in `carry` exist)
mkdir -p "$KG/done" "$KG/failed" "$KG/res" "$STAGE"
export PYTHONPATH=$KVSITE:$SITE
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
# NVLink multicast stays off, in every process (the device README: it can take shared GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KVGATE_MOONCAKE_DIR=$STAGE/data/mooncake
PY=python3
if [ "${KG_DRY:-0}" = 1 ]; then
  # python3 = a Python 3.12 venv holding the host image's packages; `vllm` = the simulator.
  export PATH=$KG_DRY_BIN:$PATH
  export PYTHONPATH=$REPO/tests/fake_vllm:$PYTHONPATH
  export FAKE_VLLM_STARTUP_S=${FAKE_VLLM_STARTUP_S:-8}
fi
untar() {  # the host may lack xz(1); Python's tarfile reads .tar.xz too
  if command -v xz >/dev/null; then tar -C "$ROOT" -xJf "$1"; else
    $PY -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$1" "$ROOT"; fi
}
