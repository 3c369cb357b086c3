#!/usr/bin/env bash
# The README's demo command: a local Mainstay cluster on loopback training a small model.
#
# Builds, starts mainstay-coordinator and two mainstayd daemons, runs two trainer processes that
# keep no optimizer state of their own, prints step, loss, grad norm and step time as they go,
# then shows the job with mainstayctl and shuts everything down. With PyTorch (python3-torch,
# which install_deps.sh installs) the trainers train a small GPT through
# mainstay.torch.MainstayOptimizer (client/python/examples/char_lm.py: two param groups, the
# parameters all-gathered in FP8/bf16) and print its loss next to plain torch.optim.AdamW's on
# the same batches; without it, the NumPy MLP of client/python/examples/mlp_trainer.py.
# Environment: DEMO_TRAINER (torch | numpy; torch when importable), DEMO_STEPS (torch 100,
# numpy 300), DEMO_RECIPE (bf16_with_fp8_current_scaling_mixed), MAINSTAY_BUILD_DIR (build),
# MAINSTAY_DEMO_NO_BUILD=1 (use the binaries already built; the CTest smoke run does).
set -euo pipefail
cd "$(dirname "$0")/.."

build_dir=${MAINSTAY_BUILD_DIR:-build}
if [[ -z "${MAINSTAY_DEMO_NO_BUILD:-}" ]]; then  # the CTest smoke run sets it: already built
  bash scripts/install_deps.sh
  mkdir -p "$build_dir"
  echo "== building (log: $build_dir/demo-build.log)"
  {
    cmake -S . -B "$build_dir" -G Ninja ${MAINSTAY_CMAKE_ARGS:-} &&
      cmake --build "$build_dir" -j"$(nproc)" --target mainstay-coordinator mainstayd mainstayctl mainstay_python
  } > "$build_dir/demo-build.log" 2>&1 || { tail -50 "$build_dir/demo-build.log"; exit 1; }
fi
build_dir=$(cd "$build_dir" && pwd)

run_dir=$(mktemp -d /tmp/mainstay-demo.XXXXXX)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "$run_dir"
}
trap cleanup EXIT

wait_for_file() {  # path, pid of the process that writes it
  for _ in $(seq 600); do
    [[ -s "$1" ]] && return 0
    kill -0 "$2" 2>/dev/null || { echo "process $2 exited; its log:"; cat "$run_dir"/*.log; return 1; }
    sleep 0.1
  done
  echo "timed out waiting for $1"; return 1
}

echo "== starting mainstay-coordinator and two mainstayd daemons on 127.0.0.1 (logs: $run_dir)"
"$build_dir/server/grpc/mainstay-coordinator" --listen 127.0.0.1:0 --state-dir "$run_dir/state" \
  --port-file "$run_dir/coordinator.port" 2> "$run_dir/coordinator.log" &
pids+=($!)
wait_for_file "$run_dir/coordinator.port" "${pids[0]}"
coordinator="127.0.0.1:$(cat "$run_dir/coordinator.port")"
for i in 0 1; do
  "$build_dir/server/grpc/mainstayd" --coordinator "$coordinator" --listen 127.0.0.1:0 --node-name "node$i" \
    --threads 1 --memory-bytes 2000000000 --lease-ttl-ms 3000 --metrics-listen 127.0.0.1:0 \
    --port-file "$run_dir/daemon$i.port" \
    2> "$run_dir/daemon$i.log" &
  pids+=($!)
  wait_for_file "$run_dir/daemon$i.port" "${pids[-1]}"
done
ctl="$build_dir/cli/mainstayctl"
"$ctl" daemons list --coordinator "$coordinator"

# The module is built for Debian's python3 (python3-dev, python3-numpy), not another one on PATH.
python=/usr/bin/python3
export PYTHONPATH="$build_dir/client/python${PYTHONPATH:+:$PYTHONPATH}"
trainer=${DEMO_TRAINER:-}
if [[ -z "$trainer" ]]; then
  if "$python" -c 'import torch' 2>/dev/null; then trainer=torch; else trainer=numpy; fi
fi
recipe=${DEMO_RECIPE:-bf16_with_fp8_current_scaling_mixed}
trainer_pids=()
if [[ "$trainer" == torch ]]; then
  steps=${DEMO_STEPS:-100}
  echo
  echo "== two PyTorch trainer processes (gloo), a 3-layer character GPT through MainstayOptimizer, $steps steps,"
  echo "   recipe $recipe; 'reference' is plain torch.optim.AdamW on the same batches (rank 0 prints)"
  for rank in 0 1; do
    "$python" client/python/examples/char_lm.py --coordinator "$coordinator" --rank "$rank" --world 2 \
      --job-file "$run_dir/job.json" --steps "$steps" --recipe "$recipe" --layers 3 --param-groups 2 \
      --weight-decay 0.1 --reference --print-every 10 --require-drop 0.25 > "$run_dir/trainer$rank.out" \
      2> "$run_dir/trainer$rank.log" &
    trainer_pids+=($!)
  done
  tail -f --pid="${trainer_pids[0]}" "$run_dir/trainer0.out" &
else
  steps=${DEMO_STEPS:-300}
  echo
  echo "== two NumPy trainer processes, $steps steps, recipe $recipe (rank 0 prints)"
  for rank in 0 1; do
    "$python" client/python/examples/mlp_trainer.py --coordinator "$coordinator" --rank "$rank" --world 2 \
      --job-file "$run_dir/job.json" --steps "$steps" --recipe "$recipe" 2> "$run_dir/trainer$rank.log" &
    trainer_pids+=($!)
  done
fi
status=0
for pid in "${trainer_pids[@]}"; do wait "$pid" || status=$?; done
if [[ $status -ne 0 ]]; then
  echo "a trainer failed (exit $status):"
  for f in "$run_dir"/trainer*.log "$run_dir"/trainer*.out; do [[ -f "$f" ]] && { echo "--- $f"; tail -n 20 "$f"; }; done
  exit "$status"
fi

job_id=$("$python" -c 'import json,sys; print(json.load(open(sys.argv[1]))["job_id"])' "$run_dir/job.json")
sleep 2  # one heartbeat, so the coordinator has the daemons' latest progress
echo
echo "== mainstayctl jobs show $job_id"
"$ctl" jobs show "$job_id" --coordinator "$coordinator"
echo
echo "== mainstayctl placement $job_id"
"$ctl" placement --job "$job_id" --coordinator "$coordinator"
echo
echo "== shutting down (SIGTERM: daemons deregister, the coordinator exits)"
cleanup
trap - EXIT
echo "done"
