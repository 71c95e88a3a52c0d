"""ops/kubernetes/ checked without a cluster: a manifest that names a flag the code does not have,
a port no container opens or a probe path no process serves fails on the cluster minutes after
`kubectl apply`, so each is checked here against the code that reads it.

- Every manifest passes the OpenAPI schemas of pinned Kubernetes versions in strict mode
  (kubernetes-validate bundles them: no network): 1.34, the first with Dynamic Resource
  Allocation GA (resource.k8s.io/v1), and the newest bundled; strict mode refuses a misspelt
  field.
- Every container's command line parses with the real parser of its subcommand (`pagedkv
  daemon`, `runner`, `serve`), each flag spelt exactly as the parser has it (argparse would
  accept abbreviations); the ConfigMap's TOML loads with the daemon's own loader into a
  `DaemonConfig`.
- The three processes agree: the server's --daemon is the daemon's listener, the runner's
  --daemon the daemon's runner socket, the server's --runner the runner's --listen; the ports
  the flags and settings give are the containers' ports; probes name those ports and paths the
  process serves; Services and the NetworkPolicy name ports that exist; every container requests
  CPU and memory, nothing runs as root.
- The GPU: the daemon allocates the pool on it (device = "cuda") and the runner maps it by CUDA
  IPC, so both containers name the same DRA claim, whose template asks for exactly one GPU of
  NVIDIA's device class; no container requests nvidia.com/gpu (a device-plugin GPU goes to one
  container only); the pod shares one PID namespace (CUDA IPC refuses an importer with the
  exporter's PID, and each container's process is PID 1 in a namespace of its own).
"""

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry

from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.daemon.process.settings_sources import add_serve_arguments, config_from_args
from pagedkv.model_runner.process.cli import parser as runner_parser
from pagedkv.process.probes import metrics_app
from pagedkv.server.app import build_app
from pagedkv.server.cli import parser as serve_parser

FOLDER = Path(__file__).resolve().parents[2] / "ops" / "kubernetes"
# The Kubernetes versions whose schemas the manifests must pass: 1.34, the first with DRA GA
# (resource.k8s.io/v1; native sidecars are GA from 1.33), and the newest kubernetes-validate has.
KUBERNETES_VERSIONS = ("1.34.0", kubernetes_validate.latest_version())
# The DeviceClass NVIDIA's DRA driver for GPUs installs.
NVIDIA_GPU_CLASS = "gpu.nvidia.com"
CONFIG_PATH = "/etc/pagedkv/pagedkv.toml"
Manifest = dict[str, Any]


def manifests() -> list[Manifest]:
    """Every document of every .yaml file but the kustomization (not a Kubernetes object)."""
    docs = []
    for path in sorted(FOLDER.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def only(kind: str) -> Manifest:
    found = [doc for doc in manifests() if doc["kind"] == kind]
    assert len(found) == 1, f"one {kind} expected, got {len(found)}"
    return found[0]


def pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = only("StatefulSet")["spec"]["template"]["spec"]
    return spec


def containers() -> dict[str, dict[str, Any]]:
    """The pod's containers by name, native sidecars (restartable init containers) included."""
    spec = pod_spec()
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


def container(subcommand: str) -> dict[str, Any]:
    """The container whose command line is `pagedkv SUBCOMMAND ...`."""
    found = [c for c in containers().values() if c["args"][0] == subcommand]
    assert len(found) == 1, f"one `pagedkv {subcommand}` container expected"
    return found[0]


def ports(c: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c.get("ports", [])}


def all_ports() -> dict[str, int]:
    return {name: number for c in containers().values() for name, number in ports(c).items()}


def toml_text() -> str:
    text: str = only("ConfigMap")["data"]["pagedkv.toml"]
    return text


def port_of(address: str) -> int:
    """The port of "host:port" or "tcp://host:port"."""
    return int(address.rsplit(":", 1)[1])


def flags(args: list[str]) -> Iterator[str]:
    return (arg.split("=", 1)[0] for arg in args if arg.startswith("--"))


def parse(parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace:
    """`args` parsed; every flag must be one of the parser's option strings, spelt out."""
    known = set(parser._option_string_actions)
    unknown = [flag for flag in flags(args) if flag not in known]
    assert not unknown, f"{parser.prog}: no such flag(s) {unknown}"
    try:
        return parser.parse_args(args)
    except SystemExit as exc:  # argparse printed why on stderr
        raise AssertionError(f"{parser.prog} refuses {args}") from exc


def daemon_parser() -> argparse.ArgumentParser:
    """The flags of `pagedkv daemon` (cli/main.py adds them to its subparser with this call)."""
    parser = argparse.ArgumentParser(prog="pagedkv daemon")
    add_serve_arguments(parser)
    return parser


def daemon_config(tmp_path: Path) -> DaemonConfig:
    """The daemon container's settings: its flags over the ConfigMap's TOML, as it loads them."""
    args = container("daemon")["args"]
    assert args[args.index("--config") + 1] == CONFIG_PATH
    (tmp_path / "pagedkv.toml").write_text(toml_text())
    namespace = parse(daemon_parser(), args[1:])
    namespace.config = tmp_path / "pagedkv.toml"
    return config_from_args(namespace, env={})


def runner_args() -> argparse.Namespace:
    return parse(runner_parser(), container("runner")["args"][1:])


def serve_args() -> argparse.Namespace:
    return parse(serve_parser(), container("serve")["args"][1:])


# ------------------------------------------------------------------ schemas


def test_the_newest_bundled_schemas_are_at_least_1_34() -> None:
    assert tuple(map(int, KUBERNETES_VERSIONS[1].split(".")[:2])) >= (1, 34)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("doc", manifests(), ids=lambda doc: f"{doc['kind']}/"
                         f"{doc['metadata']['name']}")
def test_every_manifest_passes_the_strict_schemas(doc: Manifest, version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_strict_mode_refuses_a_misspelt_field(version: str) -> None:
    """The check above is not vacuous: an unknown field fails it."""
    broken = only("StatefulSet")
    broken["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_strict_mode_refuses_the_pre_v1_claim_request(version: str) -> None:
    """The claim template is checked against resource.k8s.io/v1 itself: a request in the
    v1beta1 form (deviceClassName beside name, no `exactly`) fails."""
    template = only("ResourceClaimTemplate")
    request = template["spec"]["spec"]["devices"]["requests"][0]
    request.update(request.pop("exactly"))
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(template, version, strict=True)


def test_the_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((FOLDER / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    on_disk = {p.name for p in FOLDER.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == on_disk


# ------------------------------------------------------------------ command lines and settings


def test_every_container_runs_a_pagedkv_subcommand() -> None:
    assert {c["args"][0] for c in containers().values()} == {"daemon", "runner", "serve"}
    assert all(c["command"] == ["pagedkv"] for c in containers().values())


def test_the_daemon_loads_the_configmap_with_its_own_loader(tmp_path: Path) -> None:
    config = daemon_config(tmp_path)
    assert config.device == "cuda" and config.block_size == 16
    assert config.kv_events_endpoint and config.kv_events_replay_endpoint
    assert config.kv_events_all_salts  # `pagedkv serve` opens its session without a salt


def test_the_events_endpoint_is_bound_not_connected(tmp_path: Path) -> None:
    """The daemon binds a PUB endpoint with "*" or "::" in it and connects to any other
    (daemon/events/sender.py, vLLM's rule): "tcp://0.0.0.0:5557" would connect."""
    endpoint = daemon_config(tmp_path).kv_events_endpoint
    assert endpoint is not None and ("*" in endpoint or "::" in endpoint)


def test_the_topic_names_the_pod_as_llm_d_addresses_it() -> None:
    """kv@IP:PORT@: llm-d reads the pod from the topic as its endpoint's address, the
    server's port; the kubelet expands $(POD_IP) only from the container's env."""
    daemon = container("daemon")
    topic = parse(daemon_parser(), daemon["args"][1:]).kv_events_topic
    assert topic == f"kv@$(POD_IP):{serve_args().port}@"
    pod_ip = [e for e in daemon["env"] if e["name"] == "POD_IP"]
    assert pod_ip[0]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_the_three_processes_meet_on_the_same_sockets(tmp_path: Path) -> None:
    config, runner, serve = daemon_config(tmp_path), runner_args(), serve_args()
    assert serve.daemon == config.listeners()[0].target
    assert runner.daemon == config.runner_listener().target
    assert serve.runner == runner.listen
    socket_dirs = {Path(a.removeprefix("unix://")).parent
                   for a in (serve.daemon, runner.daemon, runner.listen)}
    mounts = {name: {m["mountPath"] for m in c["volumeMounts"]}
              for name, c in containers().items()}
    assert all({str(d) for d in socket_dirs} <= paths for paths in mounts.values())


def test_the_runner_and_the_server_read_the_same_model() -> None:
    assert runner_args().model == serve_args().model


# ------------------------------------------------------------------ ports and probes


def test_flags_and_settings_listen_on_the_containers_ports(tmp_path: Path) -> None:
    config = daemon_config(tmp_path)
    assert config.metrics_listen is not None and config.kv_events_endpoint is not None
    assert config.kv_events_replay_endpoint is not None
    assert ports(container("daemon")) == {
        "metrics": port_of(config.metrics_listen),
        "kv-events": port_of(config.kv_events_endpoint),
        "kv-replay": port_of(config.kv_events_replay_endpoint)}
    assert ports(container("runner")) == {"runner-metrics": port_of(runner_args().metrics_listen)}
    assert ports(container("serve")) == {"http": serve_args().port}
    # Probes reach the pod IP: every HTTP listener must take more than loopback.
    assert config.metrics_listen.startswith("0.0.0.0:")
    assert runner_args().metrics_listen.startswith("0.0.0.0:") and serve_args().host == "0.0.0.0"


def served_paths(subcommand: str) -> set[str]:
    """The GET paths the process serves: the probes app of the daemon and the runner, the
    server's app."""
    if subcommand == "serve":
        app = build_app(object())  # type: ignore[arg-type]  # routes only, never served
    else:
        app = metrics_app(CollectorRegistry(), lambda: None)
    return {resource.canonical for resource in app.router.resources()}


@pytest.mark.parametrize("subcommand", ["daemon", "runner", "serve"])
def test_probes_name_an_open_port_and_a_served_path(subcommand: str) -> None:
    c = container(subcommand)
    own_ports = ports(c)
    for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = c[kind]
        handler = probe.get("httpGet") or probe["tcpSocket"]
        port = handler["port"]
        assert port in own_ports or port in own_ports.values(), f"{kind} port {port}"
        if "httpGet" in probe:
            assert handler["path"] in served_paths(subcommand), f"{kind} {handler['path']}"


def test_services_and_the_network_policy_name_container_ports() -> None:
    names = all_ports()
    labels = only("StatefulSet")["spec"]["template"]["metadata"]["labels"]
    services = [doc for doc in manifests() if doc["kind"] == "Service"]
    for service in services:
        assert service["spec"]["selector"].items() <= labels.items()
        for port in service["spec"]["ports"]:
            assert names[port["targetPort"]] == port["port"], service["metadata"]["name"]
    policy = only("NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} == set(names)


def test_the_headless_service_governs_the_statefulset() -> None:
    """Per-pod DNS names (pagedkv-0.pagedkv-pods...) for routers that subscribe to each pod."""
    name = only("StatefulSet")["spec"]["serviceName"]
    headless = [s for s in manifests() if s["kind"] == "Service" and s["metadata"]["name"] == name]
    assert headless and headless[0]["spec"]["clusterIP"] == "None"
    exposed = {port["name"] for port in headless[0]["spec"]["ports"]}
    assert {"kv-events", "kv-replay", "metrics"} <= exposed


# ------------------------------------------------------------------ resources and security


def test_every_container_requests_cpu_and_memory_and_none_nvidia_com_gpu() -> None:
    """A device-plugin GPU goes to one container only: the daemon could not allocate its pool
    on the runner's GPU. The GPU comes from the DRA claim (the tests below)."""
    for name, c in containers().items():
        resources = c["resources"]
        assert {"cpu", "memory"} <= set(resources["requests"]), name
        for kind in ("requests", "limits"):
            assert "nvidia.com/gpu" not in resources.get(kind, {}), name


def test_the_daemon_and_the_runner_name_the_same_gpu_claim(tmp_path: Path) -> None:
    """The daemon allocates the pool on the GPU and the runner maps it by CUDA IPC: the one
    claim of the pod, from the one template, in both containers; the server names none."""
    assert daemon_config(tmp_path).device == "cuda"
    pod_claims = pod_spec()["resourceClaims"]
    assert len(pod_claims) == 1
    claim = pod_claims[0]
    assert claim["resourceClaimTemplateName"] == only("ResourceClaimTemplate")["metadata"]["name"]
    assert "resourceClaimName" not in claim  # one claim per pod, not one for every pod
    named = {name: [ref["name"] for ref in c["resources"].get("claims", [])]
             for name, c in containers().items()}
    assert named[container("daemon")["name"]] == [claim["name"]]
    assert named[container("runner")["name"]] == [claim["name"]]
    assert named[container("serve")["name"]] == []


def test_the_claim_template_requests_exactly_one_nvidia_gpu() -> None:
    requests = only("ResourceClaimTemplate")["spec"]["spec"]["devices"]["requests"]
    assert len(requests) == 1
    exactly = requests[0]["exactly"]
    assert exactly["deviceClassName"] == NVIDIA_GPU_CLASS
    # ExactCount and 1 are the API's defaults; the template spells them out.
    assert exactly["allocationMode"] == "ExactCount" and exactly["count"] == 1
    assert not exactly.get("selectors") and not exactly.get("adminAccess")


def test_the_containers_share_one_pid_namespace() -> None:
    """CUDA IPC refuses a handle whose exporter has the importer's PID; apart, the daemon and
    the runner would both be PID 1 of their containers."""
    assert pod_spec()["shareProcessNamespace"] is True


def test_the_pool_and_the_sockets_are_shared_emptydirs() -> None:
    volumes = {v["name"]: v for v in pod_spec()["volumes"]}
    mounts = {name: {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
              for name, c in containers().items()}
    shm = {paths["/dev/shm"] for name, paths in mounts.items() if name != "server"}
    assert len(shm) == 1 and volumes[shm.pop()]["emptyDir"]["medium"] == "Memory"
    assert "sizeLimit" in volumes["shm"]["emptyDir"]
    assert len({paths["/run/pagedkv"] for paths in mounts.values()}) == 1


def test_nothing_runs_as_root() -> None:
    pod = pod_spec()["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0
    for name, c in containers().items():
        context = c["securityContext"]
        assert context["allowPrivilegeEscalation"] is False, name
        assert context["capabilities"]["drop"] == ["ALL"], name
