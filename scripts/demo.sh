#!/usr/bin/env bash
# The README's demo command. Builds mainstayctl and shows what Mainstay computes for a
# real model: the layout of a Llama-3-8B-shaped model over 8 trainers with the MXFP8
# recipe, then GPT-2 small with whole-tensor ownership. (The local cluster demo arrives
# with the shard daemon.)
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install_deps.sh
build_dir=${MAINSTAY_BUILD_DIR:-build}
cmake -S . -B "$build_dir" -G Ninja ${MAINSTAY_CMAKE_ARGS:-} > "$build_dir.configure.log" 2>&1 ||
  { cat "$build_dir.configure.log"; exit 1; }
cmake --build "$build_dir" -j"$(nproc)" --target mainstayctl
ctl="$build_dir/cli/mainstayctl"

echo
echo "== Llama-3-8B shape, D=8, bf16_with_mxfp8_mixed, flat layout (summary)"
"$ctl" layout --spec docs/examples/llama3_8b.json --dp 8 --summary
echo
echo "== the same model, first tensors and their shards"
"$ctl" layout --spec docs/examples/llama3_8b.json --dp 8 | sed -n '/^TENSOR /,/^$/p' | head -12
echo
echo "== GPT-2 small, D=6, whole_tensor layout: no tensor straddles two daemons"
"$ctl" layout --spec docs/examples/gpt2_small.json --dp 6 --policy whole_tensor --summary
echo
echo "Full tables: $ctl layout --spec docs/examples/llama3_8b.json --dp 8   (add --json for scripts)"
