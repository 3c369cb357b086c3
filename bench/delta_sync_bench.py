"""Delta sync over a real training run: how much of each new version a reader must fetch.

Starts mainstay-coordinator and two mainstayd on loopback (tests/testing/process_cluster.py),
trains client/python/examples/char_lm.py (a character-level GPT on real text, two gloo ranks,
MainstayOptimizer) for --steps steps with each --recipe, and meanwhile a mainstay.WeightReader
with the job's reader token reads every new version with tensors(since=<the version it read
before>) (docs/weight_serving.md, "Delta sync"). Per recipe it prints the fraction of the packed
data and block scales that came over the wire, for consecutive versions and overall, against a full read of the
same bytes (the baseline), and which tensors' bytes changed.

    PYTHONPATH=build/client/python /usr/bin/python3 bench/delta_sync_bench.py [--build-dir build]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "testing"))


def to_bytes(t):
    """A yielded tensor's bytes (torch tensors, bf16 ones included, or numpy arrays)."""
    if hasattr(t, "numpy"):
        import torch
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.view(torch.int16)
        return t.numpy().tobytes()
    return t.tobytes()


def run(args, recipe):
    import numpy as np
    import process_cluster
    import mainstay
    cluster = process_cluster.Cluster(daemons=2, lease_ms=5000)
    try:
        job_file = os.path.join(cluster.dir, "job.json")
        trainers = []
        for rank in range(2):
            log = open(os.path.join(cluster.dir, "trainer%d.log" % rank), "w")
            trainers.append(subprocess.Popen(
                [sys.executable, os.path.join(ROOT, "client", "python", "examples", "char_lm.py"), "--coordinator",
                 cluster.address, "--rank", str(rank), "--job-file", job_file, "--steps", str(args.steps),
                 "--recipe", recipe, "--lr", str(args.lr), "--dim", str(args.dim), "--layers", str(args.layers),
                 "--context", "64", "--batch", "16", "--bucket-numel", str(args.bucket_numel), "--print-every",
                 "10"], stdout=log, stderr=subprocess.STDOUT))
        process_cluster.wait_for(lambda: os.path.exists(job_file), "the job", timeout=300, logs=cluster.logs)
        with open(job_file) as f:
            job = json.load(f)
        owner = mainstay.Client(cluster.address, job_id=job["job_id"], job_token=job["job_token"], rank=0,
                                timeout_s=60)
        reader = mainstay.WeightReader(cluster.address, job["job_id"], owner.get_reader_token(), timeout_s=60)
        version = reader.wait_newer(0, 300)
        previous = {n: to_bytes(t) for n, t in reader.tensors(version)}
        rows = []  # (from, to, fraction of data and scales sent, their bytes, seconds, fraction of bytes changed)
        changed_tensors = {}
        while version < args.steps:
            newer = reader.wait_newer(version, 120)
            if newer is None:
                break
            t0 = time.monotonic()
            now = {}
            for n, t in reader.tensors(newer, since=version):
                now[n] = to_bytes(t)
            took = time.monotonic() - t0
            changed_bytes = 0
            total_bytes = 0
            for n, b in now.items():
                old = previous.get(n, b"")
                if b != old:
                    changed_tensors[n] = changed_tensors.get(n, 0) + 1
                if len(old) == len(b):
                    changed_bytes += int(np.count_nonzero(np.frombuffer(b, np.uint8) != np.frombuffer(old, np.uint8)))
                total_bytes += len(b)
            rows.append((version, newer, reader.delta_fraction(), reader.data_bytes + reader.scale_bytes, took,
                         changed_bytes / max(1, total_bytes)))
            previous, version = now, newer
        for p in trainers:
            if p.wait(timeout=600) != 0:
                raise SystemExit("a trainer failed:\n" + cluster.logs(40))
        return rows, changed_tensors, len(previous)
    finally:
        cluster.stop()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--bucket-numel", type=int, default=1 << 20)
    ap.add_argument("--recipe", action="append",
                    help="default: bf16_mixed, bf16_with_fp8_subchannel_scaling_mixed, "
                         "bf16_with_fp8_current_scaling_mixed")
    args = ap.parse_args()
    for var, rel in (("MAINSTAY_COORDINATOR_BIN", "server/grpc/mainstay-coordinator"),
                     ("MAINSTAYD_BIN", "server/grpc/mainstayd"), ("MAINSTAYCTL_BIN", "cli/mainstayctl")):
        os.environ.setdefault(var, os.path.join(args.build_dir, rel))
    recipes = args.recipe or ["bf16_mixed", "bf16_with_fp8_subchannel_scaling_mixed",
                              "bf16_with_fp8_current_scaling_mixed"]
    print("char_lm.py: dim %d, %d layers, lr %g, %d steps, 64 KiB chunks; baseline = a full read (fraction 1)"
          % (args.dim, args.layers, args.lr, args.steps))
    print("| recipe | data + block scales per version | versions read | sent, consecutive versions: median (min-max) | "
          "sent, all deltas | bytes that changed, consecutive versions: median | tensors changed in every delta |")
    print("|---|---:|---:|---|---:|---:|---|")
    for recipe in recipes:
        rows, changed, tensors = run(args, recipe)
        consecutive = [r[2] for r in rows if r[1] == r[0] + 1]
        sent = sum(r[2] * r[3] for r in rows) / max(1, sum(r[3] for r in rows))
        always = sum(1 for n in changed.values() if n == len(rows))
        span = ("%.4f (%.4f-%.4f)" % (statistics.median(consecutive), min(consecutive), max(consecutive))
                if consecutive else "-")
        changed_bytes = [r[5] for r in rows if r[1] == r[0] + 1]
        print("| %s | %.2f MB | %d | %s | %.4f | %.4f | %d of %d |"
              % (recipe, rows[0][3] / 1e6 if rows else 0, len(rows), span, sent,
                 statistics.median(changed_bytes) if changed_bytes else 0, always, tensors), flush=True)


if __name__ == "__main__":
    main()
