"""`paved render` and paved.control_plane.kube_platform: every object validates against the
official Kubernetes OpenAPI schemas (kubernetes_validate, strict: an unknown field is an error)
for the oldest and the newest version the package ships; the control plane's RBAC is exactly
the rules its driver needs, namespaced; images are digests; Secrets are referenced, never
rendered; bad flags exit 2 naming the flag; YAML and JSON outputs parse to the same objects.

Kubernetes 1.20 (policy/v1beta1 PodDisruptionBudgets) is older than any schema
kubernetes_validate ships: here its rendering is checked to differ from the validated one only
in that apiVersion; the API-server tier dry-runs it against a real 1.20 apiserver.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils

from paved.cli.main import main
from paved.cli.render import command_line_id
from paved.control_plane import kube_platform as kp
from paved.control_plane.kube_objects import KubeSettings, replica_objects
from paved.testing.http_stub import LoopbackHTTPServer, reply

DIGEST = "sha256:" + "0123456789abcdef" * 4
IMAGES = {
    "control_plane_image": f"registry.example:5000/paved/control_plane@{DIGEST}",
    "gateway_image": f"registry.example:5000/paved/gateway@{DIGEST}",
    "launcher_image": f"registry.example:5000/paved/launcher@{DIGEST}",
}
FLAGS = [
    "--namespace", "paved",
    "--control-plane-image", IMAGES["control_plane_image"],
    "--gateway-image", IMAGES["gateway_image"],
    "--launcher-image", IMAGES["launcher_image"],
]  # fmt: skip
VERSIONS = kv_utils.all_versions()
OLDEST, NEWEST = VERSIONS[0], VERSIONS[-1]
LABEL_KEYS = {
    "app.kubernetes.io/name",
    "app.kubernetes.io/part-of",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/component",
}


def settings(**overrides: Any) -> kp.PlatformSettings:
    return kp.PlatformSettings(namespace="paved", **{**IMAGES, **overrides})


def replicas(s: kp.PlatformSettings, *, gpus: int = 1, kserve: bool = False) -> list[dict[str, Any]]:
    return replica_objects(
        deployment_id="dep_0123",
        model_id="tiny",
        version="v1",
        region=s.region,
        package_uri="s3://models/tiny.tar",
        kind="kserve" if kserve else "generate",
        kserve=kserve,
        gpus=gpus,
        placement={
            "node_selector": {"gpu.example/type": "h100"},
            "tolerations": [
                {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}
            ],
        },
        settings=s.replica_settings(),
        pdb_api=s.pdb_api,
    )


# Renderings that between them use every branch of the builders.
VARIANTS = {
    "defaults": settings(),
    "apart": settings(
        replica_namespace="paved-models",
        create_namespace=True,
        model_cache="pvc:paved-models",
        gateway_service_type="LoadBalancer",
        control_plane_replicas=3,
        gateway_replicas=5,
        region="eu-1",
    ),
    "host-cache-cpu": settings(model_cache="host:/var/cache/paved", gpu_resource=""),
}


def _validate(obj: dict[str, Any], version: str) -> None:
    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except kubernetes_validate.ValidationError as e:
        where = "/".join(map(str, e.path))
        pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} at {where}: {e.message} (Kubernetes {version})")


def _all(s: kp.PlatformSettings, *, kserve: bool = False) -> list[dict[str, Any]]:
    return kp.platform_objects(s) + replicas(s, kserve=kserve)


@pytest.mark.parametrize("version", [OLDEST, NEWEST])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_object_validates_strictly(variant: str, version: str) -> None:
    objects = _all(VARIANTS[variant], kserve=variant == "apart")
    kinds = {o["kind"] for o in objects}
    assert {"ServiceAccount", "Role", "RoleBinding", "Deployment", "Service", "PodDisruptionBudget"} <= kinds
    for obj in objects:
        _validate(obj, version)


def test_the_schemas_catch_a_bad_object() -> None:
    """The validation above can fail: a field the schema lacks, or a wrong type, is refused."""
    deployment = next(o for o in kp.platform_objects(settings()) if o["kind"] == "Deployment")
    unknown = json.loads(json.dumps(deployment))
    unknown["spec"]["template"]["spec"]["containers"][0]["imagePolicy"] = "Always"
    wrong_type = json.loads(json.dumps(deployment))
    wrong_type["spec"]["replicas"] = "two"
    for bad in (unknown, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, NEWEST, strict=True)


def test_kubernetes_1_20_uses_policy_v1beta1_and_differs_only_there() -> None:
    old = settings(kubernetes=(1, 20))
    new = settings(kubernetes=(1, 21))
    old_objects, new_objects = _all(old), _all(new)
    pdbs = [o for o in old_objects if o["kind"] == "PodDisruptionBudget"]
    assert len(pdbs) == 3  # control plane, gateway, one deployment's replicas
    assert {o["apiVersion"] for o in pdbs} == {"policy/v1beta1"}
    assert {o["apiVersion"] for o in new_objects if o["kind"] == "PodDisruptionBudget"} == {"policy/v1"}
    for a, b in zip(old_objects, new_objects, strict=True):
        if a["kind"] == "PodDisruptionBudget":
            a = {**a, "apiVersion": "policy/v1"}
        assert a == b
    # policy/v1beta1's spec has exactly policy/v1's fields as of 1.20; the ones v1 added
    # later (unhealthyPodEvictionPolicy) must not appear.
    for pdb in pdbs:
        assert set(pdb["spec"]) <= {"maxUnavailable", "minAvailable", "selector"}
    # No schema of policy/v1beta1 ships with kubernetes_validate (it knows 1.25+ only).
    with pytest.raises(kv_utils.SchemaNotFoundError):
        kubernetes_validate.validate(pdbs[0], OLDEST, strict=True)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1.20", (1, 20)), ("v1.29.3", (1, 29)), ("1.37", (1, 37)), ("2.0", (2, 0))],
)
def test_kubernetes_version(text: str, expected: tuple[int, int]) -> None:
    assert kp.kubernetes_version(text) == expected
    assert kp.pdb_api_version(expected) == ("policy/v1beta1" if expected < (1, 21) else "policy/v1")


@pytest.mark.parametrize("text", ["1.19", "1", "latest", "1.20.x", "", "1.2O"])
def test_kubernetes_version_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"Kubernetes|version"):
        kp.kubernetes_version(text)


# --- RBAC --------------------------------------------------------------------------------------

EXPECTED_RULES = [
    {
        "apiGroups": ["apps"],
        "resources": ["deployments"],
        "verbs": ["get", "list", "watch", "create", "patch", "update", "delete"],
    },
    {"apiGroups": ["apps"], "resources": ["deployments/scale"], "verbs": ["get", "update", "patch"]},
    {
        "apiGroups": [""],
        "resources": ["services"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch", "delete"]},
    {
        "apiGroups": ["policy"],
        "resources": ["poddisruptionbudgets"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    },
    {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]},
]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rbac_is_least_and_namespaced(variant: str) -> None:
    s = VARIANTS[variant]
    objects = kp.platform_objects(s)
    kinds = [o["kind"] for o in objects]
    assert "ClusterRole" not in kinds and "ClusterRoleBinding" not in kinds
    roles = [o for o in objects if o["kind"] == "Role"]
    bindings = [o for o in objects if o["kind"] == "RoleBinding"]
    assert len(roles) == 1 and len(bindings) == 1
    role, binding = roles[0], bindings[0]
    assert role["rules"] == EXPECTED_RULES
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}  # no nonResourceURLs
        for values in rule.values():
            assert "*" not in values and all("*" not in v for v in values)
        # No verb that reads or writes Secrets, no escalation verbs.
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
        assert "secrets" not in rule["resources"]
    # The Role and its binding sit where the replicas run; the subject is the control plane's
    # account, in the platform's namespace.
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == s.replicas_namespace
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": kp.CONTROL_PLANE, "namespace": s.namespace}
    ]
    accounts = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ServiceAccount"}
    assert set(accounts) == {kp.CONTROL_PLANE, kp.GATEWAY}
    assert all(a["automountServiceAccountToken"] is False for a in accounts.values())


def _pod_specs(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects if o["kind"] == "Deployment"
    }


def test_only_the_control_plane_gets_an_api_token() -> None:
    specs = _pod_specs(_all(settings()))
    assert len(specs) == 3
    for name, spec in specs.items():
        assert spec["automountServiceAccountToken"] is (name == kp.CONTROL_PLANE), name
    assert specs[kp.CONTROL_PLANE]["serviceAccountName"] == kp.CONTROL_PLANE
    assert specs[kp.GATEWAY]["serviceAccountName"] == kp.GATEWAY


def test_platform_pods_run_non_root_on_a_read_only_root() -> None:
    specs = _pod_specs(kp.platform_objects(settings()))
    for spec in specs.values():
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        (container,) = spec["containers"]
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"] == {"drop": ["ALL"]}
        # What the mains write goes to the pod's own emptyDirs.
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in spec["volumes"]}
        for path in (kp.STATE_DIR, kp.TMP_DIR):
            assert "emptyDir" in volumes[mounts[path]]
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"]["path"] in ("/health/live", "/health/ready")
        assert "resources" in container and container["resources"]["requests"]


# --- images, labels, secrets -------------------------------------------------------------------

_PINNED = re.compile(r".+@sha256:[0-9a-f]{64}")


def _containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for spec in _pod_specs(objects).values() for c in spec["containers"]]


def test_every_image_is_a_digest() -> None:
    objects = _all(settings())
    images = {c["image"] for c in _containers(objects)}
    assert images == set(IMAGES.values())
    assert all(_PINNED.fullmatch(i) for i in images)
    control_plane = _pod_specs(objects)[kp.CONTROL_PLANE]["containers"][0]
    assert f"--kube-image={IMAGES['launcher_image']}" in control_plane["args"]


@pytest.mark.parametrize(
    "image",
    [
        "paved/gateway",
        "paved/gateway:v1",
        "paved/gateway:latest",
        f"paved/gateway:v1@{DIGEST}",  # a tag next to the digest
        "paved/gateway@sha256:" + "0" * 63,
        "paved/gateway@sha256:" + "A" * 64,
        "paved/gateway@sha512:" + "0" * 128,
        f"Paved/Gateway@{DIGEST}",
        f"@{DIGEST}",
        f"paved//gateway@{DIGEST}",
        "",
    ],
)
def test_image_ref_refuses_anything_but_a_digest(image: str) -> None:
    with pytest.raises(ValueError, match="image"):
        kp.image_ref(image)
    with pytest.raises(ValueError, match="gateway_image"):
        settings(gateway_image=image).validate()


@pytest.mark.parametrize(
    "image",
    [
        f"paved/gateway@{DIGEST}",
        f"registry.example:5000/a/b_c/d-e.f@{DIGEST}",
        f"localhost/x@{DIGEST}",
        f"ghcr.io/o/r@{DIGEST}",
    ],
)
def test_image_ref_accepts_digests(image: str) -> None:
    assert kp.image_ref(image) == image


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_everything_is_labelled(variant: str) -> None:
    for obj in _all(VARIANTS[variant]):
        found = obj["metadata"]["labels"]
        assert set(found) >= LABEL_KEYS, obj["metadata"]["name"]
        assert found["app.kubernetes.io/part-of"] == "paved"
        assert found["app.kubernetes.io/managed-by"] == "paved"
        if obj["kind"] == "Deployment":
            pod = obj["spec"]["template"]["metadata"]["labels"]
            assert set(pod) >= LABEL_KEYS
            assert obj["spec"]["selector"]["matchLabels"].items() <= pod.items()


def test_secrets_are_referenced_never_rendered() -> None:
    s = settings(
        control_plane_state=kp.SecretRef("cp-db", "dsn"),
        control_plane_admin_key=kp.SecretRef("cp-admin", "key"),
        gateway_state=kp.SecretRef("gw-db", "dsn"),
        gateway_redis=kp.SecretRef("cache", "redis-url"),
        gateway_admin_key=kp.SecretRef("gw-admin", "key"),
    )
    objects = kp.platform_objects(s)
    assert "Secret" not in {o["kind"] for o in objects}
    specs = _pod_specs(objects)

    def refs(name: str) -> set[tuple[str, str, str]]:
        (container,) = specs[name]["containers"]
        env = {
            (e["name"], e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
            for e in container["env"]
            if "valueFrom" in e
        }
        volumes = {
            ("file", v["secret"]["secretName"], item["key"])
            for v in specs[name]["volumes"]
            if "secret" in v
            for item in v["secret"]["items"]
        }
        return env | volumes

    # The gateways' admin key too: the dashboard lists batches through their admin API.
    assert refs(kp.CONTROL_PLANE) == {
        ("PAVED_STATE_URL", "cp-db", "dsn"),
        ("file", "cp-admin", "key"),
        ("file", "gw-admin", "key"),
    }
    assert refs(kp.GATEWAY) == {
        ("PAVED_STATE_URL", "gw-db", "dsn"),
        ("PAVED_REDIS_URL", "cache", "redis-url"),
        ("PAVED_ROUTES_TOKEN", "cp-admin", "key"),
        ("file", "gw-admin", "key"),
    }


def test_the_mains_accept_their_arguments() -> None:
    """The rendered command lines parse with the mains' own parsers (a renamed flag fails here)."""
    from paved.gateway.server import _parser as gateway_parser

    s = settings()
    args = gateway_parser().parse_args(kp.gateway_args(s))
    assert args.routes == f"http://{kp.CONTROL_PLANE}.paved.svc:{kp.CONTROL_PLANE_PORT}"
    assert args.state == "$(PAVED_STATE_URL)" and args.redis == "$(PAVED_REDIS_URL)"
    assert args.port == kp.GATEWAY_PORT

    from paved.control_plane.server import _parser as control_plane_parser

    for variant in VARIANTS.values():
        args = control_plane_parser().parse_args(kp.control_plane_args(variant))
        assert args.port == kp.CONTROL_PLANE_PORT and args.state == "$(PAVED_STATE_URL)"
        assert args.driver == "kubernetes" and args.kube_region == [(variant.region, "in-cluster")]
        # The batch listing goes to the gateways' Service with their key, mounted from its Secret.
        assert args.gateway_admin == [f"http://{kp.GATEWAY}.{variant.namespace}.svc:{kp.GATEWAY_PORT}"]
        (mount,) = [
            m
            for m in _pod_specs(kp.platform_objects(variant))[kp.CONTROL_PLANE]["containers"][0][
                "volumeMounts"
            ]
            if args.gateway_admin_key_file.startswith(m["mountPath"] + "/")
        ]
        assert mount["name"] == "gateway-admin-key" and mount["readOnly"]
        # The driver's settings, as the main builds them from these flags, are the ones
        # `paved render` prints the replicas' objects with.
        built = KubeSettings(
            namespace=args.kube_namespace,
            image=args.kube_image,
            model_cache=args.kube_model_cache,
            drain_timeout_s=args.drain_timeout,
            gpu_resource=args.kube_gpu_resource,
            cpu=args.kube_cpu,
            memory=args.kube_memory,
            s3_endpoint_url=args.s3_endpoint_url,
        )
        assert built == variant.replica_settings()


def test_objects_share_no_sub_objects() -> None:
    objects = kp.platform_objects(settings())
    seen: dict[int, str] = {}

    def walk(value: Any, where: str) -> None:
        if isinstance(value, dict | list):
            assert id(value) not in seen, f"{where} is also {seen.get(id(value))}"
            seen[id(value)] = where
            for k, v in value.items() if isinstance(value, dict) else enumerate(value):
                walk(v, f"{where}/{k}")

    for i, obj in enumerate(objects):
        walk(obj, f"{i}:{obj['kind']}")


# --- the command -------------------------------------------------------------------------------


def _render(capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[int, str, str]:
    code = main(["render", *FLAGS, *extra])
    out, err = capsys.readouterr()
    return code, out, err


def test_yaml_and_json_outputs_parse_to_the_same_objects(capsys: pytest.CaptureFixture[str]) -> None:
    extra = ("--deployment", "tiny@v1=s3://models/tiny.tar", "--gpus", "2", "--kubernetes-version", "1.20")
    code, out_yaml, err = _render(capsys, *extra)
    assert code == 0, err
    assert out_yaml.startswith("---\n")
    assert "&id" not in out_yaml  # no YAML anchors/aliases
    documents = list(yaml.safe_load_all(out_yaml))
    code, out_json, err = _render(capsys, *extra, "--output", "json")
    assert code == 0, err
    listing = json.loads(out_json)
    assert listing["apiVersion"] == "v1" and listing["kind"] == "List"
    assert documents == listing["items"]
    expected = kp.platform_objects(settings(kubernetes=(1, 20)))
    assert documents[: len(expected)] == expected
    replica = documents[len(expected) :]
    assert [o["kind"] for o in replica] == ["Deployment", "Service", "PodDisruptionBudget"]
    assert replica[0]["metadata"]["annotations"]["paved.dev/deployment-id"] == command_line_id("tiny", "v1")
    (container,) = replica[0]["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert replica[2]["apiVersion"] == "policy/v1beta1"
    for obj in documents:
        if obj["kind"] != "PodDisruptionBudget":
            _validate(obj, OLDEST)


def test_flags_reach_the_objects(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _render(
        capsys,
        "--replica-namespace", "models", "--create-namespace", "--region", "eu-1",
        "--control-plane-replicas", "3", "--gateway-replicas", "7", "--gateway-service-type", "LoadBalancer",
        "--redis-secret", "my-redis:uri", "--model-cache", "pvc:cache", "--output", "json",
        "--replica-cpu", "500m", "--replica-memory", "24Gi", "--drain-timeout", "90",
        "--deployment", "tiny@v1=s3://models/tiny.tar",
    )  # fmt: skip
    assert code == 0, err
    objects = json.loads(out)["items"]
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"] == ["paved", "models"]
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    assert deployments[kp.CONTROL_PLANE]["spec"]["replicas"] == 3
    assert deployments[kp.GATEWAY]["spec"]["replicas"] == 7
    args = deployments[kp.CONTROL_PLANE]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--kube-namespace=models" in args and "--kube-region=eu-1=in-cluster" in args
    assert "--kube-model-cache=pvc:cache" in args
    assert {"--kube-cpu=500m", "--kube-memory=24Gi", "--drain-timeout=90.0"} <= set(args)
    replica = next(d for name, d in deployments.items() if name not in (kp.CONTROL_PLANE, kp.GATEWAY))
    assert replica["metadata"]["namespace"] == "models"
    pod = replica["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["requests"]["memory"] == "24Gi"
    assert pod["terminationGracePeriodSeconds"] > 90
    env = deployments[kp.GATEWAY]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {
        "name": "PAVED_REDIS_URL",
        "valueFrom": {"secretKeyRef": {"name": "my-redis", "key": "uri"}},
    } in env
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    assert services[kp.GATEWAY]["spec"]["type"] == "LoadBalancer"
    assert services[kp.CONTROL_PLANE]["spec"]["type"] == "ClusterIP"
    (role,) = (o for o in objects if o["kind"] == "Role")
    assert role["metadata"]["namespace"] == "models"


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--namespace", "Paved"),
        ("--namespace", "x" * 64),
        ("--replica-namespace", "models_1"),
        ("--gateway-image", "paved/gateway:v1"),
        ("--control-plane-image", "paved/control_plane"),
        ("--launcher-image", f"paved/launcher:v2@{DIGEST}"),
        ("--kubernetes-version", "1.19"),
        ("--kubernetes-version", "newest"),
        ("--region", "eu=1"),
        ("--model-cache", "nfs:server/share"),
        ("--model-cache", "host:relative/path"),
        ("--model-cache", "host:/a/../etc"),
        ("--gpu-resource", "gpu"),
        ("--control-plane-replicas", "0"),
        ("--gateway-replicas", "1001"),
        ("--gateway-service-type", "ExternalName"),
        ("--redis-secret", "Redis"),
        ("--gateway-state-secret", "db:bad key"),
        ("--control-plane-admin-secret", ""),
        ("--deployment", "tiny=s3://x"),
        ("--deployment", "tiny@v1="),
        ("--gpus", "-1"),
        ("--drain-timeout", "nan"),
        ("--drain-timeout", "0"),
        ("--replica-cpu", "two"),
        ("--replica-memory", "8 GB"),
        ("--output", "xml"),
        ("--from-control-plane", "ftp://x"),
    ],
)
def test_bad_input_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    code, out, err = _render(capsys, flag, value)
    assert code == 2
    assert out == ""
    assert f"argument {flag}" in err


def test_a_missing_required_flag_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["render", "--namespace", "paved"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "--control-plane-image" in err


# --- from a running control plane --------------------------------------------------------------


@contextlib.contextmanager
def fake_control_plane(body: dict[str, Any], key: str) -> Iterator[str]:
    """GET /v1/deployments on loopback answering `body` to `key` (401 otherwise)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path == "/v1/deployments" and self.headers.get("Authorization") == f"Bearer {key}"
            payload = json.dumps(body if ok else {"error": {"message": "bad admin key"}}).encode()
            reply(self, 200 if ok else 401, payload)

        def log_message(self, *args: Any) -> None:
            pass

    with LoopbackHTTPServer(Handler) as stub:
        yield stub.url


def _deployment_view(model: str, version: str, **changes: Any) -> dict[str, Any]:
    view = {
        "id": f"dep_{model}_{version}",
        "model_id": model,
        "version": version,
        "package_uri": f"s3://models/{model}-{version}.tar",
        "regions": ["cluster"],
        "engine": "package",
        "placement": {"node_selector": {"gpu.example/type": "h100"}},
        "state": "active",
        "fingerprint": {"kind": "generate", "kserve": None, "resources": {"gpus": 4}},
    }
    return {**view, **changes}


def test_from_a_running_control_plane(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {
        "object": "list",
        "data": [
            _deployment_view("big", "v1"),
            _deployment_view("big", "v0", state="inactive"),
            _deployment_view("elsewhere", "v1", regions=["us-1"]),
            _deployment_view("xgb", "v1", fingerprint={"kind": "kserve", "kserve": {"inputs": []}}),
        ],
    }
    monkeypatch.setenv("PAVED_ADMIN_KEY", "k" * 32)
    with fake_control_plane(body, "k" * 32) as url:
        code, out, err = _render(capsys, "--from-control-plane", url, "--output", "json")
        assert code == 0, err
        objects = json.loads(out)["items"]
        deployments = [
            o
            for o in objects
            if o["kind"] == "Deployment"
            and o["metadata"]["labels"]["app.kubernetes.io/component"] == "replica"
        ]
        assert sorted(d["metadata"]["annotations"]["paved.dev/deployment-id"] for d in deployments) == [
            "dep_big_v1",
            "dep_xgb_v1",
        ]
        by_id = {d["metadata"]["annotations"]["paved.dev/deployment-id"]: d for d in deployments}
        big = by_id["dep_big_v1"]["spec"]["template"]["spec"]
        assert big["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert big["nodeSelector"] == {"gpu.example/type": "h100"}
        xgb_ports = {
            p["name"] for p in by_id["dep_xgb_v1"]["spec"]["template"]["spec"]["containers"][0]["ports"]
        }
        assert "grpc" in xgb_ports
        for obj in objects:
            _validate(obj, NEWEST)

        monkeypatch.setenv("PAVED_ADMIN_KEY", "wrong-key")
        code, out, err = _render(capsys, "--from-control-plane", url)
        assert code == 1 and out == ""
        assert "bad admin key (HTTP 401)" in err


def test_from_a_control_plane_without_a_key_exits_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAVED_ADMIN_KEY", raising=False)
    code, out, err = _render(capsys, "--from-control-plane", "http://127.0.0.1:9")
    assert code == 2 and out == "" and "PAVED_ADMIN_KEY" in err
