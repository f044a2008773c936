#!/bin/bash
# The H200 run as a queue of steps (bench/gpu/README.md). Every device call runs this script: it does,
# in order, whatever is not done yet on this (warm) machine, starts a step only if its estimate fits
# before LIMIT seconds into the call, and always ends by packing the results into $OUT (kg.tar.gz,
# summary.md, steps.jsonl, drive.log). The managed fleet runs in its own session, so it survives
# between calls while the machine stays warm; waits for it resume in the next call.
# Dry run against the simulator: bench/gpu/dry_run.sh (this script with KG_DRY=1).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
source "$HERE/env.sh"
LIMIT=${LIMIT:-570}
T0=$(date +%s)
OUT=${OUT:?where the results go back from}
GW=http://127.0.0.1:8100
CTL=http://127.0.0.1:8101  # the gateway's control plane (fleet.yaml.tmpl's control.port)
CALL=$(( $(cat "$KG/calls" 2>/dev/null || echo 0) + 1 )); echo $CALL > "$KG/calls"
exec > >(tee -a "$KG/drive.log") 2>&1
TEE=$!
echo "=== call $CALL at $(date -u +%FT%TZ), limit $LIMIT s, carried: $(ls "$GPU_SRC" 2>/dev/null | tr '\n' ' ')"

el() { echo $(( $(date +%s) - T0 )); }
host() { (cd "$KG" && $PY -m bench.gpu.host "$@"); }
calc() { $PY -c "print(round($1, 2))"; }
finish() {
  echo "=== call $CALL ends at $(el) s; done: $(ls "$KG/done" | tr '\n' ' ')"
  [ -n "$(ls "$KG/failed")" ] && echo "=== failed: $(ls "$KG/failed" | tr '\n' ' ')"
  mkdir -p "$OUT"
  if [ -f "$KVSITE/.ok" ]; then host pack "$KG" "$OUT"; else tar -C "$ROOT" -czf "$OUT/kg.tar.gz" kg; fi
  exec >&- 2>&-
  for _ in $(seq 1 50); do kill -0 "$TEE" 2>/dev/null || break; sleep 0.1; done  # tee's last lines
  exit 0
}
# step NAME ESTIMATE_S COMMAND...: run COMMAND unless done (or failed) before; end this call when the
# estimate does not fit. COMMAND's rc 3 means "not finished, resume in the next call".
step() {
  local name=$1 est=$2 rc s
  shift 2
  [ -f "$KG/done/$name" ] && return 0
  [ -f "$KG/failed/$name" ] && return 0
  if [ $(( $(el) + est )) -gt "$LIMIT" ]; then echo "=== no time left for $name (~$est s) at $(el) s"; finish; fi
  echo "=== $name (~$est s) at $(el) s"
  s=$(date +%s)
  bounded "$@"
  rc=$?
  printf '%s\t%s\t%s\n' "$name" $(( $(date +%s) - s )) "$CALL" >> "$KG/timing.tsv"
  case $rc in
    0) touch "$KG/done/$name" ;;
    3) echo "=== $name resumes in the next call"; finish ;;
    *) echo "=== $name FAILED (rc $rc)"; touch "$KG/failed/$name" ;;
  esac
}
# A step that overruns its estimate is stopped (SIGTERM to its process group, then SIGKILL) 15 s
# after LIMIT, so that the call still packs its results before the device's own timeout.
bounded() {
  local budget=$(( LIMIT + 15 - $(el) )) pid dog rc
  set -m  # each in a process group of its own
  ( "$@" ) & pid=$!
  ( sleep "$budget"; echo "=== $1 stopped: the call's time is up"; kill -TERM -- -"$pid" 2>/dev/null
    sleep 5; kill -KILL -- -"$pid" 2>/dev/null ) &
  dog=$!
  set +m
  wait "$pid"; rc=$?
  kill -- -"$dog" 2>/dev/null  # the watchdog and its sleep: nothing may outlive the call holding its output
  return $rc
}
need() { for n in "$@"; do [ -f "$KG/done/$n" ] || { echo "=== $n is not done: nothing else can run"; finish; }; done; }
rate() { grep "^$1=" "$KG/rates.env" 2>/dev/null | tail -1 | cut -d= -f2; }
setrate() { echo "$1=$2" >> "$KG/rates.env"; echo "    $1=$2"; }

# ---- payload and kvgate ---------------------------------------------------------------------------------
for d in c1 c2 c3 wheels data peers nixl; do [ -d "$GPU_SRC/$d" ] && mkdir -p "$STAGE/$d" && cp -rfL "$GPU_SRC/$d"/. "$STAGE/$d/"; done
unpack_a() {
  [ -f "$STAGE/c1/A.tar.xz" ] || { echo "A.tar.xz not carried yet (call 1 carries .gpu/c1; a fresh machine starts again there)"; return 3; }
  untar "$STAGE/c1/A.tar.xz"
}
unpack_b() {
  # B.parts (call 1) says how many parts there are: 2, or 3 when a large tree left call 2 short of room.
  local n parts
  n=$(cat "$STAGE/c1/B.parts" 2>/dev/null || echo 2)
  parts=$(ls "$STAGE"/c*/B.part.* 2>/dev/null)  # c1/B.part.00, c2/B.part.01[, c3/B.part.02]: in order
  [ "$(echo "$parts" | grep -c .)" = "$n" ] || { echo "B parts ($n wanted): $parts"; return 3; }
  cat $parts > "$ROOT/B.tar.xz"
  (cd "$ROOT" && sha256sum -c "$STAGE/c1/B.sha256") || return 1
  untar "$ROOT/B.tar.xz" && rm -f "$ROOT/B.tar.xz"
}
kvgate_install() {
  ls "$STAGE"/wheels/*.whl >/dev/null 2>&1 || { echo "wheels not carried yet"; return 3; }
  $PY -m pip install -q --no-index --no-deps --no-compile --target "$KVSITE" "$STAGE"/wheels/*.whl || return 1
  cp "$STAGE/wheels/MANIFEST" "$KG/MANIFEST" 2>/dev/null
  [ -f "$KG/admin_key" ] || (umask 077; $PY -c "import secrets; print(secrets.token_hex(16))" > "$KG/admin_key")
  (cd "$KG" && $PY -c "
import gateway.server, gateway.fleet.launcher, gateway.routing.kv_events, gateway.control.admin, bench.gpu.host, zmq, msgpack, orjson, redis, pydantic
from gateway.prompt.tokens import get_tokenizer
assert get_tokenizer().name.startswith('tiktoken'), get_tokenizer().name
print('kvgate', gateway.__file__, 'tokenizer', get_tokenizer().name, 'pydantic', pydantic.VERSION, 'zmq', zmq.__version__)
") && touch "$KVSITE/.ok"
}
facts() {
  { echo "python: $($PY -c 'import sys; print(sys.version.split()[0])'), cores: $(nproc)"; df -h "$ROOT" | tail -1
    [ "${KG_DRY:-0}" = 1 ] && return 0
    nvidia-smi -L; $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; } | tee "$KG/facts.txt"
}
step facts 15 facts
step unpack_a 40 unpack_a
step kvgate 20 kvgate_install
# The card decides the model's shape and the fleets' KV (bench/gpu/card.py): card.env for every call.
step card 10 bash -c "cd '$KG' && $PY -m bench.gpu.card detect '$KG' '$ROOT/model'"
# QUEUE=recheck (issue 18, third sitting): while the payload's second part is on its way (call 1),
# the CPU-side measurements on the host's quiet cores; then the merged code on the real fleet
# (call 2) and the overhead beside sglang-router with the fleet stopped (call 3, carrying .gpu/peers).
if [ "${QUEUE:-all}" = recheck ]; then
  step cpu_decision 60 bash "$HERE/cpu_suite.sh" decision "$KG/res/cpu/decision"
  step cpu_seeds 420 env JOBS=7 bash "$HERE/cpu_suite.sh" seeds "$KG/res/cpu/seeds"
fi
step unpack_b 30 unpack_b
need unpack_a kvgate card unpack_b
source "$KG/card.env"
echo "=== card $CARD ($SIM_PROFILE): KV $KV_DTYPE, $KV_BYTES B a replica; tier fleet $TIERS_KV_BYTES B + $TIERS_OFFLOAD_GIB GiB CPU"
[ "${KG_DRY:-0}" = 1 ] && export FAKE_VLLM_PROFILE=$SIM_PROFILE   # the simulator behind vLLM, same shape

# ---- the managed fleet ------------------------------------------------------------------------------
fleet_start() {  # TAG KV_DTYPE BASE_PORT [TEMPLATE [KV_BYTES]]: render the config, record the command lines, start kvgate in its own session
  # A restarted fleet takes new ports: the old ones linger in TIME_WAIT, which the launcher counts as taken.
  local tag=$1 dtype=$2 port=$3 src=${4:-$HERE/fleet.yaml.tmpl} bytes=${5:-$KV_BYTES} cfg=$KG/fleet_$1.yaml
  (cd "$KG" && $PY -m bench.gpu.card render "$src" "$cfg" "ROOT=$ROOT" "KV_DTYPE=$dtype" "PORT=$port" \
     "KV_BYTES=$bytes" "OFFLOAD_GIB=$TIERS_OFFLOAD_GIB" "CUDART=$(cat "$KG/cudart" 2>/dev/null)") || return 1
  (cd "$KG" && $PY -m gateway check-config "$cfg") || return 1
  (cd "$KG" && $PY -m gateway launch --dry-run "$cfg") > "$KG/launch_dryrun_$tag.txt" || return 1
  cat "$KG/launch_dryrun_$tag.txt"
  host endpoints "$KG/launch_dryrun_$tag.txt" "$KG/endpoints.json" || return 1
  date +%s.%N > "$KG/fleet_${tag}_started"
  host start-gateway "$KG" "$tag" "$cfg"
}
fleet_stop() {  # TAG: SIGTERM the managing gateway; it stops its engines (SIGKILL after stop_grace_s)
  local pid; pid=$(cat "$KG/gateway_$1.pid")
  kill "$pid" 2>/dev/null
  for _ in $(seq 1 90); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  kill -0 "$pid" 2>/dev/null && { echo "gateway $1 still running after 90 s"; return 1; }
  [ "${KG_DRY:-0}" = 1 ] && return 0
  for _ in $(seq 1 30); do  # until the GPU's memory is given back
    used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
    [ "${used:-99999}" -lt 4000 ] && break; sleep 1
  done
  gpu_mem
}
fleet_wait() { host wait-fleet "$KG" "$CTL" --tag "$1" --deadline $(( T0 + LIMIT - 10 )); }
gpu_mem() { [ "${KG_DRY:-0}" = 1 ] || nvidia-smi --query-gpu=memory.used,memory.total --format=csv | tee -a "$KG/nvidia-smi.txt"; }
dtype() { if [ -f "$KG/fleet_fallback" ]; then echo auto; else echo "$KV_DTYPE"; fi; }
calib() { host calib "$KG" --gateway "$GW" --out "$1" && gpu_mem; }

# QUEUE=tiers: the four replicas with a CPU tier each, four times their GPU KV (card.py),
# then, on the same engines: the tiered workload for every router (routing-tiers-gpu), the canonicalization
# row (canonicalize-gpu) and mid-stream failover (failover-vllm). Priority order: kvgate's tier rows, the
# canonicalization rows, the peers' rows (their archive rides in call 3), failover (it kills a replica).
peers_install() {
  [ -f "$STAGE/peers/peers.tar.xz" ] || { echo "peers not carried yet (.gpu/peers)"; return 3; }
  tar -C "$KVSITE" -xJf "$STAGE/peers/peers.tar.xz" || return 1
  $PY -c "import sglang_router, smg; print('peers', sglang_router.__file__, smg.__file__)"
}
# QUEUE=tiers-order: the same fleet, kvgate's tier rows and radix_cache_aware alternated (two runs of
# each, so that an engine state drifting through the session cannot pose as a policy's cost), the peers
# once, then failover on with its control (answers never continued, asked again the same way).
if [ "${QUEUE:-all}" = tiers ] || [ "${QUEUE:-all}" = tiers-order ]; then
  step tiers_start 10 fleet_start tiers "$(dtype)" 8001 "$HERE/fleet_tiers.yaml.tmpl" "$TIERS_KV_BYTES"
  step tiers_wait 30 fleet_wait tiers
  if [ -f "$KG/failed/tiers_wait" ] && [ ! -f "$KG/fleet_fallback" ] && [ "$KV_DTYPE" = fp8 ]; then
    echo "=== the FP8 tier fleet does not start: again with the BF16 KV cache (same bytes)"
    fleet_stop tiers; touch "$KG/fleet_fallback"; rm -f "$KG/failed/tiers_wait" "$KG/done/tiers_start"
    step tiers_start 10 fleet_start tiers auto 8201 "$HERE/fleet_tiers.yaml.tmpl" "$TIERS_KV_BYTES"
    step tiers_wait 30 fleet_wait tiers
  fi
  need tiers_start tiers_wait
  step tiers_calib 40 calib calib_tiers.json
  # tiers CONFIG [RUN]: one run of CONFIG, its results under RUN (default CONFIG)
  tiers() { host scenario "$KG" "tiers_${2:-$1}" "routing-tiers-gpu/${2:-$1}" -- routing-tiers-gpu --size "$CARD" --only "$1"; }
  canon() { host scenario "$KG" "canon_$1" "canonicalize-gpu/$1" -- canonicalize-gpu --size "$CARD" --only "$1"; }
  failover() { host scenario "$KG" "$1" failover-vllm -- failover-vllm --size full --only "$1" \
      --model meta-llama/Llama-3.1-8B-Instruct --profile "$SIM_PROFILE"; }
  if [ "$QUEUE" = tiers-order ]; then
    # CONFIG:RUN pairs, 45 s each on an H100; the peers' archive rides in the next call.
    order() { for pair in "$@"; do step "tiers_${pair#*:}" 75 tiers "${pair%%:*}" "${pair#*:}"; done; }
    order radix_cache_aware:radix_1 tier_approx:approx_1 tier_precise:precise_1 \
      tier_approx:approx_2 radix_cache_aware:radix_2 tier_precise:precise_2
    step peers 25 peers_install
    [ -f "$KG/done/peers" ] && order smg:smg_1 sglang_router:sglang_1
    step failover_on 110 failover failover_on
    finish
  fi
  # 480 (H100) or 700 (H200) requests at 12 req/s, a fresh gateway and the caches' reset around them.
  for cfg in tier_precise tier_ignored tier_approx round_robin radix_cache_aware; do step "tiers_$cfg" 75 tiers $cfg; done
  for cfg in kvgate_canon kvgate_raw; do step "canon_$cfg" 80 canon $cfg; done   # 768 requests at 12 req/s
  step peers 25 peers_install
  if [ -f "$KG/done/peers" ]; then
    for cfg in sglang_router smg; do step "tiers_$cfg" 75 tiers $cfg; step "canon_$cfg" 80 canon $cfg; done
  fi
  # Mid-stream failover: kill -9 of one replica's API server under 40 streams (the supervisor restarts
  # it), SIGSTOP of another; each variant alone, with the fleet whole again in between.
  tiers_back() { date +%s.%N > "$KG/fleet_$1_started"; cp "$KG/gateway_tiers.pid" "$KG/gateway_$1.pid"
    ln -sf gateway_tiers.log "$KG/gateway_$1.log"; fleet_wait "$1"; }
  step failover_off 110 failover failover_off
  step tiers_back1 120 tiers_back tiers_back1
  step failover_on 110 failover failover_on
  finish
fi

# QUEUE=pd (issue 25): prefill/decode disaggregation on the one GPU. NIXL travels in a third call
# (.gpu/nixl): the tree and the payload leave no room for it in the first two.
if [ "${QUEUE:-all}" = pd ]; then
  nixl_install() {
    [ -f "$STAGE/nixl/nixl.tar.xz" ] || { echo "nixl not carried yet (.gpu/nixl)"; return 3; }
    tar -C "$SITE" -xJf "$STAGE/nixl/nixl.tar.xz" || return 1
    # UCX's CUDA transport loads the CUDA runtime by name: the one torch ships, found once here.
    $PY -c "import glob, os, sys; hits = glob.glob(os.path.join(sys.prefix, 'lib/python3*/site-packages/nvidia/*/lib/libcudart.so.1*')); print(os.path.dirname(hits[0]) if hits else '')" > "$KG/cudart"
    echo "CUDA runtime for UCX: $(cat "$KG/cudart")"
    [ "${KG_DRY:-0}" = 1 ] && return 0
    $PY -c "
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent('kvgate-check', nixl_agent_config(backends=['UCX']))
print('nixl', agent)"
  }
  pd_ref() { $PY -c "import json; e = json.load(open('$KG/endpoints.json')); print(e['urls'][0])"; }
  step nixl 20 nixl_install
  need nixl
  step pd_start 10 fleet_start pd "$KV_DTYPE" 8001 "$HERE/fleet_pd.yaml.tmpl"
  step pd_wait 30 fleet_wait pd
  if [ -f "$KG/failed/pd_wait" ] && [ ! -f "$KG/pd_fallback" ] && [ "$KV_DTYPE" = fp8 ]; then
    echo "=== the FP8 PD fleet does not start: again with the BF16 KV cache (same bytes)"
    fleet_stop pd; touch "$KG/pd_fallback"; rm -f "$KG/failed/pd_wait" "$KG/done/pd_start"
    step pd_start 10 fleet_start pd auto 8201 "$HERE/fleet_pd.yaml.tmpl"
    step pd_wait 30 fleet_wait pd
  fi
  need pd_start pd_wait
  step pd_calib 40 calib calib_pd.json
  # Correctness first: 200 greedy requests through the PD pool against a co-located engine.
  step pd_check 150 bash -c "cd '$KG' && $PY -m bench.gpu.pd check '$KG' '$GW' '$(pd_ref)' --requests 200"
  for cfg in colo2 pd_1p1d; do
    step "pd_$cfg" 75 host scenario "$KG" "pd_$cfg" "pd-h200/$cfg" -- pd-h200 --size h200 --only $cfg --rate 2
  done
  for cfg in colo4 pd_2p2d; do
    step "pd_$cfg" 75 host scenario "$KG" "pd_$cfg" "pd-h200/$cfg" -- pd-h200 --size h200 --only $cfg --rate 4
  done
  for cfg in always conditional; do
    step "skip_$cfg" 75 host scenario "$KG" "skip_$cfg" "pd-skip/$cfg" -- pd-skip --size h200 --only $cfg
  done
  # Faults: a prefill leg's KV lost with its replica, then replicas killed under load.
  step pd_gone_kill 60 bash -c "cd '$KG' && $PY -m bench.gpu.pd gone '$KG' h200pd-0 h200pd-2 --how kill"
  fleet_back() {  # until the supervisor has every replica back in the pool (fleet_pd.json keeps the start-up)
    date +%s.%N > "$KG/fleet_$1_started"; cp "$KG/gateway_pd.pid" "$KG/gateway_$1.pid"
    ln -sf gateway_pd.log "$KG/gateway_$1.log"; fleet_wait "$1"; }
  step pd_wait_back 30 fleet_back pd_back1
  kill_pd() { host kill-test "$KG" "$GW" --control "$CTL" --rate 4 --victim "$1" --tag pd --name "$2" \
                --warm-s 10 --after-s 5 --max-s 150 "${@:3}"; }
  step pd_kill_prefill 190 kill_pd h200pd-1 pd_kill_prefill
  step pd_kill_decode 190 kill_pd h200pd-3 pd_kill_decode --output-tokens 256
  step pd_wait_back2 30 fleet_back pd_back2
  step pd_gone_stop 90 bash -c "cd '$KG' && $PY -m bench.gpu.pd gone '$KG' h200pd-1 h200pd-2 --how stop --timeout-s 60"
  finish
fi
step fleet_start 10 fleet_start fp8 "$(dtype)" 8001
step fleet_wait 30 fleet_wait fp8
if [ -f "$KG/failed/fleet_wait" ] && [ ! -f "$KG/fleet_fallback" ] && [ "$KV_DTYPE" = fp8 ]; then
  # The replicas crash at start with the FP8 KV cache: rather than lose the run, every measurement
  # runs on BF16 (same bytes, half the tokens) and the FP8/BF16 pair at the end is skipped.
  echo "=== the FP8 fleet does not start: falling back to the BF16 KV cache"
  fleet_stop fp8; touch "$KG/fleet_fallback"; rm -f "$KG/failed/fleet_wait" "$KG/done/fleet_start"
  step fleet_start 10 fleet_start fp8 auto 8201
  step fleet_wait 30 fleet_wait fp8
fi
need fleet_start fleet_wait
step calib 40 calib calib.json

# QUEUE=hot: the short session after the device fix (a fresh machine, what little device time was
# left): the hot-prefix workload alone, prefix_affinity with and without device_load against radix.
if [ "${QUEUE:-all}" = hot ]; then
  for cfg in prefix_affinity_default prefix_affinity_device_blind radix_cache_aware; do
    step "devhot_$cfg" 35 host scenario "$KG" "devhot_$cfg" "routing-hot-device/$cfg" -- routing-hot --size h200 --only $cfg
  done
  finish
fi

# ---- routing: capacity probe, then every policy at 90% of round-robin's sustainable rate -----------
probe() {  # NAME SCENARIO [OFFERED]: overload probe; its steady completions/s go to rates.env as NAME
  local cap extra=() out=probe/$2
  [ -n "${3:-}" ] && extra=(--rate "$3") && out=probe/$2-$3
  host scenario "$KG" "probe_$2" "$out" -- "$2" --size h200-probe "${extra[@]}" || return 1
  cap=$(host capacity "$KG/res/$out") || return 1
  setrate "$1" "$cap"
}
route_probe() {  # 40 req/s offered; if all of it was served, the fleet was not saturated: 80
  probe CAP_ROUTE routing || { setrate R_ROUTE "${R_ROUTE_FALLBACK:-10}"; return 1; }
  if $PY -c "import sys; sys.exit(0 if $(rate CAP_ROUTE) > 0.85 * 40 else 1)"; then
    probe CAP_ROUTE routing 80 || return 1
  fi
  setrate R_ROUTE "$(calc "0.9 * $(rate CAP_ROUTE)")"
}
step probe_routing 60 route_probe
R=$(rate R_ROUTE); R=${R:-${R_ROUTE_FALLBACK:-10}}
# routing.yaml, size h200: 960 requests (96 groups x 10), at most 60 s of arrivals; ~15 s around them
EST_ROUTE=$($PY -c "print(int(min(960 / $R, 60)) + 15)")
if [ "${QUEUE:-all}" = recheck ]; then
  for cfg in prefix_affinity_default radix_cache_aware round_robin; do
    step "routing_$cfg" "$EST_ROUTE" host scenario "$KG" "routing_$cfg" "routing/$cfg" -- routing --size h200 --only "$cfg" --rate "$R"
  done
  for cfg in prefix_affinity_default radix_cache_aware; do
    step "hot_$cfg" 45 host scenario "$KG" "hot_$cfg" "routing-hot/$cfg" -- routing-hot --size h200 --only $cfg
  done
  step fp8_stop 100 fleet_stop fp8
  peers_install() {
    ls "$STAGE"/peers/*.whl >/dev/null 2>&1 || { echo "peers not carried yet (.gpu/peers)"; return 3; }
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$KVSITE" "$STAGE"/peers/*.whl
  }
  step peers 20 peers_install
  step cpu_overhead 240 bash "$HERE/cpu_suite.sh" overhead "$KG/res/cpu/overhead"
  finish
fi
for cfg in round_robin prefix_affinity_default oracle radix_cache_aware prefix_affinity_precise least_load; do
  step "routing_$cfg" "$EST_ROUTE" host scenario "$KG" "routing_$cfg" "routing/$cfg" -- routing --size h200 --only "$cfg" --rate "$R"
done

# ---- scheduling ---------------------------------------------------------------------------------------
sched_probe() { probe "CAP_$1" "$2" || return 1; }
step probe_sched 45 sched_probe SCHED scheduling_overload
step probe_sjf 45 sched_probe SJF scheduling_sjf
C=$(rate CAP_SCHED)
if [ -n "$C" ]; then
  step sched_50 50 host scenario "$KG" sched_50 scheduling_overload/load50 -- scheduling_overload --size h200 --rate "$(calc "0.5 * $C")"
  step sched_150 60 host scenario "$KG" sched_150 scheduling_overload/load150 -- scheduling_overload --size h200 --rate "$(calc "1.5 * $C")"
fi
C=$(rate CAP_SJF)
if [ -n "$C" ]; then
  for cfg in fcfs sjf; do
    step "sjf_$cfg" 60 host scenario "$KG" "sjf_$cfg" "scheduling_sjf/$cfg" -- scheduling_sjf --size h200 --only $cfg --rate "$(calc "0.9 * $C")"
  done
fi

# ---- multi-turn (Mooncake conversation trace) and hot prefix: prefix_affinity vs radix_cache_aware ------
# Its prompts (2.4k tokens, most of them uncached) cost about twice a routing request's uncached
# prefill: 40% of round-robin's routing capacity keeps the replay below saturation.
if [ -z "$(rate MOONCAKE_TIME_SCALE)" ] && [ -n "$(rate CAP_ROUTE)" ]; then
  ts=$(host trace-scale --target-rps "$(calc "0.4 * $(rate CAP_ROUTE)")") && setrate MOONCAKE_TIME_SCALE "$ts"
fi
TS=$(rate MOONCAKE_TIME_SCALE); TS=${TS:-0.25}
for cfg in prefix_affinity radix_cache_aware; do
  step "mooncake_$cfg" 70 host scenario "$KG" "mooncake_$cfg" "mooncake/$cfg" -- mooncake --size h200 --only $cfg --set "time_scale=$TS"
done
for cfg in prefix_affinity_default radix_cache_aware; do
  step "hot_$cfg" 45 host scenario "$KG" "hot_$cfg" "routing-hot/$cfg" -- routing-hot --size h200 --only $cfg
done

# ---- a replica killed under load, restarted by the supervisor ------------------------------------------
step kill_restart 200 host kill-test "$KG" "$GW" --control "$CTL" --rate "$(calc "0.5 * $R")" --max-s 170

# ---- FP8 vs BF16 KV cache: the same fleet restarted with BF16 (same memory), the same routing runs ----
[ -f "$KG/fleet_fallback" ] || [ "$KV_DTYPE" != fp8 ] && { echo "=== no FP8/BF16 pair: the whole run was on BF16"; finish; }
step fp8_stop 100 fleet_stop fp8
need fp8_stop
step bf16_start 10 fleet_start bf16 auto 8301
step bf16_wait 30 fleet_wait bf16
need bf16_wait
step bf16_calib 40 calib calib_bf16.json
for cfg in prefix_affinity_default round_robin; do
  step "bf16_$cfg" "$EST_ROUTE" host scenario "$KG" "bf16_$cfg" "bf16-routing/$cfg" -- routing --size h200 --only "$cfg" --rate "$R"
done
# The hot-prefix loss of prefix_affinity (1.34-1.40x radix's mean TTFT on the FP8 fleet): the same
# three-way comparison on this fleet, with a per_request_tokens of 256, and its cost on uniform groups.
# The scenario files come from the tree, not the wheel: added after call 1 had installed it.
for cfg in radix_cache_aware prefix_affinity_default prefix_affinity_spread; do
  step "bf16_hot_$cfg" 35 host scenario "$KG" "bf16_hot_$cfg" "bf16-routing-hot/$cfg" -- "$REPO/bench/scenarios/routing-hot.yaml" --size h200 --only $cfg
done
step bf16_prefix_affinity_spread "$EST_ROUTE" host scenario "$KG" bf16_prefix_affinity_spread bf16-routing/prefix_affinity_spread -- "$REPO/bench/scenarios/routing.yaml" --size h200 --only prefix_affinity_spread --rate "$R"
# Prefill/decode disaggregation on the one GPU is not in this queue: the payload carries no NIXL.
finish
