#!/usr/bin/env bash
# Installs every build and test dependency of Mainstay from Debian 12's packages.
# Idempotent: packages already present are skipped, so a second run takes seconds.
# Needs root (or sudo). CUDA is not installed here: it is used when found in /usr/local/cuda.
# python3-torch (CPU, 1.13) is for the tests that load the Python module next to PyTorch.
# libcpp-httplib-dev serves mainstayd's /metrics; prometheus (and its promtool) is only for the
# metrics tests, which skip those checks without it. clang (with libFuzzer) builds the fuzz
# targets (scripts/fuzz.sh); iproute2's `ip netns` runs the network-partition test.
# golang-etcd-server-dev ships etcd's .proto files (the coordinator's etcd client is generated
# from them); etcd-server and etcd-client (etcdctl) run the coordinator's etcd tests.
# libxxhash-dev: XXH3-64, the chunk hash of delta pulls (header only, common/chunk_hash.h).
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  libabsl-dev libprotobuf-dev protobuf-compiler libgrpc++-dev protobuf-compiler-grpc
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev libssl-dev libxxhash-dev
  libhwy-dev
  libucx-dev ucx-utils
  etcd-server etcd-client golang-etcd-server-dev
  libgloo-dev
  pybind11-dev python3-dev python3-numpy
  python3-torch
  python3-yaml
  libcpp-httplib-dev prometheus
  clang iproute2
)
# The deploy/k8s checks render manifests with `kubectl kustomize`. Keep a kubectl that is
# already there (the build machines' image has a newer one, from a package named kubectl, not
# Debian's); otherwise take Debian's (1.20: it renders the base, the overlay check skips).
if ! command -v kubectl >/dev/null; then PACKAGES+=(kubernetes-client); fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#PACKAGES[@]} packages present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install_deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "install_deps: done"
