"""Every manifest the operator builds validates against a current Kubernetes schema, and carries
the contract (owner refs, OTel env, probes, GPU sharing)."""

from __future__ import annotations

import base64

import kubernetes_validate
import pytest
from operator_helpers import K8S_VERSION

from verifypd_operator.builders import build_all
from verifypd_operator.config_secrets import ADMIN_KEY_FILE, LANE_SECRET_FILE, read_admin_secret, read_lane_secret
from verifypd_operator.pod_parts import PROMETHEUS_ANNOTATIONS, otel_env
from verifypd_operator.spec import CALL_PORT, COLOCATED_LANE_CALL_PORTS, COLOCATED_LANE_PORTS, parse_spec

VARIANTS = {
    "colocated": {},
    "colocated-dra": {"colocated": {"gpuSharing": "dra", "gpu": 1}},
    "split": {
        "topology": "split",
        "lanes": {
            "verify": {
                "replicas": 2,
                "maxReplicas": 4,
                "gpu": 1,
                "resources": {"requests": {"cpu": "2", "memory": "8Gi"}},
            }
        },
    },
    "split-pvc": {
        "topology": "split",
        "model": {"target": "/models/llama", "draft": "/models/tiny", "pvcName": "models"},
    },
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_manifests_validate(variant, owner):
    objs = build_all(parse_spec(VARIANTS[variant]), owner, "default", {}, "http://otlp:4317", lane_secret="s" * 64)
    assert {"Secret", "NetworkPolicy"} <= {o["kind"] for o in objs}
    for o in objs:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        refs = o["metadata"]["ownerReferences"]
        assert refs == [
            {
                "apiVersion": "verifypd.dev/v1alpha1",
                "kind": "VerifyPDConfig",
                "name": "demo",
                "uid": "0000-1111",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
        assert o["metadata"]["name"].startswith("demo")


def test_validator_rejects_a_broken_manifest(owner):
    dep = build_all(parse_spec({}), owner, "default", {}, "x")[0]
    dep["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSION, strict=True)


def _deps(objs):
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}


def test_colocated_pod_shares_one_gpu_and_namespaces(owner):
    objs = build_all(parse_spec({}), owner, "ns1", {"colocated": 3}, "http://otlp:4317")
    dep = _deps(objs)["demo-colocated"]
    assert dep["spec"]["replicas"] == 3
    pod = dep["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    names = [c["name"] for c in pod["containers"]]
    assert names == ["gateway", "prefill", "draft", "verify"]
    gpu = {c["name"]: c["resources"].get("limits", {}).get("nvidia.com/gpu") for c in pod["containers"]}
    assert gpu == {"gateway": None, "prefill": None, "draft": None, "verify": 1}  # one allocation
    for c in pod["containers"]:
        ready = c["readinessProbe"]
        if c["name"] == "gateway":
            assert ready["httpGet"] == {"path": "/health", "port": "http"}
        else:
            assert ready["grpc"]["port"] == c["ports"][0]["containerPort"]
        assert c["livenessProbe"]["grpc"]["port"] == c["ports"][0]["containerPort"]
        if c["name"] in ("prefill", "draft"):
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
            assert "CUDA_VISIBLE_DEVICES" in c["command"][2]
    gw = pod["containers"][0]["args"]
    assert gw[:7] == ["serve", "--port", "50051", "--http-port", "8000", "--topology", "colocated"]
    assert "localhost:50063" in gw
    assert {s["metadata"]["name"] for s in objs if s["kind"] == "Service"} == {"demo", "demo-gateway-pods"}


def test_dra_claim_shared_by_every_lane(owner):
    objs = build_all(parse_spec(VARIANTS["colocated-dra"]), owner, "ns1", {}, "x")
    pod = _deps(objs)["demo-colocated"]["spec"]["template"]["spec"]
    assert pod["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "demo-gpu"}]
    lanes = [c for c in pod["containers"] if c["name"] != "gateway"]
    assert all(c["resources"]["claims"] == [{"name": "gpu"}] for c in lanes)
    assert any(o["kind"] == "ResourceClaimTemplate" for o in objs)


def test_split_topology_wires_gateway_to_lane_services(owner):
    objs = build_all(parse_spec(VARIANTS["split"]), owner, "ns1", {"verify": 3}, "x")
    deps = _deps(objs)
    assert set(deps) == {"demo-gateway", "demo-prefill", "demo-draft", "demo-verify"}
    assert deps["demo-verify"]["spec"]["replicas"] == 3
    args = deps["demo-gateway"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--verify-addr") + 1] == "demo-verify.ns1.svc:50051"
    lane = deps["demo-draft"]["spec"]["template"]["spec"]["containers"][0]
    assert lane["args"][:2] == ["lane", "draft"] and lane["resources"]["limits"]["nvidia.com/gpu"] == 1
    svcs = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    assert svcs["demo-verify"]["spec"]["clusterIP"] == "None"
    assert "clusterIP" not in svcs["demo"]["spec"]


def test_otel_env_contract():
    env = otel_env("demo", "ns1", "http://op:4317", "svc")
    assert env[0]["name"] == "POD_NAME"  # must precede its $(POD_NAME) use
    vals = {e["name"]: e.get("value") for e in env}
    assert vals["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://op:4317"
    assert (
        vals["OTEL_RESOURCE_ATTRIBUTES"] == "verifypd.config.name=demo,k8s.namespace.name=ns1,k8s.pod.name=$(POD_NAME)"
    )


def test_every_container_listens_on_the_pod_ip(owner):
    """Servers default to 127.0.0.1; Services and kubelet gRPC probes need the pod IP."""
    for topology in ("colocated", "split"):
        for manifest in build_all(parse_spec({"topology": topology}), owner, "default", {}, "http://otlp:4317"):
            if manifest["kind"] != "Deployment":
                continue
            for c in manifest["spec"]["template"]["spec"]["containers"]:
                assert {"name": "VERIFYPD_HOST", "value": "0.0.0.0"} in c["env"], (topology, c["name"])


def _containers(objs):
    return [
        (d["metadata"]["name"], c) for d in _deps(objs).values() for c in d["spec"]["template"]["spec"]["containers"]
    ]


@pytest.mark.parametrize("topology", ["colocated", "split"])
def test_gateway_serves_http_on_its_service_with_health_readiness(owner, topology):
    objs = build_all(parse_spec({"topology": topology}), owner, "ns1", {}, "x")
    gateways = [c for _, c in _containers(objs) if c["name"] == "gateway"]
    assert len(gateways) == 1
    gw = gateways[0]
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in gw["ports"]
    assert gw["args"][gw["args"].index("--http-port") + 1] == "8000"
    assert gw["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    for _, c in _containers(objs):  # lanes serve no HTTP: gRPC (probed) and the call channel
        if c["name"] != "gateway":
            assert [p["name"] for p in c["ports"]] == ["grpc", "calls"] and "grpc" in c["readinessProbe"]
    svcs = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    for name in ("demo", "demo-gateway-pods"):
        ports = {p["name"]: p for p in svcs[name]["spec"]["ports"]}
        assert ports["http"]["port"] == 8000 and ports["http"]["targetPort"] == "http"
        assert ports["grpc"]["port"] == 50051


@pytest.mark.parametrize("topology", ["colocated", "split"])
def test_prometheus_annotations_only_when_turned_on(owner, topology):
    def annotations(spec):
        deps = _deps(build_all(parse_spec({"topology": topology, **spec}), owner, "ns1", {}, "x"))
        return {n: d["spec"]["template"]["metadata"].get("annotations") for n, d in deps.items()}

    assert all(a is None for a in annotations({}).values())
    assert all(a is None for a in annotations({"metrics": {"prometheusScrape": False}}).values())
    on = annotations({"metrics": {"prometheusScrape": True}})
    gw = "demo-colocated" if topology == "colocated" else "demo-gateway"
    assert (
        on.pop(gw)
        == {"prometheus.io/scrape": "true", "prometheus.io/port": "8000", "prometheus.io/path": "/metrics"}
        == PROMETHEUS_ANNOTATIONS
    )
    assert all(a is None for a in on.values())  # lanes have no /metrics endpoint


@pytest.mark.parametrize("topology", ["colocated", "split"])
def test_lane_secret_is_owned_and_mounted_into_every_lane_and_gateway(owner, topology):
    token = "0123456789abcdef" * 4
    objs = build_all(parse_spec({"topology": topology}), owner, "ns1", {}, "x", lane_secret=token)
    secrets = [o for o in objs if o["kind"] == "Secret"]
    assert len(secrets) == 1 and secrets[0]["metadata"]["name"] == "demo-lane-secret"
    assert secrets[0]["metadata"]["ownerReferences"][0]["uid"] == "0000-1111"
    assert base64.b64decode(secrets[0]["data"]["lane-secret"]).decode() == token
    assert read_lane_secret(secrets[0]) == token  # what the next reconcile reads back and keeps
    for dep in _deps(objs).values():
        pod = dep["spec"]["template"]["spec"]
        assert {"name": "lane-secret", "secret": {"secretName": "demo-lane-secret"}} in pod["volumes"]
        for c in pod["containers"]:
            mounts = {m["name"]: m for m in c["volumeMounts"]}
            assert mounts["lane-secret"]["mountPath"] + "/lane-secret" == LANE_SECRET_FILE
            args = c["args"]
            flag = "--lane-secret-file" if c["name"] == "gateway" else "--secret-file"
            assert args[args.index(flag) + 1] == LANE_SECRET_FILE, (dep["metadata"]["name"], c["name"])
            assert "--allow-unauthenticated" not in args


@pytest.mark.parametrize("topology", ["colocated", "split"])
def test_admin_key_is_owned_and_mounted_into_the_gateway_only(owner, topology):
    key = "fedcba9876543210" * 4
    objs = build_all(parse_spec({"topology": topology}), owner, "ns1", {}, "x", lane_secret="s" * 64, admin_key=key)
    [secret] = [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == "demo-admin-key"]
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "0000-1111"
    assert read_admin_secret(secret) == key and read_lane_secret(secret) is None
    gateways = 0
    for dep in _deps(objs).values():
        pod = dep["spec"]["template"]["spec"]
        for c in pod["containers"]:
            mounts = {m["name"]: m for m in c["volumeMounts"]}
            if c["name"] == "gateway":
                gateways += 1
                assert mounts["admin-key"]["mountPath"] + "/admin-key" == ADMIN_KEY_FILE
                assert {"name": "admin-key", "secret": {"secretName": "demo-admin-key"}} in pod["volumes"]
                assert c["args"][c["args"].index("--admin-key-file") + 1] == ADMIN_KEY_FILE
            else:  # lanes never hold the admin key
                assert "admin-key" not in mounts and "--admin-key-file" not in c["args"]
    assert gateways == 1


def test_read_lane_secret_absent_or_empty():
    assert read_lane_secret(None) is None
    assert read_lane_secret({"data": {}}) is None
    assert read_lane_secret({"data": {"lane-secret": ""}}) is None


def test_split_network_policy_admits_only_gateway_and_lanes_on_the_lane_ports(owner):
    objs = build_all(parse_spec({"topology": "split"}), owner, "ns1", {}, "x")
    [np] = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert np["metadata"]["ownerReferences"][0]["uid"] == "0000-1111"
    spec = np["spec"]
    assert spec["policyTypes"] == ["Ingress"]

    def selects(sel, labels):
        if any(labels.get(k) != v for k, v in sel.get("matchLabels", {}).items()):
            return False
        return all(labels.get(e["key"]) in e["values"] for e in sel.get("matchExpressions", []))

    pod_labels = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in _deps(objs).values()}
    other = {**pod_labels["demo-gateway"], "verifypd.dev/config": "other", "app.kubernetes.io/instance": "other"}
    assert {n for n, lab in pod_labels.items() if selects(spec["podSelector"], lab)} == {
        "demo-prefill",
        "demo-draft",
        "demo-verify",
    }
    [rule] = spec["ingress"]
    # gRPC and the call channel (the gateway's fast path), from the same peers
    assert rule["ports"] == [{"protocol": "TCP", "port": 50051}, {"protocol": "TCP", "port": 50052}]
    [peer] = rule["from"]
    assert set(peer) == {"podSelector"}  # same namespace only
    admitted = {n for n, lab in pod_labels.items() if selects(peer["podSelector"], lab)}
    assert admitted == {"demo-gateway", "demo-prefill", "demo-draft", "demo-verify"}  # lanes push KV (copy)
    assert not selects(peer["podSelector"], other)  # another config's gateway is refused


def test_colocated_network_policy_opens_only_the_gateway_ports(owner):
    objs = build_all(parse_spec({}), owner, "ns1", {}, "x")
    [np] = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert np["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "colocated"
    [rule] = np["spec"]["ingress"]
    assert sorted(p["port"] for p in rule["ports"]) == [8000, 50051]  # lane ports 5006x stay pod-local


@pytest.mark.parametrize("topology", ["colocated", "split"])
def test_every_container_command_parses_with_the_real_cli(owner, topology):
    """The flags the builders emit (--http-port, --secret-file, --lane-secret-file, ...) are the
    ones `verifypd serve` / `verifypd lane` accept."""
    from verifypd.cli import build_parser

    parser = build_parser()
    for _, c in _containers(build_all(parse_spec({"topology": topology}), owner, "ns1", {}, "x")):
        argv = c["args"][1:] if c["args"][0] == "verifypd" else c["args"]  # colocated lanes: sh -c ... "$@"
        args = parser.parse_args(argv)
        if args.command == "serve":
            assert (args.http_port, args.lane_secret_file, args.admin_key_file) == (
                8000,
                LANE_SECRET_FILE,
                ADMIN_KEY_FILE,
            )
        else:
            assert args.secret_file == LANE_SECRET_FILE and not args.allow_unauthenticated
            assert args.call_port == (CALL_PORT if topology == "split" else COLOCATED_LANE_CALL_PORTS[args.lane])


@pytest.mark.parametrize("topology", ["colocated", "split"])
@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_model_quantization_reaches_every_model_container(owner, topology, quantization):
    """spec.model.quantization becomes `--quantization` on every container that loads models, as
    the real CLI parses it; "none" (the default) passes no flag."""
    from verifypd.cli import build_parser

    parser = build_parser()
    spec = parse_spec({"topology": topology, "model": {"quantization": quantization}})
    loading = 0
    for _, c in _containers(build_all(spec, owner, "ns1", {}, "x")):
        argv = c["args"][1:] if c["args"][0] == "verifypd" else c["args"]
        args = parser.parse_args(argv)
        if hasattr(args, "target"):
            loading += 1
            assert args.quantization == (None if quantization == "none" else quantization)
    assert loading > 0


@pytest.mark.parametrize("topology", ["colocated", "split"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_model_kv_cache_dtype_reaches_every_model_container(owner, topology, kv_cache_dtype):
    """spec.model.kvCacheDtype becomes `--kv-cache-dtype` on every container that loads models (the
    split topology's three lanes, which must agree on the pool they share), as the real CLI parses it."""
    from verifypd.cli import build_parser

    parser = build_parser()
    spec = parse_spec({"topology": topology, "model": {"kvCacheDtype": kv_cache_dtype}})
    loading = 0
    for _, c in _containers(build_all(spec, owner, "ns1", {}, "x")):
        argv = c["args"][1:] if c["args"][0] == "verifypd" else c["args"]
        args = parser.parse_args(argv)
        if hasattr(args, "target"):
            loading += 1
            assert args.kv_cache_dtype == kv_cache_dtype
    assert loading >= (3 if topology == "split" else 1)


def _flag(args, flag):
    return args[args.index(flag) + 1]


def test_split_lanes_serve_the_call_channel_on_a_fixed_port_behind_their_service(owner):
    """The gateway dials <lane host>:<call_port from Describe>: in a pod the port must be fixed,
    declared, on the lane's headless Service and open in the NetworkPolicy."""
    objs = build_all(parse_spec({"topology": "split"}), owner, "ns1", {}, "x")
    deps = _deps(objs)
    svcs = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    [np] = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert {"protocol": "TCP", "port": CALL_PORT} in np["spec"]["ingress"][0]["ports"]
    for lane in ("prefill", "draft", "verify"):
        [c] = deps[f"demo-{lane}"]["spec"]["template"]["spec"]["containers"]
        assert _flag(c["args"], "--call-port") == str(CALL_PORT) == "50052"
        assert _flag(c["args"], "--port") == "50051"
        assert c["ports"] == [
            {"name": "grpc", "containerPort": 50051, "protocol": "TCP"},
            {"name": "calls", "containerPort": 50052, "protocol": "TCP"},
        ]
        ports = {p["name"]: p for p in svcs[f"demo-{lane}"]["spec"]["ports"]}
        assert ports["calls"] == {
            "name": "calls",
            "port": 50052,
            "targetPort": "calls",
            "protocol": "TCP",
            "appProtocol": "tcp",
        }
        assert ports["grpc"]["port"] == 50051
    [gw] = deps["demo-gateway"]["spec"]["template"]["spec"]["containers"]
    assert "--call-port" not in gw["args"] and "calls" not in {p["name"] for p in gw["ports"]}
    for name in ("demo", "demo-gateway-pods"):  # gateway Services carry no call channel
        assert "calls" not in {p["name"] for p in svcs[name]["spec"]["ports"]}


@pytest.mark.parametrize("variant", ["colocated", "colocated-dra"])
def test_colocated_lanes_serve_the_call_channel_on_distinct_localhost_ports(owner, variant):
    objs = build_all(parse_spec(VARIANTS[variant]), owner, "ns1", {}, "x")
    pod = _deps(objs)["demo-colocated"]["spec"]["template"]["spec"]
    seen = {}
    for c in pod["containers"]:
        if c["name"] == "gateway":
            assert "--call-port" not in c["args"]
            continue
        seen[c["name"]] = int(_flag(c["args"], "--call-port"))
        assert int(_flag(c["args"], "--port")) == COLOCATED_LANE_PORTS[c["name"]]
        assert {"name": "calls", "containerPort": seen[c["name"]], "protocol": "TCP"} in c["ports"]
        assert c["ports"][0]["name"] == "grpc"  # the probes' port stays first
    assert seen == COLOCATED_LANE_CALL_PORTS == {"prefill": 50071, "draft": 50072, "verify": 50073}
    # every port in the pod distinct (the containers share one network namespace)
    all_ports = [p["containerPort"] for c in pod["containers"] for p in c["ports"]]
    assert len(all_ports) == len(set(all_ports))
    # pod-local: no lane Service, and the NetworkPolicy opens only the gateway ports
    assert {o["metadata"]["name"] for o in objs if o["kind"] == "Service"} == {"demo", "demo-gateway-pods"}
    [np] = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert sorted(p["port"] for p in np["spec"]["ingress"][0]["ports"]) == [8000, 50051]


def test_colocated_pod_with_lane_devices_puts_each_lane_on_its_gpu(owner):
    """colocated.laneDevices: the pod holds 2 GPUs; prefill runs on cuda:0, verify and draft on cuda:1, and
    every container numbers the GPUs alike (the verify container exports the allocation's list too)."""
    spec = parse_spec({"colocated": {"gpu": 2, "laneDevices": {"prefill": 0, "verify": 1, "draft": 1}}})
    objs = build_all(spec, owner, "ns1", {}, "x")
    pod = _deps(objs)["demo-colocated"]["spec"]["template"]["spec"]
    lanes = {c["name"]: c for c in pod["containers"] if c["name"] != "gateway"}
    devices = {name: c["args"][c["args"].index("--device") + 1] for name, c in lanes.items()}
    assert devices == {"prefill": "cuda:0", "draft": "cuda:1", "verify": "cuda:1"}
    assert lanes["verify"]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert 'CUDA_VISIBLE_DEVICES="$NVIDIA_VISIBLE_DEVICES"' in lanes["verify"]["command"][2]
    for o in objs:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)
    plain = _deps(build_all(parse_spec({}), owner, "ns1", {}, "x"))["demo-colocated"]["spec"]["template"]["spec"]
    assert all("--device" not in c["args"] for c in plain["containers"])
