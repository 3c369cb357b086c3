#!/usr/bin/env python3
"""Renders a kustomization of deploy/k8s with `kubectl kustomize` and checks its structure.

usage: check_k8s.py --variant gpu|cpu [--tls] [--kubectl PATH] DIR

Checks what a reader of the manifests would otherwise find out on a cluster: the expected
kinds, one namespace, probes that hit the gRPC port each binary listens on (Kubernetes' native
gRPC probe against grpc.health.v1), Services and the PodDisruptionBudget that select the pods
they mean, every $(VAR) of the daemon's args defined, ConfigMap keys that exist, tagged images,
Prometheus scrape annotations, both binaries' --cluster-secret-file on a mounted Secret, the daemon's readiness on service mainstay.v1.Shard (ready once
registered), GPU resources plus hostIPC in the gpu variant and neither in the cpu one, and with
--tls: TLS flags whose files lie on mounted Secrets, mutual TLS, the coordinator's admin token
from a Secret, and probes on the plaintext --health-listen port. Exit 77 (CTest: skipped) with the reason when kubectl or PyYAML is missing, or
when kubectl's built-in kustomize is too old for overlays.
"""
import argparse
import json
import re
import shutil
import subprocess
import sys

SKIP = 77
METRICS_PORT = 9464


def skip(reason):
    print("SKIP:", reason)
    sys.exit(SKIP)


class Checker:
    def __init__(self):
        self.failures = []
        self.passed = 0

    def check(self, ok, what):
        if ok:
            self.passed += 1
        else:
            self.failures.append(what)
        return ok


def kubectl_minor(kubectl):
    out = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True, text=True)
    try:
        return int(re.match(r"\d+", json.loads(out.stdout)["clientVersion"]["minor"]).group(0))
    except (ValueError, KeyError, AttributeError, TypeError):
        return None


def port_of(address):
    return int(address.rsplit(":", 1)[1])


def flag_value(args, name):
    """The value of --name in a container's args (either --name=V or --name V)."""
    for i, a in enumerate(args):
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
        if a == name and i + 1 < len(args):
            return args[i + 1]
    return None


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def check_pod(c, kind_name, template, container, grpc_port, config_maps, probe_port=None, ready_service=""):
    spec = template["spec"]
    meta = template["metadata"]
    ann = meta.get("annotations", {})
    c.check(ann.get("prometheus.io/scrape") == "true", f"{kind_name}: prometheus.io/scrape is not \"true\"")
    c.check(ann.get("prometheus.io/port") == str(METRICS_PORT), f"{kind_name}: prometheus.io/port is not {METRICS_PORT}")
    c.check(ann.get("prometheus.io/path") == "/metrics", f"{kind_name}: prometheus.io/path is not /metrics")
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    c.check(ports.get("grpc") == grpc_port, f"{kind_name}: container port 'grpc' is {ports.get('grpc')}, the binary listens on {grpc_port}")
    c.check(ports.get("metrics") == METRICS_PORT, f"{kind_name}: no container port 'metrics' {METRICS_PORT}")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        p = container.get(probe)
        if not c.check(p is not None, f"{kind_name}: no {probe}"):
            continue
        grpc = p.get("grpc")
        c.check(grpc is not None, f"{kind_name}: {probe} is not a gRPC probe")
        if grpc is not None:
            # The native gRPC probe takes a number, not a port name, and cannot speak TLS.
            want_port = probe_port or grpc_port
            c.check(grpc.get("port") == want_port, f"{kind_name}: {probe} probes port {grpc.get('port')}, not {want_port}")
            want = ready_service if probe == "readinessProbe" else ""
            c.check(grpc.get("service", "") == want, f"{kind_name}: {probe} asks for service {grpc.get('service')!r}, not {want!r}")
    image = container.get("image", "")
    c.check(re.fullmatch(r"[\w./-]*mainstay:[\w.-]+", image) is not None and not image.endswith(":latest"),
            f"{kind_name}: image {image!r} is not a tagged mainstay image")
    sc = spec.get("securityContext", {})
    c.check(sc.get("runAsNonRoot") is True, f"{kind_name}: pod does not set runAsNonRoot")
    csc = container.get("securityContext", {})
    c.check(csc.get("allowPrivilegeEscalation") is False, f"{kind_name}: allowPrivilegeEscalation is not false")
    c.check(spec.get("serviceAccountName") == "mainstay", f"{kind_name}: serviceAccountName is not mainstay")
    # Every ConfigMap key the container reads exists.
    for env in container.get("env", []):
        ref = env.get("valueFrom", {}).get("configMapKeyRef")
        if ref:
            keys = config_maps.get(ref["name"], {})
            c.check(ref["key"] in keys, f"{kind_name}: env {env['name']} reads missing key {ref['name']}/{ref['key']}")
    for vol in spec.get("volumes", []):
        if "configMap" in vol:
            keys = config_maps.get(vol["configMap"]["name"])
            c.check(keys is not None, f"{kind_name}: volume {vol['name']} names a missing ConfigMap")
            for item in vol["configMap"].get("items", []):
                c.check(keys is not None and item["key"] in keys, f"{kind_name}: volume {vol['name']} reads missing key {item['key']}")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=["gpu", "cpu"], required=True)
    parser.add_argument("--tls", action="store_true")
    parser.add_argument("--ha", action="store_true", help="the HA overlay: coordinators on etcd")
    parser.add_argument("--kubectl", default=None)
    parser.add_argument("dir")
    args = parser.parse_args()

    kubectl = args.kubectl or shutil.which("kubectl")
    if not kubectl:
        skip("kubectl not found (scripts/install_deps.sh installs Debian's kubernetes-client); manifests not rendered")
    try:
        import yaml  # noqa: PLC0415 (optional dependency: a skip, not an error)
    except ImportError:
        skip(f"PyYAML missing for {sys.executable} (Debian package python3-yaml)")
    minor = kubectl_minor(kubectl)
    # kubectl <= 1.20 embeds kustomize v2.0.3, which reads neither a directory in `resources:`
    # nor `patches:`; the base sticks to fields it knows.
    if (args.variant == "cpu" or args.tls or args.ha) and (minor is None or minor < 21):
        skip(f"kubectl 1.{minor} embeds kustomize v2.0.3, too old for overlays (needs kubectl >= 1.21)")

    rendered = subprocess.run([kubectl, "kustomize", args.dir], capture_output=True, text=True)
    if rendered.returncode != 0:
        print(rendered.stderr)
        print(f"FAIL: kubectl kustomize {args.dir} exited {rendered.returncode}")
        return 1
    docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    c = Checker()
    if args.ha:
        check_ha(c, docs)
        return report(c, args)
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)

    for kind, count in {"Namespace": 1, "ServiceAccount": 1, "ConfigMap": 1, "Service": 2, "StatefulSet": 1,
                        "DaemonSet": 1, "PodDisruptionBudget": 1}.items():
        c.check(len(by_kind.get(kind, [])) == count, f"expected {count} {kind}, found {len(by_kind.get(kind, []))}")
    for d in docs:
        if d["kind"] != "Namespace":
            c.check(d["metadata"].get("namespace") == "mainstay", f"{d['kind']}/{d['metadata']['name']} is not in namespace mainstay")
    config_maps = {d["metadata"]["name"]: d.get("data", {}) for d in by_kind.get("ConfigMap", [])}
    if c.failures:
        return report(c, args)

    # ---- coordinator
    sts = by_kind["StatefulSet"][0]
    c.check(sts["spec"]["replicas"] == 1, "coordinator: more than one replica (the state directory has one writer)")
    template = sts["spec"]["template"]
    container = template["spec"]["containers"][0]
    cargs = container.get("args", [])
    config_path = flag_value(cargs, "--config")
    listen = flag_value(cargs, "--listen")
    if listen is None and config_path:
        # The config comes from a ConfigMap mounted at the file's folder.
        cfg_name = config_path.rsplit("/", 1)[1]
        for cm in config_maps.values():
            if cfg_name in cm:
                listen = json.loads(cm[cfg_name]).get("listen")
    listen = listen or "0.0.0.0:7070"
    coordinator_port = port_of(listen)
    check_pod(c, "coordinator", template, container, coordinator_port, config_maps, health_port(cargs))
    check_secret_file(c, "coordinator", template, container, flag_value(cargs, "--cluster-secret-file"),
                      "--cluster-secret-file")
    if args.tls:
        check_tls(c, "coordinator", template, container)
        check_secret_file(c, "coordinator", template, container, flag_value(cargs, "--admin-token-file"), "--admin-token-file")
    state_dir = flag_value(cargs, "--state-dir")
    claims = {t["metadata"]["name"] for t in sts["spec"].get("volumeClaimTemplates", [])}
    mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts", [])}
    c.check(state_dir is not None and any(state_dir.startswith(mounts.get(n, "\0")) for n in claims),
            f"coordinator: --state-dir {state_dir} is not on a volume claim template ({claims})")
    pod_labels = template["metadata"]["labels"]
    services = by_kind["Service"]
    governing = [s for s in services if s["metadata"]["name"] == sts["spec"]["serviceName"]]
    c.check(len(governing) == 1 and governing[0]["spec"].get("clusterIP") == "None",
            "coordinator: serviceName does not name a headless Service")
    for s in services:
        c.check(selects(s["spec"]["selector"], pod_labels), f"Service {s['metadata']['name']} does not select the coordinator")
        for p in s["spec"]["ports"]:
            target = p.get("targetPort", p["port"])
            c.check(target in ("grpc", coordinator_port), f"Service {s['metadata']['name']}: targetPort {target} is not the gRPC port")
    pdb = by_kind["PodDisruptionBudget"][0]
    c.check(selects(pdb["spec"]["selector"]["matchLabels"], pod_labels), "PodDisruptionBudget does not select the coordinator")

    # ---- daemon
    ds = by_kind["DaemonSet"][0]
    template = ds["spec"]["template"]
    spec = template["spec"]
    container = spec["containers"][0]
    dargs = container.get("args", [])
    daemon_port = port_of(flag_value(dargs, "--listen") or "0.0.0.0:7071")
    check_pod(c, "mainstayd", template, container, daemon_port, config_maps, health_port(dargs), "mainstay.v1.Shard")
    check_secret_file(c, "mainstayd", template, container, flag_value(dargs, "--cluster-secret-file"),
                      "--cluster-secret-file")
    if args.tls:
        check_tls(c, "mainstayd", template, container)
    c.check(spec.get("nodeSelector"), "mainstayd: no nodeSelector")
    c.check(ds["spec"].get("updateStrategy", {}).get("type") == "OnDelete",
            "mainstayd: updateStrategy is not OnDelete (a rolling update would drop every shard's state)")
    env = {e["name"]: e for e in container.get("env", [])}
    for var in re.findall(r"\$\((\w+)\)", " ".join(dargs)):
        c.check(var in env, f"mainstayd: args use $({var}) but the container has no such env")
    c.check(flag_value(dargs, "--advertise") == "$(POD_IP)", "mainstayd: --advertise is not $(POD_IP)")
    c.check(env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP",
            "mainstayd: POD_IP does not come from status.podIP")
    coordinator_flag = flag_value(dargs, "--coordinator") or ""
    if coordinator_flag == "$(MAINSTAY_COORDINATOR)":
        ref = env["MAINSTAY_COORDINATOR"]["valueFrom"]["configMapKeyRef"]
        coordinator_flag = config_maps.get(ref["name"], {}).get(ref["key"], "")
    c.check(coordinator_flag.split(":")[0] == "mainstay-coordinator" and port_of(coordinator_flag) == 7070,
            f"mainstayd: --coordinator {coordinator_flag!r} is not the coordinator's Service")

    limits = container.get("resources", {}).get("limits", {})
    if args.variant == "gpu":
        c.check("nvidia.com/gpu" in limits, "gpu: mainstayd has no nvidia.com/gpu limit")
        c.check(spec.get("hostIPC") is True, "gpu: mainstayd lacks hostIPC (CUDA IPC with the trainers)")
    else:
        c.check("nvidia.com/gpu" not in rendered.stdout, "cpu: nvidia.com/gpu appears in the rendered manifests")
        c.check(not any(d.get("spec", {}).get("template", {}).get("spec", {}).get("hostIPC") for d in docs),
                "cpu: a pod still has hostIPC")
    return report(c, args)


def check_ha(c, docs):
    """The HA overlay: three coordinators (a Deployment, standbys forwarding to the leader) on a
    three-member etcd StatefulSet, the daemons still dialling the coordinator's Service."""
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    named = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    for d in docs:
        if d["kind"] != "Namespace":
            c.check(d["metadata"].get("namespace") == "mainstay", f"{d['kind']}/{d['metadata']['name']} is not in namespace mainstay")
    c.check(("StatefulSet", "mainstay-coordinator") not in named, "ha: the single-writer coordinator StatefulSet is still there")
    c.check(("Service", "mainstay-coordinator-headless") not in named, "ha: the StatefulSet's headless Service is still there")
    dep = named.get(("Deployment", "mainstay-coordinator"))
    etcd = named.get(("StatefulSet", "mainstay-etcd"))
    if not c.check(dep is not None and etcd is not None, "ha: no coordinator Deployment or etcd StatefulSet"):
        return
    c.check(dep["spec"]["replicas"] >= 3, "ha: fewer than three coordinators")
    template = dep["spec"]["template"]
    container = template["spec"]["containers"][0]
    cargs = container.get("args", [])
    c.check(flag_value(cargs, "--state-dir") is None, "ha: a coordinator still has --state-dir")
    endpoints = (flag_value(cargs, "--etcd-endpoints") or "").split(",")
    etcd_service = etcd["spec"]["serviceName"]
    members = ["%s-%d.%s" % (etcd["metadata"]["name"], i, etcd_service) for i in range(etcd["spec"]["replicas"])]
    c.check(sorted(e.split("//")[-1].rsplit(":", 1)[0] for e in endpoints if e) == sorted(members),
            f"ha: --etcd-endpoints {endpoints} are not the etcd members {members}")
    c.check(etcd["spec"]["replicas"] == 3, "ha: etcd has not three members")
    eargs = etcd["spec"]["template"]["spec"]["containers"][0].get("args", [])
    initial = flag_value(eargs, "--initial-cluster") or ""
    c.check(sorted(m.split("=")[0] for m in initial.split(",")) == sorted(m.split(".")[0] for m in members),
            f"ha: etcd's --initial-cluster {initial!r} does not list its {len(members)} pods")
    headless = named.get(("Service", etcd_service))
    c.check(headless is not None and headless["spec"].get("clusterIP") == "None"
            and selects(headless["spec"]["selector"], etcd["spec"]["template"]["metadata"]["labels"]),
            "ha: etcd's serviceName is not a headless Service selecting its pods")
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    ready = container.get("readinessProbe", {}).get("grpc", {})
    c.check(ready.get("port") == ports.get("grpc"), "ha: the coordinators' readiness is not a gRPC probe of their port")
    for probe in ("livenessProbe", "startupProbe"):
        c.check(container.get(probe, {}).get("grpc", {}).get("port") != ports.get("grpc"),
                f"ha: a {probe} on the gRPC port would restart every coordinator while none leads")
    # Standbys forward to the leader's advertised address: the pod IP (a pod's name does not
    # resolve without a headless Service), from the downward API.
    env = {e["name"]: e for e in container.get("env", [])}
    advertised = flag_value(cargs, "--advertise-address") or ""
    c.check(advertised == "$(POD_IP):%s" % ports.get("grpc")
            and env.get("POD_IP", {}).get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.podIP",
            f"ha: --advertise-address {advertised!r} is not $(POD_IP):<grpc port> with POD_IP from status.podIP")
    check_secret_file(c, "coordinator", template, container, flag_value(cargs, "--cluster-secret-file"),
                      "--cluster-secret-file")
    labels = template["metadata"]["labels"]
    service = named.get(("Service", "mainstay-coordinator"))
    c.check(service is not None and selects(service["spec"]["selector"], labels),
            "ha: the mainstay-coordinator Service does not select the coordinators")
    pdb = named.get(("PodDisruptionBudget", "mainstay-coordinator"))
    c.check(pdb is not None and pdb["spec"].get("maxUnavailable") == 1
            and selects(pdb["spec"]["selector"]["matchLabels"], labels),
            "ha: the coordinators' PodDisruptionBudget is not maxUnavailable 1 over them")
    ds = by_kind.get("DaemonSet", [{}])[0]
    dargs = ds.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [{}])[0].get("args", [])
    c.check(flag_value(dargs, "--coordinator") is not None, "ha: mainstayd has no --coordinator")


def health_port(args):
    value = flag_value(args, "--health-listen")
    return port_of(value) if value else None


def check_secret_file(c, kind_name, template, container, path, flag):
    """`path` (the value of `flag`) lies on a volume mounted from a Secret."""
    if not c.check(path is not None, f"{kind_name}: no {flag}"):
        return
    secrets = {v["name"] for v in template["spec"].get("volumes", []) if "secret" in v}
    mounts = [m for m in container.get("volumeMounts", []) if m["name"] in secrets]
    c.check(any(path.startswith(m["mountPath"].rstrip("/") + "/") for m in mounts),
            f"{kind_name}: {flag} {path} is not on a volume mounted from a Secret")


def check_tls(c, kind_name, template, container):
    args = container.get("args", [])
    for flag in ("--tls-cert-file", "--tls-key-file", "--tls-ca-file"):
        check_secret_file(c, kind_name, template, container, flag_value(args, flag), flag)
    c.check(flag_value(args, "--tls-client-auth") == "require", f"{kind_name}: --tls-client-auth is not require (mutual TLS)")
    c.check(bool(flag_value(args, "--tls-internal-name")),
            f"{kind_name}: no --tls-internal-name: trainers' certificates could make the servers' internal calls")
    c.check(health_port(args) is not None, f"{kind_name}: no --health-listen: the kubelet's gRPC probes cannot speak TLS")
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    c.check(ports.get("health") == health_port(args), f"{kind_name}: no container port 'health' for --health-listen")


def report(c, args):
    for f in c.failures:
        print("FAIL:", f)
    if c.failures:
        return 1
    print(f"PASS: {args.variant}{' tls' if args.tls else ''}{' ha' if args.ha else ''} ({args.dir}): {c.passed} checks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
