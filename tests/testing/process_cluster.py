"""The process harness of the multi-process Python tests (recovery_test, transport_fault_test,
test_torch_cluster): a mainstay-coordinator and mainstayd processes on loopback (or in network
namespaces), trainer processes, SIGKILL and restart of any of them, their logs.

Binaries from the environment: MAINSTAY_COORDINATOR_BIN, MAINSTAYD_BIN, MAINSTAYCTL_BIN (for
`ctl`). A test's trainer script is the subclass's TRAINER (run with `--trainer`).
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

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
                 daemon_hosts=None, flags_of_daemon=None, coordinators=0, etcd_members=1, flags_of_coordinator=None):
        """`daemon_hosts[i]`: (address to listen on, command prefix), e.g. a network namespace.
        `flags_of_daemon[i]`: extra flags of daemon i only. `coordinators` > 0: that many
        coordinators ("coordinatorI", on loopback) keep the state in a real etcd ("etcd", Debian's
        etcd-server) instead of a state directory; the first leads, the others are standbys, and
        every client is given all their addresses. `etcd_members`: the size of that etcd cluster.
        `flags_of_coordinator[i]`: extra flags of coordinator i only (its first start)."""
        self.flags_of_daemon = flags_of_daemon or {}
        self.flags_of_coordinator = flags_of_coordinator or {}
        self.dir = tempfile.mkdtemp(prefix="mainstay-recovery.")
        self.procs = {}
        self.trainers = []
        self.lease_ms = lease_ms
        self.coordinator_flags = list(coordinator_flags)
        # MAINSTAY_TEST_DAEMON_FLAGS (space-separated) goes to every daemon too, as in slice_test:
        # e.g. "--device cpu-staged" (CTest's fault_matrix_test_cpu_staged).
        self.daemon_flags = list(daemon_flags) + os.environ.get("MAINSTAY_TEST_DAEMON_FLAGS", "").split()
        self.daemon_hosts = daemon_hosts or {}
        self.host = host
        self._use_port(free_port())
        # The internal calls need it (docs/operations.md, "Threat model"): the coordinator makes
        # it on its first start, the daemons (and the other coordinators) read it.
        self.secret = os.path.join(self.dir, "cluster.secret")
        self.coordinator_ports = [free_port() for _ in range(coordinators)]
        self.etcd_members = etcd_members
        try:
            if coordinators:
                self.start_etcd()
                self.address = ",".join("127.0.0.1:%d" % p for p in self.coordinator_ports)
                for i in range(coordinators):
                    self.start_coordinator(i)
            else:
                self.start_coordinator()
            for i in range(daemons):
                self.start_daemon(i)
        except BaseException:
            self.stop()  # nothing started is left running
            raise

    def start_etcd(self, member=None):
        """etcd on loopback: one member ("etcd"), or with etcd_members > 1 member `member` of
        that many ("etcdI"; all of them when None), each on the same data across restarts."""
        n = self.etcd_members
        if not hasattr(self, "etcd_ports"):
            self.etcd_ports = [(free_port(), free_port()) for _ in range(n)]
        urls = [("http://127.0.0.1:%d" % c, "http://127.0.0.1:%d" % p) for c, p in self.etcd_ports]
        self.etcd_endpoint = ",".join(client for client, _ in urls)
        initial = ",".join("t%d=%s" % (i, peer) for i, (_, peer) in enumerate(urls))
        for i in ([member] if member is not None else range(n)):
            client, peer = urls[i]
            self._start("etcd" if n == 1 else "etcd%d" % i,
                        [os.environ.get("MAINSTAY_ETCD_BIN", "/usr/bin/etcd"), "--name", "t%d" % i, "--data-dir",
                         os.path.join(self.dir, "etcd%d" % i), "--listen-client-urls", client,
                         "--advertise-client-urls", client, "--listen-peer-urls", peer,
                         "--initial-advertise-peer-urls", peer, "--initial-cluster", initial, "--log-level", "warn"])

        def healthy(client):
            try:
                with urllib.request.urlopen(client + "/health", timeout=1) as r:
                    return b'"health":"true"' in r.read()
            except OSError:
                return False
        for i in ([member] if member is not None else range(n)):
            wait_for(lambda: healthy(urls[i][0]), "etcd member %d" % i, logs=self.logs)

    def etcdctl(self, *args):
        """etcdctl (v3 API, Debian's etcd-client) against the cluster's etcd."""
        return subprocess.run(["etcdctl", "--endpoints", self.etcd_endpoint] + list(args), capture_output=True,
                              text=True, timeout=60, env=dict(os.environ, ETCDCTL_API="3"))

    def leader(self):
        """The name of the live coordinator that leads (the last of its log's "leading" and
        "standby" lines says so: a restarted one appends to the same log), or None."""
        for i in range(len(self.coordinator_ports)):
            name = "coordinator%d" % i
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            log = self.log(name + ".")
            if log.rfind("I coordinator: leading (") > log.rfind("I coordinator: standby: "):
                return name
        return None

    def _start(self, name, argv):
        with open(os.path.join(self.dir, name + ".log"), "a") as log:
            self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        return self.procs[name]

    def _use_port(self, port):
        """The single coordinator's port, and the addresses made of it."""
        self.port = port
        self.address = "%s:%d" % (self.host, port)
        self.listen = "0.0.0.0:%d" % port if self.host != "127.0.0.1" else self.address

    def _start_server(self, name, argv_of, port, use_port, ready, what):
        """Starts server `name` with argv_of(port), then waits for ready(). A port picked free
        can be taken by another process before the server binds it; the server then exits at
        once ("cannot listen"). At its first start it is started again on a new port
        (use_port(port) is called before each start). A restart keeps its port: it fails."""
        first_start = name not in self.procs
        for _ in range(5):
            use_port(port)
            p = self._start(name, argv_of(port))
            wait_for(lambda: p.poll() is not None or ready(), what, logs=self.logs)
            if p.poll() is None:
                return
            if not first_start or "cannot listen" not in self.log(name + "."):
                raise AssertionError("%s exited with %s\n%s" % (name, p.returncode, self.logs()))
            port = free_port()
        raise AssertionError("%s found no free port in 5 tries\n%s" % (name, self.logs()))

    def start_coordinator(self, i=None):
        """The coordinator; with etcd, coordinator `i` (the first to start leads: wait for it)."""
        common = ["--checkpoint-dir", os.path.join(self.dir, "checkpoints"), "--tick-ms", "100",
                  "--cluster-secret-file", self.secret, "--metrics-listen", "off"]
        if i is None:
            self._start_server("coordinator", lambda port: [os.environ["MAINSTAY_COORDINATOR_BIN"], "--listen",
                                                            self.listen, "--state-dir", os.path.join(self.dir, "state")]
                               + common + self.coordinator_flags,
                               self.port, self._use_port, lambda: self.ctl("health").returncode == 0, "the coordinator")
            return
        name = "coordinator%d" % i
        first = self.leader() is None
        flags = list(self.flags_of_coordinator.pop(i, []))

        def use_port(port):
            self.coordinator_ports[i] = port
            self.address = ",".join("127.0.0.1:%d" % p for p in self.coordinator_ports)

        if first:
            ready, what = (lambda: self.ctl("health").returncode == 0), name
        else:
            ready, what = (lambda: "standby:" in self.log(name + ".") or self.leader() == name), name + " as a standby"
        self._start_server(name, lambda port: [os.environ["MAINSTAY_COORDINATOR_BIN"], "--listen", "127.0.0.1:%d" % port,
                                               "--etcd-endpoints", self.etcd_endpoint, "--etcd-lease-ttl-ms", "3000",
                                               "--coordinator-id", name] + common + self.coordinator_flags + flags,
                           self.coordinator_ports[i], use_port, ready, what)

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

    def placement(self, job):
        """The job's placement shards (`mainstayctl placement --json`)."""
        r = self.ctl("placement", "--job", job, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)["placement"]["shards"]

    def daemon_process(self, daemon_id):
        """The process name ("daemonI") of a daemon id (by its node name "nodeI")."""
        r = self.ctl("daemons", "list", "--json")
        assert r.returncode == 0, r.stderr
        for d in json.loads(r.stdout)["daemons"]:
            if d["endpoint"]["daemon_id"] == daemon_id:
                return "daemon" + d["endpoint"]["node_name"][len("node"):]
        raise AssertionError("no daemon %s in %s" % (daemon_id, r.stdout))

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
