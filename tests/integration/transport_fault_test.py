"""A peer dying mid-transfer, over the transport the environment selects (MAINSTAY_TRANSPORT,
UCX_TLS; CTest runs this file once per transport): real coordinator and mainstayd processes, a
trainer process SIGKILLed in the middle of a large push, and a daemon SIGKILLed in the middle of
one (docs/transports.md).

- A trainer that dies mid-push leaves nothing on the daemon: the same push made again afterwards
  is stored as new (not acknowledged as a duplicate), and the step's gradient norm is exactly
  the norm of the gradient pushed in full.
- A daemon that dies mid-transfer gives the caller UNAVAILABLE (once its deadline is spent on
  retries), for a push and for a pull.

    MAINSTAY_COORDINATOR_BIN=... MAINSTAYD_BIN=... MAINSTAYCTL_BIN=... MAINSTAY_TRANSPORT=ucx UCX_TLS=tcp \\
    PYTHONPATH=<build>/client/python /usr/bin/python3 transport_fault_test.py

Run with `--pusher ...` it is the trainer process that gets killed.
"""
import argparse
import json
import os
import sys
import threading
import time
import unittest

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "testing"))
import process_cluster  # noqa: E402  (the shared process harness)
from process_cluster import PYTHON, read, wait_for  # noqa: E402

import mainstay  # noqa: E402

SHAPE = [4096, 8192]  # 33.5M elements: 128 MiB of FP32 gradient per push
CHUNK = 1024          # the smallest chunk: a push is ~10^5 messages, long enough to be cut short
TRANSPORT = os.environ.get("MAINSTAY_TRANSPORT", "auto")


def spec(name):
    return {
        "name": name,
        "recipe": "bf16_with_fp8_current_scaling_mixed",
        "data_parallel_size": 1,
        "bucket_numel": SHAPE[0] * SHAPE[1],
        "optimizer": {"type": "adamw", "beta1": 0.9, "beta2": 0.99, "weight_decay": 0.0, "max_grad_norm": 0.0},
        "tensors": [{"name": "w", "shape": SHAPE}],
    }


def gradient():
    return (np.sin(np.arange(SHAPE[0] * SHAPE[1], dtype=np.float32) * 0.001) * 0.01).astype(np.float32)


def pusher_main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("--pusher", action="store_true")
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--job-file", required=True)
    args = ap.parse_args(argv)
    job = json.loads(read(args.job_file))
    client = mainstay.Client(args.coordinator, job_id=job["job_id"], job_token=job["job_token"], rank=0,
                             timeout_s=120, chunk_bytes=CHUNK, transport=TRANSPORT)
    grad = gradient()
    print("PUSHING", flush=True)
    client.push_grad(0, 0, grad, wait=True)
    print("PUSHED", flush=True)


class TransportFaultTest(unittest.TestCase):
    def setUp(self):
        # E.g. "--ucx-dedicated-workers none --ucx-shared-workers 1": every trainer on one worker.
        self.cluster = process_cluster.Cluster(daemons=1, lease_ms=3000,
                                               daemon_flags=os.environ.get("MAINSTAY_TEST_DAEMON_FLAGS", "").split())

    def tearDown(self):
        result = getattr(self._outcome, "result", None)
        failed = result is not None and any(t is self for t, _ in result.errors + result.failures)
        if failed:
            print(self.cluster.logs())
        self.cluster.stop()

    def create_job(self, name):
        client = mainstay.Client(self.cluster.address, spec_json=json.dumps(spec(name)), rank=0, timeout_s=120,
                                 chunk_bytes=CHUNK, transport=TRANSPORT, max_backoff_s=0.5)
        with open(os.path.join(self.cluster.dir, name + ".job"), "w") as f:
            json.dump({"job_id": client.job_id, "job_token": client.job_token}, f)
        client.push_initial_params(0, np.zeros(SHAPE[0] * SHAPE[1], dtype=np.float32), wait=True)
        return client

    def delete_job(self, job_id):
        """The next attempt's job needs the daemon's memory (1.2 GB of its 2 GB)."""
        r = self.cluster.ctl("jobs", "delete", job_id, "--yes")
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)

    def test_a_trainer_killed_mid_push_leaves_nothing_stored(self):
        # Shared memory can move the whole push before the kill lands: then the daemon rightly
        # stored it in full (the step's norm proves it was not cut), but the kill proved nothing,
        # so the run is repeated with a shorter delay, on a new job.
        import subprocess
        grad = gradient()
        expected = float(np.sqrt(np.sum(grad.astype(np.float64) ** 2)))
        for attempt, delay in enumerate([0.3, 0.1, 0.03, 0.0]):
            name = "killed%d" % attempt
            client = self.create_job(name)
            if TRANSPORT != "auto":
                self.assertTrue(all(c["transport"] == TRANSPORT for c in client.connections()), client.connections())
            log = os.path.join(self.cluster.dir, name + ".pusher.log")
            with open(log, "w") as out:
                p = subprocess.Popen([PYTHON, os.path.abspath(__file__), "--pusher", "--coordinator",
                                      self.cluster.address, "--job-file", os.path.join(self.cluster.dir, name + ".job")],
                                     stdout=out, stderr=subprocess.STDOUT)
            wait_for(lambda: "PUSHING" in read(log), "the pusher to start its push", 60)
            time.sleep(delay)
            p.kill()
            p.wait()
            if "PUSHED" in read(log):
                self.delete_job(client.job_id)  # acknowledged before the kill
                continue
            time.sleep(1.0)
            # The same push again, in full: stored as new, and the step uses exactly it.
            result = client.push_grad(0, 0, grad, wait=True)
            stats = client.finish_step(0, lr=1e-3, weight_decay=0.0)
            # Either way the step's gradient is the whole push, never a part of it.
            self.assertAlmostEqual(stats["grad_norm"], expected, delta=expected * 1e-6,
                                   msg="the killed push was stored in part")
            self.assertEqual(client.pull_bucket(0, 1).version, 1)
            if not result["duplicate"]:
                return  # the kill landed mid-push, and nothing of it was kept
            self.delete_job(client.job_id)
        self.skipTest("every push completed before its kill landed, even with no delay: nothing was cut short")

    def test_a_daemon_killed_mid_push_is_unavailable(self):
        client = self.create_job("daemon-push")
        short = mainstay.Client(self.cluster.address, job_id=client.job_id, job_token=client.job_token, rank=0,
                                timeout_s=4, chunk_bytes=CHUNK, transport=TRANSPORT, max_backoff_s=0.5)
        errors = []

        def push():
            try:
                short.push_grad(0, 0, gradient(), wait=True)
            except mainstay.Error as e:
                errors.append(e)

        t = threading.Thread(target=push)
        t.start()
        time.sleep(0.3)
        self.cluster.kill("daemon0")
        t.join(timeout=60)
        self.assertFalse(t.is_alive())
        self.assertEqual(len(errors), 1, "the push succeeded although its daemon was killed mid-transfer")
        self.assertEqual(errors[0].code, "UNAVAILABLE", str(errors[0]))

    def test_a_daemon_killed_mid_pull_is_unavailable(self):
        client = self.create_job("daemon-pull")
        # Version 0 is published once the initial params are quantized, which on a loaded machine
        # can take longer than the short client's deadline: wait for it with the patient client.
        self.assertEqual(client.pull_bucket(0, 0).version, 0)
        short = mainstay.Client(self.cluster.address, job_id=client.job_id, job_token=client.job_token, rank=0,
                                timeout_s=4, chunk_bytes=CHUNK, transport=TRANSPORT, max_backoff_s=0.5)
        errors = []
        done = []

        def pull():
            try:
                for _ in range(50):  # version 0, again and again: some pull is cut short
                    short.pull_bucket(0, 0)
                    done.append(1)
            except mainstay.Error as e:
                errors.append(e)

        t = threading.Thread(target=pull)
        t.start()
        wait_for(lambda: len(done) >= 1 or errors, "a first pull", 60)
        self.assertEqual(errors, [], "a pull failed before the daemon was killed")
        self.cluster.kill("daemon0")
        t.join(timeout=60)
        self.assertFalse(t.is_alive())
        self.assertEqual(len(errors), 1)
        self.assertEqual(errors[0].code, "UNAVAILABLE", str(errors[0]))


if __name__ == "__main__":
    if "--pusher" in sys.argv:
        pusher_main(sys.argv[1:])
    else:
        unittest.main(verbosity=2)
