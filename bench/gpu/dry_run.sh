#!/bin/bash
# Dry run of the H200 procedure against the simulator, call by call as on the device: each call sees
# only the .gpu folders that the README's `carry` list gives it, runs drive.sh with the same LIMIT,
# and its $OUT is checked against what a call may return (at most 8 files of at most 16 MiB).
# `vllm` is tests/fake_vllm (the simulator behind vLLM's command line), `python3` a Python 3.12
# venv with the host image's packages; the payload is unpacked for real (its pydantic, pyzmq,
# opentelemetry... serve kvgate as on the host). Nothing here needs a GPU.
#   bench/gpu/dry_run.sh                  # every call (about 35 minutes on two cores)
#   DRY_CALLS="1 2" bench/gpu/dry_run.sh  # the first two
# Environment: DRY_CARD (h100 or h200, default h100), DRY_ROOT (scratch, default /tmp/kvgate-dry), DRY_LIMITS (per call, default
# "570 570 570 400 300"), DRY_GAP (seconds between calls, default 5), FAKE_VLLM_STARTUP_S (8),
# DRY_KEEP=1 (leave the fleet running at the end, for a later DRY_CALLS; stop it with a run without).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
WORK=${GPU_BUILD:-/tmp/kvgate-gpu-build}
DRY=${DRY_ROOT:-/tmp/kvgate-dry}
read -r -a LIMITS <<< "${DRY_LIMITS:-570 570 570 400 300}"
# By call number, as in README.md; QUEUE=pd carries NIXL in call 3 instead of the Mooncake data in 2,
# QUEUE=tiers the peers' archive.
case "${QUEUE:-all}" in
  pd) CARRY=("" "c1 wheels" "c2" "nixl" "" "") ;;
  tiers|tiers-order) CARRY=("" "c1 wheels" "c2" "c3" "peers" "") ;;  # c3: only when the tree left call 2 short
  *) CARRY=("" "c1 wheels" "c2 data" "" "" "") ;;
esac
# The card the dry run plays (bench/gpu/card.py; the simulator takes the same shape): DRY_CARD, h100 by default.
export KG_CARD=${DRY_CARD:-h100}
[ -d "$REPO/.gpu/c1" ] || { echo "build the payload first: bench/gpu/build_payload.sh"; exit 2; }

if [ ! -x "$WORK/hostvenv/bin/python3" ]; then  # the GPU host's image holds these (device KINDS.md)
  PY312=${PY312:-$(ls -d "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12.*/bin/python3.12 | tail -1)}
  "$PY312" -m venv "$WORK/hostvenv"
  "$WORK/hostvenv/bin/pip" install -q aiohttp httpx msgpack uvloop xxhash pyyaml tiktoken prometheus-client \
    matplotlib psutil numpy requests protobuf tokenizers || exit 1
fi
stop_fleets() {
  for f in "$DRY"/host/kg/gateway_*.pid; do
    [ -f "$f" ] || continue
    pid=$(cat "$f"); kill "$pid" 2>/dev/null
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  done
}
[ -n "${DRY_KEEP:-}" ] || trap stop_fleets EXIT   # DRY_KEEP=1: the fleet outlives this script (later calls)
case " ${DRY_CALLS:-1} " in *" 1 "*) stop_fleets; rm -rf "$DRY" ;; esac
mkdir -p "$DRY"
tree_bytes=$(cd "$REPO" && git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
for call in ${DRY_CALLS:-1 2 3 4}; do
  src=$DRY/tree$call/.gpu
  rm -rf "$DRY/tree$call" "$DRY/out/call$call"
  mkdir -p "$src" "$DRY/out/call$call"
  carried=0
  for c in ${CARRY[$call]}; do
    [ -d "$REPO/.gpu/$c" ] || continue  # c3 exists only when the tree left call 2 short of room
    ln -s "$REPO/.gpu/$c" "$src/$c"
    carried=$(( carried + $(du -cbL "$REPO/.gpu/$c" | tail -1 | cut -f1) ))
  done
  limit=${LIMITS[$((call - 1))]:-300}
  echo "##### dry call $call: carry [${CARRY[$call]}], travels $(( (tree_bytes + carried) / 1048576 )) MiB" \
       "(limit 64), LIMIT=$limit"
  start=$(date +%s)
  GPU_SRC=$src OUT=$DRY/out/call$call KG_ROOT=$DRY/host KG_DRY=1 KG_DRY_BIN=$WORK/hostvenv/bin LIMIT=$limit \
    timeout $(( limit + 30 )) bash "$HERE/drive.sh" > "$DRY/call$call.log" 2>&1
  rc=$?
  files=$(find "$DRY/out/call$call" -type f | wc -l)
  big=$(find "$DRY/out/call$call" -type f -size +16M | wc -l)
  echo "##### call $call: rc $rc, $(( $(date +%s) - start )) s; \$OUT: $files files (max 8), $big over 16 MiB:" \
       "$(cd "$DRY/out/call$call" && ls -s --block-size=K | tr '\n' ' ')"
  tail -5 "$DRY/call$call.log"
  sleep "${DRY_GAP:-5}"
done
