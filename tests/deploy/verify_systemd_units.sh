#!/usr/bin/env bash
# usage: verify_systemd_units.sh UNIT_DIR COORDINATOR_BIN DAEMON_BIN
#
# Runs `systemd-analyze verify` on deploy/systemd's units. verify insists that ExecStart's
# program exists and is executable, so it checks copies whose /usr/local/bin paths name the
# build tree's binaries. verify reports unknown or misspelt directives as warnings and still
# exits 0, so any line it prints about our units fails the test too.
# Exit 77 (CTest: skipped) where systemd-analyze is not installed.
set -euo pipefail
unit_dir=$1

if ! command -v systemd-analyze >/dev/null; then
  echo "SKIP: systemd-analyze not found (Debian package systemd); the units were not verified"
  exit 77
fi

# verify wants absolute paths in ExecStart.
coordinator_bin=$(realpath "$2") daemon_bin=$(realpath "$3")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
units=()
for unit in "$unit_dir"/*.service; do
  name=$(basename "$unit")
  sed -e "s#/usr/local/bin/mainstay-coordinator#$coordinator_bin#g" \
      -e "s#/usr/local/bin/mainstayd#$daemon_bin#g" "$unit" > "$work/$name"
  units+=("$work/$name")
done
[ ${#units[@]} -ge 2 ] || { echo "FAIL: expected the two units in $unit_dir"; exit 1; }

status=0
out=$(systemd-analyze verify --man=no "${units[@]}" 2>&1) || status=$?
[ -z "$out" ] || echo "$out"
if [ $status -ne 0 ]; then
  echo "FAIL: systemd-analyze verify exited $status"
  exit 1
fi
for unit in "${units[@]}"; do
  if grep -F -q -e "$(basename "$unit")" <<<"$out"; then
    echo "FAIL: systemd-analyze verify warned about $(basename "$unit") (see above)"
    exit 1
  fi
done

# What the units promise the binaries and the operator (docs/operations.md): readiness through
# sd_notify, a restart on failure but not on bad flags, pinned memory for the daemon.
for unit in "${units[@]}"; do
  for line in "Type=notify" "Restart=on-failure" "RestartPreventExitStatus=2" "NoNewPrivileges=yes" \
              "ProtectSystem=strict" "ProtectHome=yes" "PrivateTmp=yes" "EnvironmentFile="; do
    grep -q "^$line" "$unit" || { echo "FAIL: $(basename "$unit") lacks $line"; exit 1; }
  done
done
grep -q "^LimitMEMLOCK=infinity" "$work/mainstayd.service" || { echo "FAIL: mainstayd.service lacks LimitMEMLOCK=infinity"; exit 1; }
grep -q "^StateDirectory=" "$work/mainstay-coordinator.service" || { echo "FAIL: the coordinator has no StateDirectory="; exit 1; }
echo "PASS: ${#units[@]} units verified"
