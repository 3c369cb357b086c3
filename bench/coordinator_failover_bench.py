"""Leader failover of coordinators on etcd (docs/benchmarks.md, "Coordinator state"): three
mainstay-coordinator processes on one local etcd and two daemons (tests/testing/process_cluster);
the leader is SIGKILLed N times, each time after a quiet moment, and the time from the kill to
the first mutating call answered through the address list (an idempotent CreateJob retried
every 50 ms) is reported with the lease TTL. The killed coordinator is started again as a
standby before the next round.

    MAINSTAY_COORDINATOR_BIN=... MAINSTAYD_BIN=... MAINSTAYCTL_BIN=... \\
    python3 bench/coordinator_failover_bench.py [--rounds 5] [--ttl-ms 3000]
"""
import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "testing"))
import process_cluster  # noqa: E402

SPEC = {"name": "probe", "recipe": "bf16_with_fp8_delayed_scaling_mixed", "data_parallel_size": 2,
        "bucket_numel": 3000, "optimizer": {"type": "adamw"},
        "tensors": [{"name": "w", "shape": [48, 64]}]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ttl-ms", type=int, default=3000)
    args = ap.parse_args()
    cluster = process_cluster.Cluster(coordinators=3, coordinator_flags=["--etcd-lease-ttl-ms", str(args.ttl_ms)])
    try:
        times = []
        for r in range(args.rounds):
            spec = os.path.join(cluster.dir, "probe%d.json" % r)
            with open(spec, "w") as f:
                json.dump(dict(SPEC, name="probe-%d" % r), f)
            time.sleep(1.5)  # a quiet moment: the lease was renewed somewhere in the last TTL / 3
            old = cluster.leader()
            cluster.kill(old)
            killed = time.time()
            while cluster.ctl("jobs", "create", "--spec", spec, "--request-id", "round-%d" % r, "--yes",
                              "--timeout-ms", "500").returncode != 0:
                time.sleep(0.05)
            took = time.time() - killed
            times.append(took)
            print("round %d: %s killed, %s leads, %.2f s to the first mutating call" % (r, old, cluster.leader(), took))
            cluster.start_coordinator(int(old[len("coordinator"):]))  # back, as a standby
        print("lease TTL %.1f s: failover median %.2f s, max %.2f s (%.2f x TTL)"
              % (args.ttl_ms / 1000, statistics.median(times), max(times), max(times) / (args.ttl_ms / 1000)))
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
