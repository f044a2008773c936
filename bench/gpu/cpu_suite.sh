#!/bin/bash
# CPU-side measurements on the GPU host's quiet cores (drive.sh QUEUE=recheck): what this 2-core,
# shared CI-like machine measures only with other sessions' work beside it.
#   cpu_suite.sh decision OUT   bench.decision_time: 16/256/1,024 replicas, shortlist vs every replica
#   cpu_suite.sh seeds OUT      issue-18 routing scenarios on the simulator, prefix_affinity vs
#                               radix_cache_aware, seeds 1-3, JOBS (default 9) at a time
#   cpu_suite.sh overhead OUT   bench.overhead with sglang-router beside kvgate (its wheel carried)
# Runs from the carried working tree (bench/ is not in kvgate's wheel), kvgate's dependencies from
# the installed payload (PYTHONPATH from env.sh).
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PY=${PY:-python3}
what=$1 out=$2
mkdir -p "$out"
cd "$REPO" || exit 1
export PYTHONPATH=$REPO:${PYTHONPATH:-}
case $what in
  decision)
    # One core, as the gateway's event loop has.
    taskset -c 1 $PY -m bench.decision_time --replicas 16 --replicas 256 --replicas 1024 \
      --max-candidates 32 --max-candidates 0 --iterations 5000 --breakdown --out "$out"
    ;;
  seeds)
    jobs=()
    pair=prefix_affinity,radix_cache_aware
    for seed in 1 2 3; do
      for sc in routing-hetero routing-bursty routing-surge routing-tool-agent routing-long routing-hot; do
        jobs+=("$sc $seed full $pair")
      done
      jobs+=("routing-hot $seed h200 prefix_affinity_default,radix_cache_aware")
    done
    run() {  # SCENARIO SEED SIZE CONFIGS: one scenario run, prefix_affinity against radix_cache_aware
      local dir=$out/$1-$3-seed$2
      $PY -m bench scenario "$1" --size "$3" --seed "$2" --only "$4" --out "$dir" > "$dir.log" 2>&1
      echo "$1 $3 seed $2: rc $? ($(date +%T))"
    }
    export -f run; export out PY
    printf '%s\n' "${jobs[@]}" | xargs -P "${JOBS:-9}" -I{} bash -c 'run {}'
    # Runs cut short (no report.json) are left out of the table.
    $PY -m bench.routing_table --seeds $(dirname "$out"/*/report.json) --out "$out/seeds.md"
    ;;
  overhead)
    # As issue 18 measured it: the gateway and the router each on one core of their own.
    $PY -m bench.overhead --peers sglang-router --pin --out "$out"
    ;;
  *) echo "usage: cpu_suite.sh decision|seeds|overhead OUT"; exit 2 ;;
esac
