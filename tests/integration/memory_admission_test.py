"""Memory admission through the real binaries (issue 18, item 9; docs/daemon.md, "Memory"): a
daemon refuses an assignment whose memory plan does not fit its --memory-bytes, and the
coordinator places the rank on another daemon, where the job trains. And what a daemon really
holds (issue 21): its peak RSS over a few steps of a large job stays within one copy of the
optimizer state plus the gradients and versions of the plan.

daemon0 keeps 1000 published versions per shard (--retained-versions 1000), which the
coordinator's plan (4 versions) does not know about: the job's rank 0 is placed on daemon0 (its
trainer's node), daemon0 refuses it with RESOURCE_EXHAUSTED, and the rank moves to daemon1 at a
new placement epoch. The trainer, knowing nothing of this, pushes, steps and pulls as usual.

    MAINSTAY_COORDINATOR_BIN=... MAINSTAYD_BIN=... MAINSTAYCTL_BIN=... \\
    PYTHONPATH=<build>/client/python /usr/bin/python3 memory_admission_test.py
"""
import json
import os
import sys
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
import process_cluster  # noqa: E402  (the shared process harness)
from process_cluster import read  # noqa: E402

import mainstay  # noqa: E402

SHAPE = [1024, 1024]  # 1M elements: ~40 MB of plan at 4 versions, ~2 GB at 1000 (bf16)


def spec(name):
    return {
        "name": name,
        "recipe": "bf16_mixed",
        "data_parallel_size": 1,
        "bucket_numel": SHAPE[0] * SHAPE[1],
        "trainer_nodes": ["node0"],
        "optimizer": {"type": "adamw", "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0, "max_grad_norm": 0.0},
        "tensors": [{"name": "w", "shape": SHAPE}],
    }


class MemoryAdmissionTest(unittest.TestCase):
    def setUp(self):
        self.cluster = process_cluster.Cluster(daemons=2, lease_ms=3000,
                                               flags_of_daemon={0: ["--retained-versions", "1000"]})

    def tearDown(self):
        result = getattr(self._outcome, "result", None)
        if result is not None and any(t is self for t, _ in result.errors + result.failures):
            print(self.cluster.logs())
        self.cluster.stop()

    def daemon_ids(self):
        r = self.cluster.ctl("daemons", "list", "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        return {d["endpoint"]["node_name"]: d["endpoint"]["daemon_id"] for d in json.loads(r.stdout)["daemons"]}

    def placement(self, job_id):
        r = self.cluster.ctl("placement", "--job", job_id, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        return json.loads(r.stdout)["placement"]

    def test_a_rank_the_daemon_has_no_room_for_is_placed_elsewhere_and_trains(self):
        client = mainstay.Client(self.cluster.address, spec_json=json.dumps(spec("admitted")), rank=0, timeout_s=120,
                                 max_backoff_s=0.5)
        params = np.full(SHAPE[0] * SHAPE[1], 0.5, dtype=np.float32)
        client.push_initial_params(0, params, wait=True)
        grad = np.full(SHAPE[0] * SHAPE[1], 0.25, dtype=np.float32)
        for step in range(2):
            client.push_grad(0, step, grad, wait=True)
            stats = client.finish_step(step, lr=1e-3, weight_decay=0.0)
            self.assertFalse(stats["skipped"])
        self.assertEqual(client.pull_bucket(0, 2).version, 2)
        ids = self.daemon_ids()
        placement = self.placement(client.job_id)
        self.assertGreaterEqual(int(placement["epoch"]), 2, "the rank was never re-placed")
        self.assertEqual({s["daemon_id"] for s in placement["shards"]}, {ids["node1"]})
        refused = read(os.path.join(self.cluster.dir, "daemon0.log")) + read(os.path.join(self.cluster.dir,
                                                                                         "coordinator.log"))
        self.assertIn("RESOURCE_EXHAUSTED", refused)
        self.assertIn("--memory-bytes", refused)
        self.assertIn("has no room for job %s" % client.job_id, read(os.path.join(self.cluster.dir, "coordinator.log")))


def vm_kib(pid, field):
    """A field of /proc/PID/status in KiB (VmRSS, VmHWM)."""
    for line in read("/proc/%d/status" % pid).splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError("no %s in /proc/%d/status" % (field, pid))


class DaemonMemoryTest(unittest.TestCase):
    """One copy of the optimizer state: the daemon decides a step before it writes the state, then
    updates in place (docs/daemon.md, "A step"). An update into scratch copies would hold 12 more
    bytes per element (AdamW, FP32 moments) at its peak, which this bound leaves no room for."""

    SHAPE = [4096, 6144]  # 25.2M elements: 302 MB of optimizer state

    def setUp(self):
        self.cluster = process_cluster.Cluster(daemons=1, lease_ms=3000)

    def tearDown(self):
        result = getattr(self._outcome, "result", None)
        if result is not None and any(t is self for t, _ in result.errors + result.failures):
            print(self.cluster.logs())
        self.cluster.stop()

    def test_peak_rss_is_one_copy_of_the_state_plus_gradients_and_versions(self):
        n = self.SHAPE[0] * self.SHAPE[1]
        daemon = self.cluster.procs["daemon0"].pid
        idle_kib = vm_kib(daemon, "VmRSS")
        job = dict(spec("rss"), bucket_numel=n, tensors=[{"name": "w", "shape": self.SHAPE}])
        client = mainstay.Client(self.cluster.address, spec_json=json.dumps(job), rank=0, timeout_s=120)
        client.push_initial_params(0, np.full(n, 0.5, dtype=np.float32), wait=True)
        grad = np.full(n, 0.25, dtype=np.float32)
        for step in range(6):  # past the 4 retained versions, so evictions and reuse happen
            client.push_grad(0, step, grad, wait=True)
            self.assertFalse(client.finish_step(step, lr=1e-3, weight_decay=0.0)["skipped"])
            client.pull_bucket(0, step + 1)
        peak = (vm_kib(daemon, "VmHWM") - idle_kib) * 1024
        state = n * (4 + 8)          # FP32 master, FP32 m and v
        grads = 2 * n * 4            # two open steps of FP32 gradients
        versions = (4 + 1) * n * 2   # 4 retained bf16 versions and the one being cast
        allowance = 96 << 20         # gRPC buffers, allocator slack
        print("daemon peak RSS over idle: %.0f MB; one state %.0f MB + gradients %.0f MB + versions %.0f MB "
              "+ allowance %.0f MB = %.0f MB" % (peak / 1e6, state / 1e6, grads / 1e6, versions / 1e6,
                                                 allowance / 1e6, (state + grads + versions + allowance) / 1e6))
        self.assertLessEqual(peak, state + grads + versions + allowance)


if __name__ == "__main__":
    unittest.main(verbosity=2)
