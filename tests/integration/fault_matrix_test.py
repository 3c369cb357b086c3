"""The fault matrix (docs/architecture.md, "Failure cases considered"): replication_factor 2,
three daemons (four where a second copy must survive a re-replication's loss), two trainer
processes, and one process SIGKILLed at one phase of a step, of a move or of a re-replication:

- a daemon holding primaries, and a daemon holding only replicas, killed by itself
  (`mainstayd --inject-fault crash-at:PHASE:STEP:ROLE`, every daemon armed, the first to get there
  fires: `--inject-fault-once`) mid-push, while the trainers wait in FinishStep, mid-update
  (half its shards written) and between the deciding reduction and the commit;
- a move's source and a move's target killed mid-move (a drain under load), and a
  re-replication's target killed mid-copy;
- the coordinator killed with a move's, a failover's or a re-replication's placement epoch
  durable and not yet sent (`mainstay-coordinator --inject-fault crash-at:POINT`), then restarted;
- a trainer killed mid-push and while it waits in FinishStep, then restarted.

Each run must finish every step with no rewind, each step committed once and in order, the
committed step never going down (watched through `mainstayctl jobs show` all along), and end
with the final weights of an uninterrupted run, bit for bit (the trainers' gradients are a
deterministic function of step, rank and the pulled weights: recovery_test.py's trainer).

    MAINSTAY_COORDINATOR_BIN=... MAINSTAYD_BIN=... MAINSTAYCTL_BIN=... \\
    PYTHONPATH=<build>/client/python /usr/bin/python3 fault_matrix_test.py
"""
import json
import os
import re
import subprocess
import sys
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "testing"))
sys.path.insert(0, HERE)
import process_cluster  # noqa: E402
from process_cluster import read, wait_for  # noqa: E402
import recovery_test  # noqa: E402  (its trainer process and log helpers)
from recovery_test import D, STEPS, final_of, steps_done  # noqa: E402

AT = 5  # the step (or, for moves, the committed step) the faults are armed at


class Cluster(process_cluster.Cluster):
    TRAINER = os.path.join(HERE, "recovery_test.py")


class CommittedStepWatch:
    """Polls the job's committed step (`mainstayctl jobs show --json`) until stopped; `drops`
    lists every time it went down. Calls that fail (the coordinator is down) are skipped."""

    def __init__(self, cluster, job_file):
        self.cluster, self.job_file = cluster, job_file
        self.seen, self.drops = [], []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.done.wait(0.25):
            if not os.path.exists(self.job_file):
                continue
            job = json.loads(read(self.job_file))["job_id"]
            try:
                r = self.cluster.ctl("jobs", "show", job, "--json", "--timeout-ms", "2000")
            except Exception:  # noqa: BLE001 (a hung call is skipped like a failed one)
                continue
            if r.returncode != 0:
                continue
            job_info = json.loads(r.stdout)["job"]
            if not job_info.get("progress_known"):  # the first heartbeats after a coordinator restart
                continue
            step = int(job_info["committed_step"])
            if self.seen and step < self.seen[-1]:
                self.drops.append((self.seen[-1], step))
            self.seen.append(step)

    def stop(self):
        self.done.set()
        self.thread.join()


class FaultMatrixTest(unittest.TestCase):
    reference = None

    @classmethod
    def setUpClass(cls):
        """The uninterrupted run's final weights (replication changes no bit: R = 1 on two daemons)."""
        cluster = Cluster()
        try:
            ps = [cluster.trainer(r, "reference") for r in range(D)]
            for p in ps:
                assert cluster.finish(p) == 0, cluster.logs()
            cls.reference = final_of(cluster.log("reference.rank0"))
        finally:
            cluster.stop()

    def setUp(self):
        self.cluster = None

    def tearDown(self):
        if self.cluster is not None:
            self.cluster.stop()

    # -- helpers ------------------------------------------------------------------------------

    def start(self, daemons=3, daemon_fault=None, coordinator_fault=None, flags_of_daemon=None):
        """The cluster; `daemon_fault` arms every daemon with it (one of them fires)."""
        once = None
        daemon_flags = []
        if daemon_fault:
            once = "fault.once"  # made relative to the cluster's directory below
            daemon_flags = ["--inject-fault", daemon_fault]
        coordinator_flags = ["--inject-fault", coordinator_fault] if coordinator_fault else []
        self.cluster = Cluster(daemons=0, coordinator_flags=coordinator_flags, daemon_flags=daemon_flags,
                               flags_of_daemon=flags_of_daemon)
        if once:
            self.cluster.daemon_flags += ["--inject-fault-once", os.path.join(self.cluster.dir, once)]
        for i in range(daemons):
            self.cluster.start_daemon(i)
        self.job_file = os.path.join(self.cluster.dir, "run.job")
        self.watch = CommittedStepWatch(self.cluster, self.job_file)

    def trainers(self, *extra, steps_sleep="0.05", extra_of=None):
        extra_of = extra_of or {}
        return [self.cluster.trainer(r, "run", "--replication", "2", "--step-sleep", steps_sleep, *extra,
                                     *extra_of.get(r, [])) for r in range(D)]

    def job(self):
        wait_for(lambda: os.path.exists(self.job_file), "the job", logs=self.cluster.logs)
        return json.loads(read(self.job_file))["job_id"]

    def wait_step(self, rank, step):
        wait_for(lambda: ("rank %d step %d " % (rank, step)) in self.cluster.log("run.rank%d" % rank),
                 "rank %d step %d" % (rank, step), timeout=120, logs=self.cluster.logs)

    def daemon_id_of(self, i):
        r = self.cluster.ctl("daemons", "list", "--json")
        return [d["endpoint"]["daemon_id"] for d in json.loads(r.stdout)["daemons"]
                if d["endpoint"]["node_name"] == "node%d" % i][0]

    def fired(self):
        """The daemon processes whose injected crash fired."""
        return [name for name in self.cluster.procs if name.startswith("daemon")
                and "injected fault: SIGKILL" in self.cluster.log(name + ".")]

    def check_run(self, ps, restarted_rank=None, mutated=False):
        """Every trainer ends; each rank committed every step once, in order, nothing rewound;
        the committed step never went down; the final weights are the uninterrupted run's (with
        `mutated`, the daemons' replicas dropped a step: they must not be)."""
        for p in ps:
            self.assertEqual(self.cluster.finish(p), 0, self.cluster.logs())
        self.watch.stop()
        log = self.cluster.log("run.rank")
        # No error reached the training loop: a step a daemon gave up was pushed again by the
        # client's FinishStep itself (its "attempts" > 1), never by the loop (REWOUND, RETRYING).
        self.assertNotRegex(log, "REWOUND|RETRYING", self.cluster.logs())
        self.assertNotIn("restoring from checkpoint", self.cluster.log("coordinator"))
        for rank in range(D):
            steps = steps_done(self.cluster, "run", rank)
            if rank == restarted_rank:  # its first process may have seen the step it died in commit
                self.assertEqual(steps, sorted(set(steps)), log)
                self.assertEqual(steps[-1], STEPS - 1, log)
                self.assertTrue(set(steps) >= set(range(STEPS)) - {AT}, log)
            else:
                self.assertEqual(steps, list(range(STEPS)), log)
        self.assertEqual(self.watch.drops, [], "the committed step went down: %s" % self.watch.seen)
        self.assertTrue(self.watch.seen, "the committed step was never read")
        final = final_of(self.cluster.log("run.rank0"))
        self.assertEqual(final, final_of(self.cluster.log("run.rank1")))
        if mutated:
            self.assertNotEqual(final, self.reference, "the matrix missed replicas that dropped a step")
        else:
            self.assertEqual(final, self.reference)

    def daemon_case(self, phase, role, mutation=None, reduced=True):
        """With `reduced`, the trainers push reduced gradients and send the replicas copies of them:
        the primaries forward only each step's header (docs/architecture.md, "Replicas").
        Otherwise unreduced pushes, whose FP32 sum the primaries forward. Both end with the same
        bits (one FP32 addition for D = 2)."""
        self.start(daemon_fault="crash-at:%s:%d:%s" % (phase, AT, role) + ("," + mutation if mutation else ""))
        ps = self.trainers("--reduced") if reduced else self.trainers()
        self.check_run(ps, mutated=mutation is not None)
        for rank in range(D):
            before = [int(l.split()[-1]) for l in self.cluster.log("run.rank%d" % rank).splitlines()
                      if l.startswith("rank %d step " % rank) and int(l.split()[3]) < AT]
            self.assertTrue(before, self.cluster.log("run.rank%d" % rank))
            if reduced:  # most steps at least: a copy that lags its push too long is given up
                self.assertGreater(before.count(0), len(before) // 2,
                                   "the replicas did not take the trainers' copies: forwarded %s" % before)
            else:
                self.assertNotIn(0, before, "unreduced pushes' sums must be forwarded: %s" % before)
        fired = self.fired()
        self.assertEqual(len(fired), 1, self.cluster.logs())
        self.assertIn("fail over to their replicas", self.cluster.log("coordinator"))
        return fired[0]

    # -- a daemon, at each phase of a step ----------------------------------------------------

    def test_a_daemon_holding_primaries_killed_mid_push(self):
        self.assertIn("push of step %d stored, not answered" % AT, self.cluster_log_of(self.daemon_case("input", "primary")))

    def test_a_daemon_holding_only_replicas_killed_as_the_forward_arrives(self):
        self.assertIn("forward of step %d stored" % AT, self.cluster_log_of(self.daemon_case("input", "replica-only")))

    def test_a_daemon_holding_primaries_killed_while_the_trainers_wait_in_finish_step(self):
        self.assertIn("FinishStep of step %d arrived" % AT,
                      self.cluster_log_of(self.daemon_case("finish", "primary", reduced=False)))

    def test_a_daemon_holding_primaries_killed_mid_update(self):
        self.assertIn("shards updated by step %d" % AT, self.cluster_log_of(self.daemon_case("update", "primary")))

    def test_a_daemon_holding_only_replicas_killed_mid_update(self):
        self.assertIn("shards updated by step %d" % AT,
                      self.cluster_log_of(self.daemon_case("update", "replica-only", reduced=False)))

    def test_a_daemon_holding_primaries_killed_between_the_decision_and_the_commit(self):
        self.assertIn("after deciding step %d" % AT,
                      self.cluster_log_of(self.daemon_case("decision", "primary", reduced=False)))

    def test_a_daemon_holding_only_replicas_killed_between_the_decision_and_the_commit(self):
        self.assertIn("after deciding step %d" % AT, self.cluster_log_of(self.daemon_case("decision", "replica-only")))

    def test_a_daemon_holding_primaries_killed_after_the_commit_before_the_pull(self):
        # The trainers' FinishStep of step AT returned; the new version is pulled from the
        # promoted replicas.
        self.assertIn("with a pull of version %d arrived" % (AT + 1),
                      self.cluster_log_of(self.daemon_case("pull", "primary")))

    def cluster_log_of(self, name):
        return self.cluster.log(name + ".")

    def test_the_matrix_catches_replicas_that_drop_a_step(self):
        # The mutation check: every daemon's replicas update step 2 with a zero gradient
        # (drop-replica-input:2). Each case that promotes a replica must then end with other bytes.
        for phase in ("input", "finish", "update", "decision"):
            with self.subTest(phase=phase):
                self.daemon_case(phase, "primary", mutation="drop-replica-input:2", reduced=phase in ("input", "update"))
                self.cluster.stop()
                self.cluster = None

    # -- moves and re-replication -------------------------------------------------------------

    def drain_under_load(self, victim_index=0):
        ps = self.trainers()
        self.wait_step(0, 3)
        r = self.cluster.ctl("daemons", "drain", self.daemon_id_of(victim_index), "--yes")
        return ps, r

    def test_a_moves_source_killed_mid_move(self):
        # Daemon 0 is drained and SIGKILLs itself when the first target asks it for a copy: each
        # move continues, at the failover's epoch, from another copy of its rank.
        self.start(flags_of_daemon={0: ["--inject-fault", "crash-at:copy:2"]})
        victim = self.daemon_id_of(0)
        ps, r = self.drain_under_load(0)
        self.assertEqual(r.returncode, 0, r.stderr + self.cluster.logs())
        self.check_run(ps)
        self.assertIn("SIGKILL when asked for a copy", self.cluster.log("daemon0"))
        self.assertIn("lost its source " + victim, self.cluster.log("coordinator"))

    def test_a_moves_target_killed_mid_move(self):
        # Every daemon is armed to die holding a copy it has not installed; only a drain's
        # targets ever hold one. The move dies with its target; the drained daemon keeps its copies.
        self.start(daemon_fault="crash-at:install:2:any")
        ps, r = self.drain_under_load(0)
        self.assertEqual(r.returncode, 0, r.stderr + self.cluster.logs())
        self.check_run(ps)
        fired = self.fired()
        self.assertEqual(len(fired), 1, self.cluster.logs())
        self.assertNotEqual(fired[0], "daemon0")
        self.assertIn("not installed", self.cluster.log(fired[0] + "."))

    def kill_primary_of_rank0(self, job):
        shards = self.cluster.placement(job)
        victim = [s["daemon_id"] for s in shards if s["shard"].get("shard", 0) == 0][0]
        self.cluster.kill(self.cluster.daemon_process(victim))
        return victim

    def test_a_re_replications_target_killed_mid_copy(self):
        # Four daemons. Rank 0's primary is SIGKILLed from outside; the re-replication that
        # follows copies onto a daemon armed to die before installing the copy. The job goes on
        # and is re-replicated again, onto what is left.
        self.start(daemons=4, daemon_fault="crash-at:install:0:any")
        ps = self.trainers()
        self.wait_step(0, 3)
        self.kill_primary_of_rank0(self.job())
        self.check_run(ps)
        fired = self.fired()
        self.assertEqual(len(fired), 1, self.cluster.logs())
        self.assertIn("not installed", self.cluster.log(fired[0] + "."))
        self.assertGreaterEqual(self.cluster.log("coordinator").count("re-replicating at placement epoch"), 2)

    # -- the coordinator ----------------------------------------------------------------------

    def restart_coordinator_after_its_fault(self, point):
        wait_for(lambda: self.cluster.procs["coordinator"].poll() is not None, "the coordinator's crash at " + point,
                 logs=self.cluster.logs)
        self.assertIn("killing this process at " + point, self.cluster.log("coordinator"))
        self.cluster.coordinator_flags = []  # restarted without the fault
        self.cluster.start_coordinator()

    def test_the_coordinator_killed_with_a_moves_epoch_not_sent(self):
        self.start(coordinator_fault="crash-at:move-committed")
        victim = self.daemon_id_of(0)
        ps = self.trainers()
        self.wait_step(0, 3)
        # The drain's call dies with the coordinator (mainstayctl may retry it against the new one).
        drain = subprocess.Popen([os.environ["MAINSTAYCTL_BIN"], "daemons", "drain", victim, "--yes", "--coordinator",
                                  self.cluster.address], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.restart_coordinator_after_its_fault("move-committed")
        drain.wait(timeout=120)
        # The restarted coordinator re-sends the committed move (reconciliation), and it finishes.
        wait_for(lambda: "dropping it on " + victim in self.cluster.log("coordinator"), "the move's end", 90,
                 logs=self.cluster.logs)
        self.check_run(ps)

    def test_the_coordinator_killed_with_a_failovers_epoch_not_sent(self):
        self.start(coordinator_fault="crash-at:failover-committed")
        ps = self.trainers()
        self.wait_step(0, 3)
        self.kill_primary_of_rank0(self.job())
        self.restart_coordinator_after_its_fault("failover-committed")
        self.check_run(ps)

    def test_the_coordinator_killed_with_a_re_replications_epoch_not_sent(self):
        self.start(coordinator_fault="crash-at:re-replication-committed")
        ps = self.trainers()
        self.wait_step(0, 3)
        self.kill_primary_of_rank0(self.job())
        self.restart_coordinator_after_its_fault("re-replication-committed")
        wait_for(lambda: "copies again" in self.cluster.log("coordinator"), "the re-replication's copy", 90,
                 logs=self.cluster.logs)
        self.check_run(ps)

    # -- a trainer ----------------------------------------------------------------------------

    def trainer_case(self, crash, *extra_of_rank0):
        self.start()
        ps = self.trainers(extra_of={0: list(extra_of_rank0), 1: ["--crash-at", crash]})
        wait_for(lambda: ps[1].poll() is not None, "rank 1's crash", 120, logs=self.cluster.logs)
        self.assertIn("SIGKILL", self.cluster.log("run.rank1"))
        # Rank 1 died in step AT: the job cannot go past it without rank 1. Once the daemons'
        # heartbeats have told the coordinator (version >= AT), the restarted trainer is told
        # that version when it attaches (GetLayout), not the version at creation.
        job = self.job()

        def reported():
            r = self.cluster.ctl("jobs", "show", job, "--json")
            info = json.loads(r.stdout)["job"] if r.returncode == 0 else {}
            return info.get("progress_known") and int(info["version"]) >= AT
        wait_for(reported, "the daemons' heartbeats reporting version %d" % AT, logs=self.cluster.logs)
        restarted = self.cluster.trainer(1, "run", "--resume", "--step-sleep", "0.05")
        self.check_run([ps[0], restarted], restarted_rank=1)
        self.assertRegex(self.cluster.log("run.rank1"), r"rank 1 resumed at step (%d|%d)" % (AT, AT + 1))
        said = int(re.search(r"coordinator said version (\d+)", self.cluster.log("run.rank1")).group(1))
        self.assertGreaterEqual(said, AT, self.cluster.log("run.rank1"))

    def test_a_trainer_killed_mid_push(self):
        self.trainer_case("push:%d" % AT)

    def test_a_trainer_killed_while_it_waits_in_finish_step(self):
        # Rank 0 pushes step AT a second late, so rank 1 is still waiting when it dies.
        self.trainer_case("finish:%d" % AT, "--delay-before-step", "%d:1.0" % AT)


if __name__ == "__main__":
    unittest.main(verbosity=2)
