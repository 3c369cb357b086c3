"""The process harness of the multi-process Python tests (recovery_test, transport_fault_test,
test_torch_cluster): a mainstay-coordinator and mainstayd processes on loopback (or in network
namespaces), trainer processes, SIGKILL and restart of any of them, their logs.

Binaries from the environment: MAINSTAY_COORDINATOR_BIN, MAINSTAYD_BIN, MAINSTAYCTL_BIN (for
`ctl`). A test's trainer script is the subclass's TRAINER (run with `--trainer`).
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

PYTHON = sys.executable

def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read(path):
    with open(path, errors="replace") as f:
        return f.read()


def wait_for(predicate, what, timeout=60, logs=None):
    """`logs`: a callable whose text goes into the failure, e.g. Cluster.logs."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting for " + what + ("\n" + logs() if logs else ""))


class Cluster:
    """Processes by name: "coordinator", "daemonI", and "NAME.rankR.TIME" for trainers."""

    TRAINER = None  # the trainer script (`trainer` runs it with --trainer)

    def __init__(self, daemons=2, lease_ms=1500, coordinator_flags=(), daemon_flags=(), host="127.0.0.1",
                 daemon_hosts=None, flags_of_daemon=None):
        """`daemon_hosts[i]`: (address to listen on, command prefix), e.g. a network namespace.
        `flags_of_daemon[i]`: extra flags of daemon i only."""
        self.flags_of_daemon = flags_of_daemon or {}
        self.dir = tempfile.mkdtemp(prefix="mainstay-recovery.")
        self.procs = {}
        self.trainers = []
        self.lease_ms = lease_ms
        self.coordinator_flags = list(coordinator_flags)
        self.daemon_flags = list(daemon_flags)
        self.daemon_hosts = daemon_hosts or {}
        self.port = free_port()
        self.address = "%s:%d" % (host, self.port)
        self.listen = "0.0.0.0:%d" % self.port if host != "127.0.0.1" else self.address
        # The internal calls need it (docs/operations.md, "Threat model"): the coordinator makes
        # it on its first start, the daemons read it.
        self.secret = os.path.join(self.dir, "cluster.secret")
        self.start_coordinator()
        for i in range(daemons):
            self.start_daemon(i)

    def _start(self, name, argv):
        with open(os.path.join(self.dir, name + ".log"), "a") as log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        return self.procs[name]

    def start_coordinator(self):
        self._start("coordinator", [os.environ["MAINSTAY_COORDINATOR_BIN"], "--listen", self.listen,
                                    "--state-dir", os.path.join(self.dir, "state"),
                                    "--checkpoint-dir", os.path.join(self.dir, "checkpoints"), "--tick-ms", "100",
                                    "--cluster-secret-file", self.secret, "--metrics-listen", "off"]
                    + self.coordinator_flags)
        wait_for(lambda: self.ctl("health").returncode == 0, "the coordinator")

    def start_daemon(self, i):
        pf = os.path.join(self.dir, "daemon%d.port" % i)
        if os.path.exists(pf):
            os.remove(pf)
        host, prefix = self.daemon_hosts.get(i, ("127.0.0.1", []))
        p = self._start("daemon%d" % i, prefix + [os.environ["MAINSTAYD_BIN"], "--coordinator", self.address, "--listen",
                                         host + ":0", "--node-name", "node%d" % i, "--threads", "1",
                                         "--memory-bytes", "2000000000", "--lease-ttl-ms", str(self.lease_ms),
                                         "--peer-timeout-ms", "5000", "--metrics-listen", "off", "--port-file", pf,
                                         "--cluster-secret-file", self.secret]
                    + self.daemon_flags + list(self.flags_of_daemon.get(i, [])))
        wait_for(lambda: os.path.exists(pf) and os.path.getsize(pf) > 0 or p.poll() is not None, "daemon%d" % i)

    def kill(self, name):
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def finish(self, proc, timeout=300):
        """`proc`'s exit status; past `timeout` seconds it is killed and the failure carries every
        log (a hung trainer's last lines are what says where it waited)."""
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            if proc in self.trainers:  # they dump their Python stacks on SIGUSR1 (faulthandler)
                proc.send_signal(signal.SIGUSR1)
                time.sleep(1)
            proc.kill()
            proc.wait()
            raise AssertionError("%s did not end within %d s\n%s" % (" ".join(proc.args[:6]), timeout, self.logs(80)))

    def trainer(self, rank, name, *extra):
        p = self._start("%s.rank%d.%d" % (name, rank, time.time_ns()),
                        [PYTHON, self.TRAINER, "--trainer", "--coordinator", self.address, "--rank",
                         str(rank), "--job-file", os.path.join(self.dir, name + ".job"), "--name", name] + list(extra))
        self.trainers.append(p)
        return p

    def ctl(self, *args):
        return subprocess.run([os.environ["MAINSTAYCTL_BIN"]] + list(args) + ["--coordinator", self.address],
                              capture_output=True, text=True, timeout=120)

    def log(self, prefix):
        out = ""
        for f in sorted(os.listdir(self.dir)):
            if f.startswith(prefix) and f.endswith(".log"):
                out += read(os.path.join(self.dir, f))
        return out

    def logs(self, lines=25):
        return "\n".join("--- %s\n%s" % (f, "\n".join(read(os.path.join(self.dir, f)).splitlines()[-lines:]))
                         for f in sorted(os.listdir(self.dir)) if f.endswith(".log"))

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
