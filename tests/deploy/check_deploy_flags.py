#!/usr/bin/env python3
"""Keeps the deployment files and docs/operations.md in step with the binaries' flags.

usage: check_deploy_flags.py --source-dir DIR COORDINATOR_BIN DAEMON_BIN

1. Every --flag written in deploy/ (systemd units, env files, Kubernetes manifests; comments
   excluded) is a flag of the binary that file configures, as its --help lists them: a typo
   there would stop the service with exit 2 only at deploy time. (etcd*.yaml: etcd's flags.)
2. Every flag of each binary's --help appears in the binary's section of docs/operations.md's
   configuration reference, so adding a flag without documenting it fails here.
Plain Python (no PyYAML): manifests are scanned as text.
"""
import argparse
import pathlib
import re
import shutil
import subprocess
import sys

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def help_flags(binary):
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, check=True).stdout
    # Flags are the first word of the lines under "flags:".
    flags = set()
    for line in out.splitlines():
        m = re.match(r"\s+(--[a-z][a-z0-9-]*)", line)
        if m:
            flags.add(m.group(1))
    if len(flags) < 5:
        sys.exit(f"FAIL: {binary} --help lists only {sorted(flags)}; did its format change?")
    return flags


def code_text(path):
    """The file without comment lines and trailing ' # ...' comments (units, env, YAML)."""
    lines = []
    for line in path.read_text().splitlines():
        if line.lstrip().startswith(("#", ";")):
            continue
        lines.append(re.sub(r"\s#\s.*$", "", line))
    return "\n".join(lines)


def doc_section(text, heading):
    """The body of the markdown section whose heading line contains `heading`."""
    m = re.search(r"^(#+) .*" + re.escape(heading) + r".*$", text, re.M)
    if not m:
        return None
    level = len(m.group(1))
    rest = text[m.end():]
    end = re.search(r"^#{1,%d} " % level, rest, re.M)
    return rest[: end.start()] if end else rest


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--source-dir", required=True)
    parser.add_argument("coordinator")
    parser.add_argument("daemon")
    args = parser.parse_args()
    root = pathlib.Path(args.source_dir)
    binaries = {"mainstay-coordinator": help_flags(args.coordinator), "mainstayd": help_flags(args.daemon)}
    # The HA overlay's etcd (deploy/k8s/overlays/ha/etcd.yaml) is checked against etcd's own
    # --help (Debian's etcd-server), not documented in operations.md.
    etcd = shutil.which("etcd")
    etcd_flags = help_flags(etcd) if etcd else None

    failures = []
    checked = 0
    # Which binary a deploy file configures, by its name.
    for path in sorted((root / "deploy").rglob("*")):
        if not path.is_file() or path.suffix not in (".service", ".env", ".yaml", ".yml"):
            continue
        name = path.name
        owner = ("mainstay-coordinator" if "coordinator" in name else "mainstayd" if "mainstayd" in name else None)
        used = set(FLAG.findall(code_text(path)))
        if owner is None and name.startswith("etcd") and etcd_flags is not None:
            for flag in sorted(used):
                checked += 1
                if flag not in etcd_flags:
                    failures.append(f"{path.relative_to(root)}: {flag} is not a flag of etcd (see etcd --help)")
            continue
        if owner is None:
            if used:
                failures.append(f"{path.relative_to(root)}: flags {sorted(used)} in a file of neither binary")
            continue
        for flag in sorted(used):
            checked += 1
            if flag not in binaries[owner]:
                failures.append(f"{path.relative_to(root)}: {flag} is not a flag of {owner} (see its --help)")

    doc_path = root / "docs" / "operations.md"
    doc = doc_path.read_text() if doc_path.exists() else ""
    for binary, flags in binaries.items():
        section = doc_section(doc, f"`{binary}` flags")
        if section is None:
            failures.append(f"docs/operations.md: no section headed '`{binary}` flags'")
            continue
        for flag in sorted(flags):
            checked += 1
            if not re.search(r"`" + re.escape(flag) + r"[ `=]", section):
                failures.append(f"docs/operations.md: {binary} flag {flag} is not documented in '`{binary}` flags'")

    for f in failures:
        print("FAIL:", f)
    if failures:
        return 1
    print(f"PASS: {checked} flag uses and docs entries checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
