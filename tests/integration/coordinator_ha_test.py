"""Coordinators on etcd (docs/coordinator.md, "State on etcd"): three mainstay-coordinator
processes share one real etcd (Debian's etcd-server); one leads, two wait. Daemons, trainers and
mainstayctl are given all three addresses. The leader is killed with SIGKILL at chosen moments; a
standby takes over and the run goes on without a trainer restart, ending with the bytes of an
uninterrupted run (recovery_test's trainer and reference).

    MAINSTAY_COORDINATOR_BIN=... MAINSTAYD_BIN=... MAINSTAYCTL_BIN=... \\
    PYTHONPATH=<build>/client/python /usr/bin/python3 coordinator_ha_test.py
"""
import base64
import json
import os
import signal
import subprocess
import sys
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import recovery_test  # noqa: E402  (its trainer, spec and reference)
from recovery_test import D, STEPS, final_of, steps_done  # noqa: E402
from process_cluster import read, wait_for  # noqa: E402


class HaCluster(recovery_test.Cluster):
    def __init__(self, **kwargs):
        super().__init__(coordinators=3, **kwargs)


PROTO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "proto")


def parse_text_proto(text):
    """protoc --decode's text format as nested dicts: every field is a list of values (strings for
    scalars, dicts for messages)."""
    root = {}
    stack = [root]
    for line in text.splitlines():
        line = line.strip()
        if line.endswith("{"):
            child = {}
            stack[-1].setdefault(line[:-1].strip(), []).append(child)
            stack.append(child)
        elif line == "}":
            stack.pop()
        elif ":" in line:
            name, value = line.split(":", 1)
            stack[-1].setdefault(name.strip(), []).append(value.strip())
    return root


def committed_placements(cluster):
    """[(batch sequence, job id, epoch, shards)] of every placement in the state log in etcd, in
    commit order (the tests never write 1000 batches, so no snapshot has cut the log)."""
    r = cluster.etcdctl("get", "--prefix", "/mainstay/state/log/", "-w", "json")
    assert r.returncode == 0, r.stderr
    out = []
    for kv in json.loads(r.stdout).get("kvs", []):
        decoded = subprocess.run(["protoc", "--decode=mainstay.v1.StateBatch", "-I", PROTO_DIR,
                                  "mainstay/v1/state.proto"], input=base64.b64decode(kv["value"]),
                                 capture_output=True, check=True)
        batch = parse_text_proto(decoded.stdout.decode())
        for record in batch.get("records", []):
            for job in record.get("put_job", []):
                placement = job["placement"][0]
                out.append((int(batch["sequence"][0]), job["info"][0]["job_id"][0].strip('"'),
                            int(placement["epoch"][0]), repr(placement.get("shards"))))
    return sorted(out)


class CoordinatorHaTest(unittest.TestCase):
    def setUp(self):
        self.cluster = HaCluster()

    def tearDown(self):
        self.cluster.stop()

    def kill_leader(self):
        """SIGKILLs the leader; returns (its name, the standby that took over, seconds from the
        kill to the first successful mutating call through the address list)."""
        old = self.cluster.leader()
        self.assertIsNotNone(old, self.cluster.logs())
        self.cluster.kill(old)
        killed = time.time()
        # A mutating call (CreateJob with an idempotency key: a retry that reached the old
        # leader first returns the same job), retried until some coordinator takes it.
        spec = os.path.join(self.cluster.dir, "probe.json")
        with open(spec, "w") as f:
            json.dump(recovery_test.spec("probe-after-" + old), f)
        wait_for(lambda: self.cluster.ctl("jobs", "create", "--spec", spec, "--request-id", "probe-" + old, "--yes",
                                          "--timeout-ms", "1000").returncode == 0,
                 "a mutating call after the failover", timeout=60, logs=self.cluster.logs)
        took = time.time() - killed
        new = self.cluster.leader()
        self.assertIsNotNone(new, self.cluster.logs())
        self.assertNotEqual(new, old)
        return old, new, took

    def wait_step(self, rank, step):
        wait_for(lambda: ("rank %d step %d " % (rank, step)) in self.cluster.log("run.rank%d" % rank),
                 "run rank %d step %d" % (rank, step), timeout=120, logs=self.cluster.logs)

    def assert_no_epoch_issued_twice(self):
        """From etcd's copy of the state log: one placement per (job, epoch), and a job's epoch
        never goes down from one committed batch to the next, across every leader."""
        seen = {}
        last = {}
        placements = committed_placements(self.cluster)
        self.assertTrue(placements)
        for sequence, job, epoch, shards in placements:
            self.assertEqual(seen.setdefault((job, epoch), shards), shards,
                             "job %s epoch %d was issued twice (batch %d)" % (job, epoch, sequence))
            self.assertGreaterEqual(epoch, last.get(job, 0), "job %s's epoch went down at batch %d" % (job, sequence))
            last[job] = epoch

    def finish_run(self, ps, retries=False):
        """The trainers' final line. Without `retries` no step failed (the data plane never
        noticed the failover); with it (a move interrupted by the failover is redone, and a step
        in flight across it may fail and be pushed again) every step still ran exactly once."""
        for p in ps:
            self.assertEqual(self.cluster.finish(p), 0, self.cluster.logs())
        log = self.cluster.log("run.rank")
        if not retries:
            self.assertNotRegex(log, "REWOUND|RETRYING", self.cluster.logs())
        for rank in range(D):
            steps = steps_done(self.cluster, "run", rank)
            self.assertEqual(steps, list(range(STEPS)), log)
        final = final_of(self.cluster.log("run.rank0"))
        self.assertEqual(final, final_of(self.cluster.log("run.rank1")))
        return final

    def test_the_leader_killed_while_trainers_train_is_replaced_and_the_run_ends_exactly(self):
        ps = [self.cluster.trainer(r, "run", "--step-sleep", "0.1") for r in range(D)]
        self.wait_step(0, 3)
        old, new, took = self.kill_leader()
        print("failover: %s -> %s, %.2f s from SIGKILL to the first mutating call (lease TTL 3 s)"
              % (old, new, took), file=sys.stderr)
        # TTL + the standby's poll + the client's reconnect, with slack for a loaded CI machine (the
        # measured number is in docs/benchmarks.md: about the TTL).
        self.assertLess(took, 3 + 7, self.cluster.logs())
        final = self.finish_run(ps)
        # The new leader holds everything the old one committed.
        job = json.loads(read(os.path.join(self.cluster.dir, "run.job")))["job_id"]
        r = self.cluster.ctl("jobs", "show", job, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn(job, r.stdout)
        r = self.cluster.ctl("daemons", "list", "--json")
        self.assertEqual(json.loads(r.stdout)["daemons"].__len__(), 2, r.stdout)
        self.assertIn("state loaded from etcd", self.cluster.log(new + "."))
        self.assertNotIn("missed its lease", self.cluster.log(new + "."))  # nothing DOWN at takeover
        self.assert_no_epoch_issued_twice()
        self.assertEqual(final, recovery_test.RecoveryTest.run_reference(self))

    def test_the_leader_killed_during_a_drain_leaves_the_move_to_its_successor(self):
        ps = [self.cluster.trainer(r, "run", "--step-sleep", "0.1") for r in range(D)]
        self.wait_step(0, 3)
        r = self.cluster.ctl("daemons", "list", "--json")
        daemons = [d["endpoint"]["daemon_id"] for d in json.loads(r.stdout)["daemons"]]
        self.cluster.start_daemon(2)  # somewhere for the drained shards to go
        wait_for(lambda: len(json.loads(self.cluster.ctl("daemons", "list", "--json").stdout)["daemons"]) == 3,
                 "the third daemon", logs=self.cluster.logs)
        r = self.cluster.ctl("daemons", "drain", daemons[0], "--yes")
        self.assertEqual(r.returncode, 0, r.stderr + self.cluster.logs())
        self.kill_leader()
        final = self.finish_run(ps, retries=True)
        # The drain completes under the new leader: nothing is placed on the drained daemon.
        job = json.loads(read(os.path.join(self.cluster.dir, "run.job")))["job_id"]
        wait_for(lambda: daemons[0] not in self.cluster.ctl("placement", "--job", job, "--json").stdout,
                 "the drain to finish under the new leader", timeout=60, logs=self.cluster.logs)
        self.assert_no_epoch_issued_twice()
        self.assertEqual(final, recovery_test.RecoveryTest.run_reference(self))

    def test_the_leader_killed_as_a_checkpoint_starts_leaves_no_torn_checkpoint(self):
        # (This job's checkpoint takes milliseconds: the kill lands at its start or just after
        # its commit. A kill in the middle of a long write needs a slower checkpoint.)
        ps = [self.cluster.trainer(r, "run", "--step-sleep", "0.1") for r in range(D)]
        self.wait_step(0, 3)
        job = json.loads(read(os.path.join(self.cluster.dir, "run.job")))["job_id"]
        ctl = [os.environ["MAINSTAYCTL_BIN"], "checkpoint", "create", "--job", job, "--wait", "--yes", "--json",
               "--timeout-ms", "60000", "--coordinator", self.cluster.address]
        creating = subprocess.Popen(ctl, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.05)  # the call is in: the daemons are writing
        self.kill_leader()
        out, err = creating.communicate(timeout=120)
        print("the interrupted checkpoint create: exit %d %s" % (creating.returncode, (out + err).strip()[:300]),
              file=sys.stderr)
        final = self.finish_run(ps)
        # Whatever the interrupted checkpoint became, none is CORRUPT, and each COMMITTED one has
        # its manifest; a new checkpoint under the new leader commits.
        r = self.cluster.ctl("checkpoint", "create", "--job", job, "--wait", "--yes", "--json", "--timeout-ms", "60000")
        self.assertEqual(r.returncode, 0, r.stderr + self.cluster.logs())
        r = self.cluster.ctl("checkpoint", "list", "--job", job, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        listed = json.loads(r.stdout).get("checkpoints", [])
        print("checkpoints after the failover: %s" % [(c["checkpoint_id"], c["state"]) for c in listed], file=sys.stderr)
        self.assertTrue(any(c["state"] == "CHECKPOINT_STATE_COMMITTED" for c in listed), listed)
        for c in listed:
            self.assertNotEqual(c["state"], "CHECKPOINT_STATE_CORRUPT", c)
            if c["state"] == "CHECKPOINT_STATE_COMMITTED":
                self.assertTrue(os.path.exists(c["manifest_uri"]), c)
        self.assert_no_epoch_issued_twice()
        self.assertEqual(final, recovery_test.RecoveryTest.run_reference(self))

    def test_the_leader_killed_in_an_idle_moment_keeps_every_record(self):
        ps = [self.cluster.trainer(r, "run") for r in range(D)]
        final = self.finish_run(ps)
        before = {what: self.cluster.ctl(*args).stdout for what, args in
                  {"jobs": ("jobs", "list", "--json"), "daemons": ("daemons", "list", "--json")}.items()}
        self.kill_leader()
        after = json.loads(self.cluster.ctl("jobs", "list", "--json").stdout)
        probe = [j for j in after["jobs"] if j["spec"]["name"].startswith("probe")]
        self.assertEqual(len(probe), 1, after)
        after["jobs"] = [j for j in after["jobs"] if j not in probe]

        def durable(jobs):  # (committed_step and version come from the daemons' heartbeats)
            return [{k: v for k, v in j.items() if k not in ("committed_step", "version", "progress_known")} for j in jobs]
        self.assertEqual(durable(json.loads(before["jobs"])["jobs"]), durable(after["jobs"]))
        wait_for(lambda: self.cluster.ctl("daemons", "list").stdout.count("READY") == 2, "both daemons READY",
                 logs=self.cluster.logs)
        self.assertIn("FINAL", final)

    def test_trainers_and_mainstayctl_given_only_a_standby_are_served_through_it(self):
        # Standbys pass every call to the leader (docs/coordinator.md): the trainers, and
        # mainstayctl, know only coordinator2's address, which never leads in this test.
        standby = "127.0.0.1:%d" % self.cluster.coordinator_ports[2]
        self.assertNotEqual(self.cluster.leader(), "coordinator2")
        self.cluster.address = standby
        for args in (("jobs", "list"), ("daemons", "list"), ("health",)):
            r = self.cluster.ctl(*args)
            self.assertEqual(r.returncode, 0, r.stderr + self.cluster.logs())
        ps = [self.cluster.trainer(r, "run", "--step-sleep", "0.1") for r in range(D)]
        self.wait_step(0, 3)
        # The leader goes; coordinator1 takes over (coordinator2 is stopped meanwhile, so that it
        # cannot), and coordinator2 passes the calls to the new leader.
        self.cluster.procs["coordinator2"].send_signal(signal.SIGSTOP)
        old = self.cluster.leader()
        self.cluster.kill(old)
        wait_for(lambda: self.cluster.leader() not in (None, old), "a new leader", timeout=60, logs=self.cluster.logs)
        self.cluster.procs["coordinator2"].send_signal(signal.SIGCONT)
        final = self.finish_run(ps)
        self.assertEqual(self.cluster.leader(), "coordinator1")
        wait_for(lambda: "standby: coordinator1 at " in self.cluster.log("coordinator2."),
                 "coordinator2 to follow the new leader", logs=self.cluster.logs)
        job = json.loads(read(os.path.join(self.cluster.dir, "run.job")))["job_id"]
        r = self.cluster.ctl("jobs", "show", job, "--json")
        self.assertEqual(r.returncode, 0, r.stderr)
        spec = os.path.join(self.cluster.dir, "probe.json")
        with open(spec, "w") as f:
            json.dump(recovery_test.spec("probe"), f)
        r = self.cluster.ctl("jobs", "create", "--spec", spec, "--request-id", "probe", "--yes")
        self.assertEqual(r.returncode, 0, r.stderr + self.cluster.logs())
        self.assertIn("state loaded from etcd", self.cluster.log("coordinator1."))
        self.assertEqual(final, recovery_test.RecoveryTest.run_reference(self))

    def test_an_etcd_restart_is_ridden_through(self):
        # A lease longer than etcd's restart takes on a loaded machine (3 s was not, once).
        self.cluster.stop()
        self.cluster = HaCluster(coordinator_flags=["--etcd-lease-ttl-ms", "15000"])
        ps = [self.cluster.trainer(r, "run", "--step-sleep", "0.1") for r in range(D)]
        self.wait_step(0, 3)
        leader = self.cluster.leader()
        self.cluster.kill("etcd")
        time.sleep(1)
        self.cluster.start_etcd()
        final = self.finish_run(ps)
        self.assertEqual(self.cluster.leader(), leader)  # no takeover: the lease outlived the restart
        spec = os.path.join(self.cluster.dir, "probe.json")
        with open(spec, "w") as f:
            json.dump(recovery_test.spec("probe"), f)
        # (Through whichever coordinator the list reaches first: a standby may still be polling
        # etcd for the leader key after the restart.)
        wait_for(lambda: self.cluster.ctl("jobs", "create", "--spec", spec, "--request-id", "probe", "--yes",
                                          "--timeout-ms", "2000").returncode == 0,
                 "a mutating call after the etcd restart", timeout=30, logs=self.cluster.logs)
        self.assertEqual(final, recovery_test.RecoveryTest.run_reference(self))


class LeaderKilledAtAnExactMomentTest(unittest.TestCase):
    """The leader SIGKILLs itself at one exact moment (mainstay-coordinator --inject-fault
    crash-at:POINT, given to coordinator0 only: its successors run without it)."""

    cluster = None

    def start(self, point):
        self.cluster = HaCluster(flags_of_coordinator={0: ["--inject-fault", "crash-at:" + point]})

    def tearDown(self):
        if self.cluster is not None:
            self.cluster.stop()

    def test_the_leader_killed_between_create_jobs_commit_and_its_answer(self):
        # Rank 0 creates the job through the client library: coordinator0 commits it and dies
        # before answering. The client's retry (same request id) reaches the new leader, which
        # answers with the job already committed: one job, and the run ends exactly.
        self.start("create-job-committed")
        ps = [self.cluster.trainer(r, "run") for r in range(D)]
        for p in ps:
            self.assertEqual(self.cluster.finish(p), 0, self.cluster.logs())
        log0 = self.cluster.log("coordinator0.")
        self.assertIn("--inject-fault: killing this process at create-job-committed", log0)
        self.assertNotEqual(self.cluster.leader(), "coordinator0")
        job = json.loads(read(os.path.join(self.cluster.dir, "run.job")))["job_id"]
        self.assertIn("job %s 'run' created" % job, log0)  # the job coordinator0 committed
        jobs = json.loads(self.cluster.ctl("jobs", "list", "--json").stdout)["jobs"]
        self.assertEqual([j["job_id"] for j in jobs], [job], jobs)
        for rank in range(D):
            self.assertEqual(steps_done(self.cluster, "run", rank), list(range(STEPS)))
        final = final_of(self.cluster.log("run.rank0"))
        self.assertEqual(final, final_of(self.cluster.log("run.rank1")))
        self.assertEqual(final, recovery_test.RecoveryTest.run_reference(self))

    def test_the_leader_killed_mid_checkpoint_leaves_it_unloadable_and_training_untouched(self):
        # coordinator0 dies after every daemon wrote its shards of the checkpoint and before the
        # manifest: the checkpoint must never count as committed, and training goes on.
        self.start("checkpoint-shards-written")
        ps = [self.cluster.trainer(r, "run", "--step-sleep", "0.1") for r in range(D)]
        wait_for(lambda: "rank 0 step 3 " in self.cluster.log("run.rank0"), "step 3", timeout=120,
                 logs=self.cluster.logs)
        job = json.loads(read(os.path.join(self.cluster.dir, "run.job")))["job_id"]
        r = self.cluster.ctl("checkpoint", "create", "--job", job, "--wait", "--yes", "--json", "--timeout-ms", "60000")
        self.assertNotEqual(r.returncode, 0, r.stdout)  # its coordinator died before answering
        self.assertIn("--inject-fault: killing this process at checkpoint-shards-written",
                      self.cluster.log("coordinator0."))
        for p in ps:
            self.assertEqual(self.cluster.finish(p), 0, self.cluster.logs())
        self.assertNotRegex(self.cluster.log("run.rank"), "REWOUND", self.cluster.logs())
        for rank in range(D):
            self.assertEqual(steps_done(self.cluster, "run", rank), list(range(STEPS)))
        # The shards are on disk, the manifest is not: listed as FAILED, never restorable.
        torn = [d for d in os.listdir(os.path.join(self.cluster.dir, "checkpoints"))]
        self.assertEqual(len(torn), 1, torn)
        self.assertTrue(os.listdir(os.path.join(self.cluster.dir, "checkpoints", torn[0])))
        wait_for(lambda: self.cluster.ctl("checkpoint", "list", "--json").returncode == 0, "the new leader",
                 logs=self.cluster.logs)
        listed = json.loads(self.cluster.ctl("checkpoint", "list", "--json").stdout).get("checkpoints", [])
        self.assertEqual([(c["checkpoint_id"], c["state"]) for c in listed], [(torn[0], "CHECKPOINT_STATE_FAILED")])
        self.assertIn("no manifest", listed[0]["error"])
        r = self.cluster.ctl("checkpoint", "restore", torn[0], "--job", job, "--yes")
        self.assertNotEqual(r.returncode, 0, r.stdout)
        # A checkpoint under the new leader commits, and the torn one can be deleted.
        r = self.cluster.ctl("checkpoint", "create", "--job", job, "--wait", "--yes", "--json", "--timeout-ms", "60000")
        self.assertEqual(r.returncode, 0, r.stderr + self.cluster.logs())
        r = self.cluster.ctl("checkpoint", "delete", torn[0], "--yes")
        self.assertEqual(r.returncode, 0, r.stderr)
        CoordinatorHaTest.assert_no_epoch_issued_twice(self)
        final = final_of(self.cluster.log("run.rank0"))
        self.assertEqual(final, final_of(self.cluster.log("run.rank1")))
        self.assertEqual(final, recovery_test.RecoveryTest.run_reference(self))


class ThreeMemberEtcdTest(unittest.TestCase):
    def setUp(self):
        self.cluster = HaCluster(etcd_members=3)

    def tearDown(self):
        self.cluster.stop()

    def test_one_etcd_member_killed_changes_nothing(self):
        ps = [self.cluster.trainer(r, "run", "--step-sleep", "0.1") for r in range(D)]
        wait_for(lambda: "rank 0 step 3 " in self.cluster.log("run.rank0"), "step 3", timeout=120,
                 logs=self.cluster.logs)
        leader = self.cluster.leader()
        # The member the coordinators talk to first (the first endpoint) goes.
        self.cluster.kill("etcd0")
        for p in ps:
            self.assertEqual(self.cluster.finish(p), 0, self.cluster.logs())
        self.assertNotRegex(self.cluster.log("run.rank"), "REWOUND|RETRYING", self.cluster.logs())
        spec = os.path.join(self.cluster.dir, "probe.json")
        with open(spec, "w") as f:
            json.dump(recovery_test.spec("probe"), f)
        r = self.cluster.ctl("jobs", "create", "--spec", spec, "--request-id", "probe", "--yes")
        self.assertEqual(r.returncode, 0, r.stderr + self.cluster.logs())
        self.assertEqual(self.cluster.leader(), leader)  # the lease was kept alive through the others
        self.assertEqual(final_of(self.cluster.log("run.rank0")), final_of(self.cluster.log("run.rank1")))


if __name__ == "__main__":
    unittest.main(verbosity=2)
