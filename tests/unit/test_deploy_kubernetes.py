"""deploy/kubernetes and deploy/Containerfile: every overlay renders, every object is valid
against the Kubernetes schema (strict), and what the manifests say matches the programs.

Rendering uses ``kustomize build`` or ``kubectl kustomize`` where one is installed, else
``kustomize_lite`` (beside this file); where both can run, they must agree. Beyond the
schema: probes point at routes the FastAPI apps really serve (without a token), the config
files in the ConfigMap parse with ``ControlConfig`` / ``EdgeConfig`` through the programs'
own command lines (the edge's shell command is run with a stand-in ``python``), the edge
mounts what its runtime touches, the registry's config runs in the real ``docker-registry``,
and the Containerfile takes its Debian packages from scripts/setup.sh.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import kubernetes_validate
import kustomize_lite
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = ["base", "overlays/external-postgres", "overlays/postgres-statefulset"]
K8S_VERSION = "1.37.0"
"""The newest schema kubernetes-validate ships (pinned in pyproject.toml)."""
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
SECRETS = {"dsec-cluster", "dsec-database", "dsec-registry-credentials", "dsec-postgres"}
"""Every Secret the manifests read; the operator makes them (docs/DEPLOY.md says how)."""

Obj = dict[str, Any]


# ------------------------------------------------------------------ rendering ----


def real_kustomize() -> list[str] | None:
    """The command line of a real kustomize (``kustomize build`` or ``kubectl kustomize``)."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    kubectl = shutil.which("kubectl")
    if kubectl and subprocess.run([kubectl, "kustomize", "--help"], capture_output=True, timeout=60).returncode == 0:
        return [kubectl, "kustomize"]
    return None


REAL = real_kustomize()


def render_real(overlay: str) -> list[Obj]:
    assert REAL is not None
    out = subprocess.run([*REAL, str(KUBE / overlay)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render(overlay: str) -> list[Obj]:
    return render_real(overlay) if REAL else kustomize_lite.build(KUBE / overlay)


_cache: dict[str, list[Obj]] = {}


def rendered(overlay: str) -> list[Obj]:
    if overlay not in _cache:
        _cache[overlay] = render(overlay)
    return _cache[overlay]


def find(objs: list[Obj], kind: str, name: str) -> Obj:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"{kind}/{name}: {len(hits)} found"
    return hits[0]


def container(workload: Obj, name: str) -> Obj:
    spec = workload["spec"]["template"]["spec"]
    return next(c for c in [*spec.get("initContainers", []), *spec["containers"]] if c["name"] == name)


def env_of(c: Obj) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def port_of(c: Obj, name: str) -> int:
    return next(int(p["containerPort"]) for p in c["ports"] if p["name"] == name)


def mounts_of(workload: Obj, c: Obj) -> dict[str, tuple[Obj, Obj]]:
    """mountPath -> (volumeMount, volume)."""
    vols = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    for claim in workload["spec"].get("volumeClaimTemplates", []):
        vols[claim["metadata"]["name"]] = {"name": claim["metadata"]["name"], "volumeClaimTemplate": claim}
    return {m["mountPath"]: (m, vols[m["name"]]) for m in c.get("volumeMounts", [])}


def config_file(objs: list[Obj], name: str) -> str:
    return str(find(objs, "ConfigMap", "dsec-config")["data"][name])


@pytest.fixture(params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_every_object_of_every_overlay_is_valid_kubernetes_strict(overlay: str) -> None:
    objs = rendered(overlay)
    assert objs
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{overlay}: {obj['kind']}/{obj['metadata']['name']}: {exc.message} "
                                 f"at {'.'.join(map(str, exc.path))}") from None
    kustomize_lite.by_key(objs)  # no two objects of one kind and name


def test_strict_validation_refuses_a_misspelt_field() -> None:
    """The check above would catch a typo: the schema is strict."""
    deploy = json.loads(json.dumps(find(rendered("base"), "Deployment", "dsec-control")))
    deploy["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deploy, K8S_VERSION, strict=True)


@pytest.mark.skipif(REAL is None, reason="neither kustomize nor kubectl is installed (kustomize_lite renders alone)")
def test_kustomize_lite_renders_what_kustomize_renders(overlay: str) -> None:
    real = kustomize_lite.by_key(render_real(overlay))
    lite = kustomize_lite.by_key(kustomize_lite.build(KUBE / overlay))
    assert sorted(real) == sorted(lite)
    for key, obj in real.items():
        assert lite[key] == obj, key


def test_kustomize_lite_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("resources: []\npatches:\n  - path: p.yaml\n")
    with pytest.raises(kustomize_lite.Unsupported, match="patches"):
        kustomize_lite.build(tmp_path)
    (tmp_path / "kustomization.yaml").write_text("configMapGenerator:\n  - name: x\n    files: [a]\n")
    with pytest.raises(kustomize_lite.Unsupported, match="disableNameSuffixHash"):
        kustomize_lite.build(tmp_path)
    assert kustomize_lite.split_image("host:5000/a/b:1.2") == ("host:5000/a/b", ":1.2")
    assert kustomize_lite.split_image("host:5000/a/b") == ("host:5000/a/b", "")
    assert kustomize_lite.split_image("a@sha256:00") == ("a", "@sha256:00")


def test_overlays_put_everything_in_one_namespace_with_the_released_image() -> None:
    for overlay in OVERLAYS[1:]:
        objs = rendered(overlay)
        namespaced = [o for o in objs if o["kind"] not in kustomize_lite.CLUSTER_SCOPED]
        assert {o["metadata"].get("namespace") for o in namespaced} == {"dsec"}
        assert find(objs, "Namespace", "dsec")
        for o in objs:
            assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "dsec", o["metadata"]["name"]
            for c in kustomize_lite._containers(o):
                if "postgres" not in c["image"]:
                    assert c["image"] == f"registry.example.com/dsec:{VERSION}"
    for o in rendered("base"):
        for c in kustomize_lite._containers(o):
            assert c["image"] == f"dsec:{VERSION}"


def test_only_documented_secrets_are_read_and_docs_say_how_to_make_them(overlay: str) -> None:
    used: set[str] = set()

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if "secretKeyRef" in node:
                used.add(node["secretKeyRef"]["name"])
            if "secretName" in node:
                used.add(node["secretName"])
            if "secret" in node and isinstance(node["secret"], dict) and "name" in node["secret"]:
                used.add(node["secret"]["name"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(rendered(overlay))
    assert used <= SECRETS
    assert not [o for o in rendered(overlay) if o["kind"] == "Secret"], "no secret is committed"
    deploy_doc = (ROOT / "docs" / "DEPLOY.md").read_text()
    for name in used:
        assert f"create secret generic {name}" in deploy_doc, name


def test_no_pod_talks_to_the_kubernetes_api(overlay: str) -> None:
    """No component needs the API: no RBAC, and no service-account token in any pod."""
    objs = rendered(overlay)
    assert not [o for o in objs if o["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")]
    for o in objs:
        if o["kind"] in kustomize_lite.TEMPLATED:
            spec = o["spec"]["template"]["spec"]
            assert spec["automountServiceAccountToken"] is False
            assert find(objs, "ServiceAccount", spec["serviceAccountName"])["automountServiceAccountToken"] is False


# -------------------------------------------------------------- control plane ----


def serves_get(app: Any, path: str) -> bool:
    """The app has a route for ``GET path`` (routers included lazily count too)."""
    from starlette.routing import Match

    scope = {"type": "http", "method": "GET", "path": path, "root_path": "", "headers": [], "query_string": b""}
    return any(r.matches(scope)[0] == Match.FULL for r in app.router.routes)


def test_control_deployment_is_replicated_with_probes_on_real_routes(tmp_path: Path) -> None:
    from dsec.control.app import create_app
    from dsec.control.config import ControlConfig

    objs = rendered("overlays/external-postgres")
    deploy = find(objs, "Deployment", "dsec-control")
    assert deploy["spec"]["replicas"] >= 2
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    c = container(deploy, "control")
    app = create_app(ControlConfig(data_dir=tmp_path))
    assert not serves_get(app, "/no/such/path")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = c[probe]["httpGet"]
        assert serves_get(app, get["path"]), (probe, get["path"])
        assert port_of(c, get["port"]) == 7070
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"  # the one that reads the store
    assert c["livenessProbe"]["httpGet"]["path"] == "/docs"  # a database outage restarts nobody
    pdb = find(objs, "PodDisruptionBudget", "dsec-control")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    assert 1 <= pdb["spec"]["minAvailable"] < deploy["spec"]["replicas"]
    svc = find(objs, "Service", "dsec-control")
    assert svc["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    ann = deploy["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true" and int(ann["prometheus.io/port"]) == port_of(c, "http")
    assert serves_get(app, ann["prometheus.io/path"])
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert deploy["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def _secret_files(workload: Obj, c: Obj, tmp_path: Path, values: dict[str, str]) -> dict[str, str]:
    """The container's environment with each secret file it names written under tmp_path
    (mounted paths mapped there), from ``values`` keyed by the file's name."""
    env = {}
    for name, value in env_of(c).items():
        assert isinstance(value, str), name
        if name.endswith("_FILE"):
            mount = next(p for p in mounts_of(workload, c) if value.startswith(p + "/"))
            local = tmp_path / value.removeprefix("/")
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(values[Path(value).name] + "\n")
            assert Path(value).name in _volume_files(mounts_of(workload, c)[mount][1]), value
            value = str(local)
        env[name] = value
    return env


def _volume_files(volume: Obj) -> set[str]:
    if "projected" in volume:
        return {i["path"] for s in volume["projected"]["sources"] for i in s["secret"]["items"]}
    return {i["path"] for i in volume["secret"]["items"]}


def test_control_config_parses_through_its_command_line_with_the_mounted_secrets(tmp_path: Path,
                                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec.control.__main__ import parse_args

    objs = rendered("overlays/external-postgres")
    deploy = find(objs, "Deployment", "dsec-control")
    c = container(deploy, "control")
    assert c["command"] == ["python", "-m", "dsec.control"]
    key, token = "ab" * 32, "dsk_" + "x" * 43
    env = _secret_files(deploy, c, tmp_path, {"database-url": "postgresql://dsec:pw@db:5432/dsec",
                                              "cluster-key": key, "admin-token": token})
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DSEC_DATABASE_URL", raising=False)
    monkeypatch.delenv("DSEC_BOOTSTRAP_TOKEN", raising=False)
    monkeypatch.delenv("DSEC_CLUSTER_KEY", raising=False)
    conf = tmp_path / "control.json"
    conf.write_text(config_file(objs, "control.json"))
    args = [conf.as_posix() if a == "/etc/dsec/control.json" else a for a in c["args"]]
    assert "/etc/dsec/control.json" in mounts_of(deploy, c)
    cfg = parse_args(args)
    assert cfg.database_url == "postgresql://dsec:pw@db:5432/dsec"
    assert cfg.bootstrap_token is not None and cfg.bootstrap_token.get_secret_value() == token
    assert cfg.resolve_cluster_key() == bytes.fromhex(key)
    assert cfg.host == "0.0.0.0" and cfg.port == port_of(c, "http")
    assert cfg.watcher is True  # every replica may hold the lease
    assert str(cfg.data_dir) in mounts_of(deploy, c)  # writable (the root filesystem is not)
    # a flag still wins over the environment, and a missing file is one line
    assert parse_args([*args, "--database-url", "sqlite:///x.db"]).database_url == "sqlite:///x.db"
    monkeypatch.setenv("DSEC_DATABASE_URL_FILE", str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match="DSEC_DATABASE_URL_FILE"):
        parse_args(args)


def test_control_plane_runs_from_the_manifest_and_answers_its_probes(tmp_path: Path) -> None:
    """The Deployment's command, config and secret files start a real control plane (SQLite
    standing in for PostgreSQL, on loopback): its probes answer 200 and the admin token from
    the Secret works."""
    objs = rendered("overlays/external-postgres")
    deploy = find(objs, "Deployment", "dsec-control")
    c = container(deploy, "control")
    token = "dsk_" + "k" * 43
    env = _secret_files(deploy, c, tmp_path, {"database-url": f"sqlite:///{tmp_path}/control.db",
                                              "cluster-key": "cd" * 32, "admin-token": token})
    conf = tmp_path / "control.json"
    conf.write_text(config_file(objs, "control.json"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable if a == "python" else a for a in c["command"]]
    args = [conf.as_posix() if a == "/etc/dsec/control.json" else a for a in c["args"]]
    # loopback and a free port instead of 0.0.0.0:7070; the data dir a temporary one
    args += ["--host", "127.0.0.1", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")} | env
    log = open(tmp_path / "control.log", "w")  # noqa: SIM115
    proc = subprocess.Popen([*cmd, *args], env=full_env, stdout=log, stderr=log, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + c["startupProbe"]["httpGet"]["path"], timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, (tmp_path / "control.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "control.log").read_text()
            time.sleep(0.1)
        for probe in ("livenessProbe", "readinessProbe"):
            assert httpx.get(url + c[probe]["httpGet"]["path"], timeout=5).status_code == 200, probe
        assert httpx.get(url + "/healthz", timeout=5).json()["store"] == "sqlite"
        ann = deploy["spec"]["template"]["metadata"]["annotations"]
        scraped = httpx.get(f"http://127.0.0.1:{port}{ann['prometheus.io/path']}", timeout=5)
        assert scraped.status_code == 200 and "dsec_control_creates_total" in scraped.text  # no token
        who = httpx.get(url + "/v1/whoami", headers={"authorization": f"Bearer {token}"}, timeout=5)
        assert who.status_code == 200 and who.json()["project"] == "root"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ----------------------------------------------------------------------- edge ----


def _run_edge_command(ds: Obj, c: Obj, tmp_path: Path, node: str, ip: str) -> list[str]:
    """Run the edge container's shell command with a stand-in ``python`` that records its
    arguments; the downward-API variables filled as the kubelet would."""
    fake = tmp_path / "bin"
    fake.mkdir(exist_ok=True)
    out = tmp_path / f"args-{node}"
    (fake / "python").write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {out}\n")
    (fake / "python").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin"}
    for name, value in env_of(c).items():
        if isinstance(value, dict):
            field = value["fieldRef"]["fieldPath"]
            env[name] = {"spec.nodeName": node, "status.hostIP": ip}[field]
        else:
            env[name] = value
    assert c["command"][:2] == ["/bin/sh", "-c"]
    subprocess.run(c["command"], env=env, check=True, timeout=30)
    return out.read_text().splitlines()


def test_edge_command_line_gives_a_valid_config_with_a_stable_edge_id(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec.edge import __main__ as edge_main
    from dsec.edge.config import EDGE_ID_RE

    objs = rendered("overlays/external-postgres")
    ds = find(objs, "DaemonSet", "dsec-edge")
    c = container(ds, "edge")
    node = "ip-10-0-13-207.eu-west-1.compute.internal"
    argv = _run_edge_command(ds, c, tmp_path, node, "10.0.13.207")
    assert argv[:2] == ["-m", "dsec.edge"]
    again = _run_edge_command(ds, c, tmp_path, node, "10.0.13.207")
    other = _run_edge_command(ds, c, tmp_path, "node-2", "10.0.13.208")
    parsed = edge_main._parser().parse_args(argv[2:])
    assert parsed.edge_id == edge_main._parser().parse_args(again[2:]).edge_id  # stable across restarts
    assert parsed.edge_id != edge_main._parser().parse_args(other[2:]).edge_id
    assert EDGE_ID_RE.match(parsed.edge_id)
    conf = tmp_path / "edge.json"
    conf.write_text(config_file(objs, "edge.json"))
    assert parsed.config == Path("/etc/dsec/edge.json") and "/etc/dsec/edge.json" in mounts_of(ds, c)
    parsed.config = conf
    key_file = tmp_path / "cluster-key"
    key_file.write_text("ef" * 32 + "\n")
    assert env_of(c)["DSEC_CLUSTER_KEY_FILE"] == "/etc/dsec/secrets/cluster-key"
    monkeypatch.delenv("DSEC_CLUSTER_KEY", raising=False)
    monkeypatch.setenv("DSEC_CLUSTER_KEY_FILE", str(key_file))
    cfg = edge_main.load_config(parsed)
    assert cfg.cluster_key == bytes.fromhex("ef" * 32)
    assert cfg.host == "10.0.13.207" and cfg.base_url == "http://10.0.13.207:7071"
    assert cfg.port == port_of(c, "http")
    ann = ds["spec"]["template"]["metadata"]["annotations"]
    assert int(ann["prometheus.io/port"]) == cfg.port
    assert cfg.destroy_on_shutdown is False  # sandboxes outlive an edge restart
    # the control plane as the edges reach it: the Service, by its short name (any namespace)
    svc = find(objs, "Service", "dsec-control")
    assert cfg.control_plane_url == f"http://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}"
    assert ds["spec"]["template"]["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"  # resolvable on hostNetwork
    assert cfg.container is not None and cfg.network is not None
    # heartbeats come well within the time after which the control plane stops placing there
    from dsec.control.__main__ import parse_args

    ctl_json = tmp_path / "control.json"
    ctl_json.write_text(config_file(objs, "control.json"))
    ctl = parse_args(["--config", str(ctl_json), "--data-dir", str(tmp_path / "ctl")])
    assert cfg.heartbeat_interval_s * 2 <= ctl.dead_after_s
    # layers the node lacks come from the in-cluster registry, by the Service's short name
    reg = find(objs, "Service", "dsec-registry")
    assert cfg.registry is not None
    assert cfg.registry.url == f"http://{reg['metadata']['name']}:{reg['spec']['ports'][0]['port']}"


def test_edge_daemonset_is_privileged_on_the_host_and_mounts_what_the_runtime_touches() -> None:
    from dsec.backends.common import claims
    from dsec.backends.container import cgroups
    from dsec.edge.config import EdgeConfig

    objs = rendered("overlays/external-postgres")
    ds = find(objs, "DaemonSet", "dsec-edge")
    pod = ds["spec"]["template"]["spec"]
    c = container(ds, "edge")
    assert c["securityContext"]["privileged"] is True
    assert pod["hostPID"] is True and pod["hostNetwork"] is True
    assert ds["spec"]["updateStrategy"]["type"] == "OnDelete"
    assert pod["priorityClassName"] == find(objs, "PriorityClass", "dsec-node")["metadata"]["name"]
    mounts = mounts_of(ds, c)

    def host(path: str) -> Obj:
        m, vol = mounts[path]
        assert vol["hostPath"]["path"] == path, path  # the host's own path, at the same place
        return m

    cfg = EdgeConfig.model_validate({**json.loads(config_file(objs, "edge.json")), "edge_id": "n1",
                                     "cluster_key": "00" * 16})
    host(str(cgroups.CGROUP_ROOT))  # /sys/fs/cgroup/<controller>/dsec/<runtime>: the host's root
    host("/dev")  # loop devices, /dev/zramN made at run time, /dev/fuse
    assert host(str(cfg.run_dir))["mountPropagation"] == "Bidirectional"  # layer mounts outlive a restart
    host(str(cfg.state_dir))
    assert mounts["/lib/modules"][0]["readOnly"] is True
    # the host-wide claims directory (names, network tags, subnets) sits on the /run/dsec mount
    assert claims.DEFAULT_CLAIMS_DIR.is_relative_to(cfg.run_dir)
    assert cfg.state_dir == Path("/var/lib/dsec") and cfg.run_dir == Path("/run/dsec")
    assert env_of(c)["DSEC_STATE_DIR"] == str(cfg.state_dir)  # `dsec image` in the pod sees its store
    # the pull-layers init container writes the same store
    init = container(ds, "pull-layers")
    assert env_of(init)["DSEC_STATE_DIR"] == str(cfg.state_dir)
    assert mounts_of(ds, init)[str(cfg.state_dir)][1]["hostPath"]["path"] == str(cfg.state_dir)
    assert "privileged" not in init["securityContext"]
    # only the cluster key reaches the edge: not the admin token, not the database
    assert _volume_files(mounts["/etc/dsec/secrets"][1]) == {"cluster-key"}


def test_edge_probes_and_scrape_path_are_open_routes_of_the_edge_app(tmp_path: Path) -> None:
    from dsec.edge.app import create_app
    from dsec.edge.config import EdgeConfig

    ds = find(rendered("base"), "DaemonSet", "dsec-edge")
    c = container(ds, "edge")
    app = create_app(EdgeConfig(edge_id="n1", cluster_key="00" * 16, state_dir=tmp_path / "s", run_dir=tmp_path / "r"))
    paths = {c[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    paths.add(ds["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"])

    async def get_all() -> dict[str, httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://edge") as http:
            return {p: await http.get(p) for p in [*paths, "/v1/health"]}

    answers = asyncio.run(get_all())
    for p in paths:
        assert answers[p].status_code == 200, p  # no token: a kubelet or Prometheus has none
    assert "dsec_edge_healthy" in answers["/metrics"].text
    assert answers["/v1/health"].status_code == 401  # why the probes do not use it


def test_pull_layers_init_skips_comments_and_survives_an_unreachable_registry(tmp_path: Path) -> None:
    objs = rendered("base")
    init = container(find(objs, "DaemonSet", "dsec-edge"), "pull-layers")
    images = tmp_path / "images.txt"
    images.write_text(config_file(objs, "images.txt")
                      + "http://dsec-registry:5000/dsec/busybox:latest\n\n  # indented comment\n"
                      + "http://dsec-registry:5000/dsec/broken:1 trailing words ignored\n")
    fake = tmp_path / "bin"
    fake.mkdir()
    log = tmp_path / "calls"
    (fake / "dsec").write_text(f"#!/bin/sh\necho \"$*\" >> {log}\ncase \"$*\" in *broken*) exit 1;; esac\n")
    (fake / "dsec").chmod(0o755)
    script = init["command"][2].replace("/etc/dsec/images.txt", str(images))
    assert "/etc/dsec/images.txt" in mounts_of(find(objs, "DaemonSet", "dsec-edge"), init)
    out = subprocess.run(["/bin/sh", "-c", script], env={"PATH": f"{fake}:/usr/bin:/bin"}, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0
    assert log.read_text().splitlines() == ["image pull -q http://dsec-registry:5000/dsec/busybox:latest",
                                            "image pull -q http://dsec-registry:5000/dsec/broken:1"]
    assert "broken:1 not pulled" in out.stderr


# ------------------------------------------------------------------- registry ----


def test_registry_config_matches_its_deployment_service_and_volume() -> None:
    objs = rendered("overlays/external-postgres")
    deploy = find(objs, "Deployment", "dsec-registry")
    c = container(deploy, "registry")
    conf = yaml.safe_load(config_file(objs, "registry.yml"))
    assert int(conf["http"]["addr"].rsplit(":", 1)[1]) == port_of(c, "http")
    assert int(conf["http"]["debug"]["addr"].rsplit(":", 1)[1]) == port_of(c, "debug")
    ann = deploy["spec"]["template"]["metadata"]["annotations"]
    assert int(ann["prometheus.io/port"]) == port_of(c, "debug")
    assert ann["prometheus.io/path"] == conf["http"]["debug"]["prometheus"]["path"]
    assert conf["http"]["debug"]["prometheus"]["enabled"] is True
    mounts = mounts_of(deploy, c)
    _, vol = mounts[conf["storage"]["filesystem"]["rootdirectory"]]
    assert vol["persistentVolumeClaim"]["claimName"] == find(objs, "PersistentVolumeClaim", "dsec-registry")["metadata"]["name"]
    assert c["command"][2] in mounts and c["command"][:2] == ["docker-registry", "serve"]
    assert deploy["spec"]["strategy"]["type"] == "Recreate"  # one writer on a ReadWriteOnce volume
    svc = find(objs, "Service", "dsec-registry")
    assert svc["spec"]["ports"][0]["targetPort"] == "http"
    # the edges pull from it by the Service's short name (images.txt says so)
    assert f"http://{svc['metadata']['name']}:{svc['spec']['ports'][0]['port']}" in config_file(objs, "images.txt")


@pytest.mark.skipif(shutil.which("docker-registry") is None, reason="docker-registry is not installed")
def test_registry_config_runs_in_the_real_docker_registry_and_answers_probes_and_scrapes(tmp_path: Path) -> None:
    objs = rendered("base")
    deploy = find(objs, "Deployment", "dsec-registry")
    c = container(deploy, "registry")
    conf = tmp_path / "config.yml"
    conf.write_text(config_file(objs, "registry.yml"))
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    # distribution's own environment overrides: loopback ports and a temporary root
    env = {"PATH": os.environ["PATH"], "REGISTRY_HTTP_ADDR": f"127.0.0.1:{ports[0]}",
           "REGISTRY_HTTP_DEBUG_ADDR": f"127.0.0.1:{ports[1]}",
           "REGISTRY_STORAGE_FILESYSTEM_ROOTDIRECTORY": str(tmp_path / "data")}
    proc = subprocess.Popen([c["command"][0], "serve", str(conf)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        by_port = {"http": ports[0], "debug": ports[1]}

        def get(port: int, path: str) -> tuple[int, str]:
            deadline = time.monotonic() + 20
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                        return r.status, r.read().decode()
                except OSError:
                    assert proc.poll() is None, "docker-registry exited"
                    assert time.monotonic() < deadline
                    time.sleep(0.05)

        probe = c["readinessProbe"]["httpGet"]
        assert get(by_port[probe["port"]], probe["path"])[0] == 200
        assert get(by_port["http"], "/v2/")[0] == 200
        ann = deploy["spec"]["template"]["metadata"]["annotations"]
        status, text = get(by_port["debug"], ann["prometheus.io/path"])
        assert status == 200 and "# TYPE" in text
        assert c["livenessProbe"]["tcpSocket"]["port"] == "http"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ------------------------------------------------------------------- postgres ----


def test_postgres_overlay_runs_a_statefulset_behind_the_dsn_host() -> None:
    objs = rendered("overlays/postgres-statefulset")
    sts = find(objs, "StatefulSet", "dsec-postgres")
    svc = find(objs, "Service", "dsec-postgres")
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"] and svc["spec"]["clusterIP"] == "None"
    c = container(sts, "postgres")
    env = env_of(c)
    assert env["POSTGRES_PASSWORD"]["secretKeyRef"] == {"name": "dsec-postgres", "key": "password"}
    assert port_of(c, "postgres") == svc["spec"]["ports"][0]["port"] == 5432
    assert "volumeClaimTemplate" in mounts_of(sts, c)["/var/lib/postgresql/data"][1]
    # the DSN the overlay (and docs/DEPLOY.md) tell the operator to store
    dsn = f"postgresql://{env['POSTGRES_USER']}:$PW@{svc['metadata']['name']}:5432/{env['POSTGRES_DB']}"
    assert dsn in (KUBE / "overlays/postgres-statefulset/kustomization.yaml").read_text()
    assert dsn in (ROOT / "docs" / "DEPLOY.md").read_text()
    assert not [o for o in rendered("overlays/external-postgres") if "postgres" in o["metadata"]["name"]]


# ---------------------------------------------------------------- Containerfile ----


def _image_packages(*names: str) -> list[str]:
    """Arrays of deploy/image.sh as its bash reads them (the packages step's own extraction of
    setup.sh's APT_PACKAGES included)."""
    fns = "; ".join(f"printf '%s\\n' \"${{{n}[@]}}\" | paste -sd' '" for n in names)
    script = (ROOT / "deploy" / "image.sh").read_text().split("\ncase ", 1)[0]
    extract = re.search(r"^  (eval .*scripts/setup\.sh\)\")$", script, re.M)
    assert extract is not None
    out = subprocess.run(["bash", "-c", f"{script}\n{extract.group(1)}\n{fns}", "deploy/image.sh"], cwd=ROOT,
                         capture_output=True, text=True, check=True)  # $0 as when bash runs the file
    return out.stdout.splitlines()


def test_containerfile_builds_from_debian_12_with_setup_sh_packages() -> None:
    text = (ROOT / "deploy" / "Containerfile").read_text()
    assert re.search(r"^FROM docker\.io/library/debian:12$", text, re.M)
    assert "RUN bash deploy/image.sh packages" in text and "RUN bash deploy/image.sh python" in text
    assert "ENV PATH=/opt/dsec/.venv/bin:$PATH" in text  # `python` and `dsec` in the manifests are the venv's
    apt, test_only, image_only = (line.split() for line in
                                  _image_packages("APT_PACKAGES", "TEST_ONLY_PACKAGES", "IMAGE_PACKAGES"))
    # the extraction reads setup.sh's whole list (compared with a plain parse of the file)
    array = re.search(r"^APT_PACKAGES=\((.*?)\)", (ROOT / "scripts/setup.sh").read_text(), re.S | re.M)
    assert array is not None
    assert apt == [w for line in array.group(1).splitlines() for w in line.split("#", 1)[0].split()]
    assert set(test_only) <= set(apt), "an exclusion that setup.sh no longer lists"
    kept = set(apt) - set(test_only)
    # what the pods run and the runtime calls
    assert {"docker-registry", "python3-venv", "erofs-utils", "btrfs-progs", "util-linux", "nftables", "iproute2",
            "fuse3", "libfuse3-dev", "gcc", "libseccomp-dev", "musl-tools", "busybox-static"} <= kept
    assert "kmod" in image_only
    script = (ROOT / "deploy" / "image.sh").read_text()
    assert "pip install -q -e '.[server]'" in script
    assert "python -m dsec.backends.container.build" in script and "python -m dsec.backends.gvisor.build" in script
    assert "--uid 10001" in script
    for overlay in OVERLAYS:
        for o in rendered(overlay):
            sc = o.get("spec", {}).get("template", {}).get("spec", {}).get("securityContext", {})
            if "runAsUser" in sc and "postgres" not in o["metadata"]["name"]:
                assert sc["runAsUser"] == 10001
