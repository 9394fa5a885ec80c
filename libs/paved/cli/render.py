"""`paved render`: the Kubernetes objects that run paved on a cluster, printed to stdout.

  paved render --namespace NS --control-plane-image IMG@sha256:... --gateway-image IMG@sha256:...
        --launcher-image IMG@sha256:... [--replica-namespace NS] [--create-namespace]
        [--region NAME] [--model-cache pvc:CLAIM|host:/PATH] [--gpu-resource nvidia.com/gpu]
        [--kubernetes-version 1.20] [--control-plane-replicas 2] [--gateway-replicas 3]
        [--gateway-service-type ClusterIP|NodePort|LoadBalancer]
        [--control-plane-state-secret NAME[:KEY]] [--control-plane-admin-secret NAME[:KEY]]
        [--gateway-state-secret NAME[:KEY]] [--redis-secret NAME[:KEY]]
        [--gateway-admin-secret NAME[:KEY]] [--replica-cpu 2] [--replica-memory 8Gi]
        [--drain-timeout 30] [--deployment MODEL@VERSION=PACKAGE_URI ... [--gpus N]]
        [--from-control-plane URL] [--output yaml|json]

Prints the platform (paved.control_plane.kube_platform: the control plane with its
ServiceAccount and least RBAC, the gateway) and, for each deployment named with --deployment or
registered on the control plane at --from-control-plane (active, in --region), its replicas'
Deployment, Service and PodDisruptionBudget (paved.control_plane.kube_objects). YAML documents
separated by `---`, or one JSON `v1/List` (`--output json`); both go to `kubectl apply -f -`.
Secrets are referenced by name, never printed. Bad input is exit 2 naming the flag, before
anything is printed.

  paved render prometheus [--control-plane URL] [--credentials-file PATH | --file-sd PATH]
        [--rule-files PATH ...] [--scrape-interval 15s] [--job-name paved]

Prints a prometheus.yml (paved.control_plane.prometheus.scrape_config): one job that discovers
every ready replica's metrics endpoint, the gateways and the control plane from the control
plane's GET /v1/prometheus/targets (http_sd, authorized with the admin key read from
--credentials-file), or from the file the control plane writes with --prometheus-file-sd
(--file-sd), and the rule files (default: this checkout's ops/prometheus/rules/*.yml).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paved.cli.common import CliError, admin_key_option, base_url, bounded_int, connect

# The kubernetes target's required flags (required by hand: `paved render prometheus` has none).
_REQUIRED = ("--namespace", "--control-plane-image", "--gateway-image", "--launcher-image")
# This checkout's rules (libs/paved/cli/render.py -> the repository root).
_RULES_DIR = Path(__file__).resolve().parents[3] / "ops" / "prometheus" / "rules"

# The checks are kube_platform's; they are imported where used so that `paved keys ...` does
# not pay for the control plane's modules at start.
_DEPLOYMENT = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]{0,127})@([A-Za-z0-9][A-Za-z0-9._-]{0,127})=(.+)")
# PlatformSettings field -> the flag that sets it (its ValueErrors start with the field name).
_FLAGS = {
    "namespace": "--namespace",
    "replica_namespace": "--replica-namespace",
    "control_plane_image": "--control-plane-image",
    "gateway_image": "--gateway-image",
    "launcher_image": "--launcher-image",
    "region": "--region",
    "model_cache": "--model-cache",
    "gpu_resource": "--gpu-resource",
    "kubernetes": "--kubernetes-version",
    "control_plane_replicas": "--control-plane-replicas",
    "gateway_replicas": "--gateway-replicas",
    "gateway_service_type": "--gateway-service-type",
    "control_plane_state": "--control-plane-state-secret",
    "control_plane_admin_key": "--control-plane-admin-secret",
    "gateway_state": "--gateway-state-secret",
    "gateway_redis": "--redis-secret",
    "gateway_admin_key": "--gateway-admin-secret",
    "replica_cpu": "--replica-cpu",
    "replica_memory": "--replica-memory",
    "drain_timeout_s": "--drain-timeout",
}


def _checked(check: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """An argparse type from a checker raising ValueError (argparse names the flag)."""

    def parse(text: str) -> Any:
        try:
            return check(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = name
    return parse


def _image(text: str) -> str:
    from paved.control_plane.kube_platform import image_ref

    return image_ref(text)


def _version(text: str) -> tuple[int, int]:
    from paved.control_plane.kube_platform import kubernetes_version

    return kubernetes_version(text)


def _secret(default_key: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        from paved.control_plane.kube_platform import SecretRef

        return SecretRef.parse(text, default_key)

    return _checked(parse, "NAME[:KEY]")


def _deployment(text: str) -> tuple[str, str, str]:
    match = _DEPLOYMENT.fullmatch(text)
    if match is None or not match.group(3).strip():
        raise ValueError(f"{text!r:.200}: use MODEL@VERSION=PACKAGE_URI")
    model, version, uri = match.groups()
    return model, version, uri


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r:.40} is not a number of seconds") from None
    if not (math.isfinite(value) and 0 < value <= 3600):
        raise ValueError(f"{text!r:.40} must be within (0, 3600] seconds")
    return value


def register(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "render",
        help="print the Kubernetes objects that run paved on a cluster (YAML or JSON), or a "
        "Prometheus scrape config for the fleet (`paved render prometheus`)",
        description="The Kubernetes objects that run paved (control plane with its RBAC, gateway) "
        "in a namespace, and each given deployment's replica objects; pipe to `kubectl apply -f -`. "
        "`paved render prometheus`: a prometheus.yml discovering the fleet from the control plane.",
    )
    p.add_argument(
        "target",
        nargs="?",
        choices=("kubernetes", "prometheus"),
        default="kubernetes",
        help="kubernetes (default): the platform's objects; prometheus: a scrape config",
    )
    where = p.add_argument_group("cluster")
    where.add_argument("--namespace", help="where the control plane and the gateway run (required)")
    where.add_argument(
        "--replica-namespace", default="", help="where the model replicas run (default: --namespace)"
    )
    where.add_argument("--create-namespace", action="store_true", help="also print the Namespace object(s)")
    where.add_argument(
        "--kubernetes-version",
        type=_checked(_version, "MAJOR.MINOR"),
        default=None,
        metavar="MAJOR.MINOR",
        help="the cluster's version, 1.20 or newer: picks apiVersions (PodDisruptionBudget is "
        "policy/v1beta1 before 1.21). Default: any 1.21 or newer",
    )
    where.add_argument(
        "--region", default="cluster", help="the control plane's name for this cluster (default cluster)"
    )
    where.add_argument(
        "--model-cache",
        default="",
        metavar="pvc:CLAIM|host:/PATH",
        help="the replicas' model cache: a PersistentVolumeClaim (ReadWriteMany) or a node directory "
        "(default: an emptyDir, every pod downloads its package)",
    )
    where.add_argument(
        "--gpu-resource",
        default="nvidia.com/gpu",
        help="the extended resource a replica's GPUs are requested as ('' on a CPU cluster)",
    )

    images = p.add_argument_group("images (pinned by digest: NAME@sha256:<64 hex>)")
    for flag, what in (
        ("--control-plane-image", "the control plane's image"),
        ("--gateway-image", "the gateway's image"),
        ("--launcher-image", "the launcher image every replica runs"),
    ):
        images.add_argument(flag, type=_checked(_image, "IMAGE@sha256:DIGEST"), help=f"{what} (required)")

    sizes = p.add_argument_group("replicas")
    sizes.add_argument(
        "--control-plane-replicas",
        type=bounded_int(1, 10),
        default=2,
        help="control-plane pods (default 2; one leads, elected on PostgreSQL)",
    )
    sizes.add_argument(
        "--gateway-replicas", type=bounded_int(1, 1000), default=3, help="gateway pods (default 3)"
    )
    sizes.add_argument(
        "--gateway-service-type", choices=("ClusterIP", "NodePort", "LoadBalancer"), default="ClusterIP"
    )

    secrets = p.add_argument_group("secrets (created by you; referenced by NAME or NAME:KEY, never printed)")
    # (flag, default Secret, default key, what it holds)
    refs = (
        ("--control-plane-state-secret", "paved-control-plane-postgres", "url",
         "the control plane's postgresql:// URL"),
        ("--control-plane-admin-secret", "paved-control-plane-admin", "admin-key",
         "the control plane's admin key (also the gateways' routes token)"),
        ("--gateway-state-secret", "paved-gateway-postgres", "url",
         "the gateway's postgresql:// URL (keys, tenants)"),
        ("--redis-secret", "paved-redis", "url",
         "the gateway's redis:// URL (limits shared by its replicas)"),
        ("--gateway-admin-secret", "paved-gateway-admin", "admin-key", "the gateway's admin key"),
    )  # fmt: skip
    for flag, default, key, what in refs:
        secrets.add_argument(
            flag,
            type=_secret(key),
            default=f"{default}:{key}",
            metavar="NAME[:KEY]",
            help=f"{what} (default {default}, key {key})",
        )

    # The replica settings are the control plane's driver flags as well (kube_platform
    # .control_plane_args), so printed replica objects are the ones the control plane applies.
    models = p.add_argument_group("model replicas")
    models.add_argument(
        "--deployment",
        action="append",
        default=[],
        type=_checked(_deployment, "MODEL@VERSION=PACKAGE_URI"),
        metavar="MODEL@VERSION=PACKAGE_URI",
        help="also print this deployment's replica objects (repeatable)",
    )
    models.add_argument(
        "--gpus", type=bounded_int(0, 1024), default=0, help="GPUs per replica of each --deployment"
    )
    models.add_argument("--replica-cpu", default="2", help="a replica pod's CPU request (default 2)")
    models.add_argument(
        "--replica-memory", default="8Gi", help="a replica pod's memory request and limit (default 8Gi)"
    )
    models.add_argument(
        "--drain-timeout",
        type=_checked(_seconds, "SECONDS"),
        default=30.0,
        help="seconds a replica may take to finish its requests when drained (default 30)",
    )
    models.add_argument(
        "--from-control-plane",
        type=base_url,
        default=None,
        metavar="URL",
        help="also print the replica objects of the active deployments registered there (in --region)",
    )
    admin_key_option(models, "with --from-control-plane; prefer the env var PAVED_ADMIN_KEY")
    p.add_argument("--output", choices=("yaml", "json"), default="yaml", help="yaml (default) or json")

    prom = p.add_argument_group("prometheus (`paved render prometheus`)")
    prom.add_argument(
        "--control-plane",
        type=base_url,
        default=None,
        metavar="URL",
        help="the control plane Prometheus asks for targets (env PAVED_CONTROL_PLANE_URL, default "
        "http://127.0.0.1:8090)",
    )
    prom.add_argument(
        "--credentials-file",
        default="/etc/prometheus/paved-admin-key",
        metavar="PATH",
        help="the file, readable by Prometheus, holding the control plane's admin key (default "
        "/etc/prometheus/paved-admin-key)",
    )
    prom.add_argument(
        "--file-sd",
        default=None,
        metavar="PATH",
        help="discover from this file_sd JSON file (the control plane's --prometheus-file-sd) "
        "instead of over HTTP",
    )
    prom.add_argument(
        "--rule-files",
        action="append",
        default=None,
        metavar="PATH",
        help="a rule file or glob (repeatable; default this checkout's ops/prometheus/rules/*.yml)",
    )
    prom.add_argument(
        "--scrape-interval",
        default="15s",
        help="scrape and rule evaluation interval (at most 15s: the rules need it)",
    )
    prom.add_argument("--job-name", default="paved", help="the scrape job's name (default paved)")
    p.set_defaults(run=_run, parser=p)


def _settings(args: argparse.Namespace) -> Any:
    from paved.control_plane.kube_platform import PlatformSettings

    fields: dict[str, Any] = {
        "namespace": args.namespace,
        "replica_namespace": args.replica_namespace,
        "control_plane_image": args.control_plane_image,
        "gateway_image": args.gateway_image,
        "launcher_image": args.launcher_image,
        "region": args.region,
        "model_cache": args.model_cache,
        "gpu_resource": args.gpu_resource,
        "create_namespace": args.create_namespace,
        "control_plane_replicas": args.control_plane_replicas,
        "gateway_replicas": args.gateway_replicas,
        "gateway_service_type": args.gateway_service_type,
        "control_plane_state": args.control_plane_state_secret,
        "control_plane_admin_key": args.control_plane_admin_secret,
        "gateway_state": args.gateway_state_secret,
        "gateway_redis": args.redis_secret,
        "gateway_admin_key": args.gateway_admin_secret,
        "replica_cpu": args.replica_cpu,
        "replica_memory": args.replica_memory,
        "drain_timeout_s": args.drain_timeout,
    }
    if args.kubernetes_version is not None:
        fields["kubernetes"] = args.kubernetes_version
    settings = PlatformSettings(**fields)
    try:
        return settings.validate()
    except ValueError as e:
        field, _, why = str(e).partition(": ")
        args.parser.error(f"argument {_FLAGS.get(field, field)}: {why or e}")


def _deployments_from(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The active deployments the control plane at --from-control-plane runs in --region."""
    client = connect(
        args, args.parser, url=args.from_control_plane, env="PAVED_CONTROL_PLANE_URL",
        default="", prefix="/v1", service="control plane",
    )  # fmt: skip
    body = client.request("GET", "/deployments")
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        raise CliError("the control plane's /v1/deployments answer has no data list")
    found = []
    for d in data:
        if (
            not isinstance(d, dict)
            or d.get("state") != "active"
            or args.region not in (d.get("regions") or [])
        ):
            continue
        fingerprint = d.get("fingerprint") or {}
        resources = fingerprint.get("resources") or {}
        found.append(
            {
                "deployment_id": d.get("id"),
                "model_id": d.get("model_id"),
                "version": d.get("version"),
                "package_uri": d.get("package_uri"),
                "engine": d.get("engine") or "package",
                # As the controller builds its ReplicaRequests.
                "kserve": bool(fingerprint.get("kserve")),
                "kind": fingerprint.get("kind", "generate"),
                "gpus": resources.get("gpus", 0),
                "placement": d.get("placement") or {},
            }
        )
    return found


def command_line_id(model: str, version: str) -> str:
    """A stable id for a deployment named only on the command line (a control plane would
    generate its own: render from it with --from-control-plane to get its objects' names)."""
    return "dep_" + hashlib.sha256(f"{model}@{version}".encode()).hexdigest()[:32]


def _replica_objects(args: argparse.Namespace, settings: Any) -> list[dict[str, Any]]:
    # (where it came from, replica_objects' deployment arguments)
    wanted: list[tuple[str, dict[str, Any]]] = [
        (
            "--deployment",
            {
                "deployment_id": command_line_id(model, version),
                "model_id": model,
                "version": version,
                "package_uri": uri,
                "gpus": args.gpus,
            },
        )
        for model, version, uri in args.deployment
    ]
    if args.from_control_plane is not None:
        wanted += [("--from-control-plane", d) for d in _deployments_from(args)]
    if not wanted:
        return []
    from paved.control_plane.errors import ControlError
    from paved.control_plane.kube_objects import replica_objects

    kube = settings.replica_settings()
    objects: list[dict[str, Any]] = []
    for source, d in wanted:
        try:
            objects += replica_objects(**d, region=settings.region, settings=kube, pdb_api=settings.pdb_api)
        except ControlError as e:
            what = f"{d.get('model_id')}@{d.get('version')}"
            if source == "--deployment":
                args.parser.error(f"argument --deployment: {what}: {e.message}")
            # The control plane's own records: not a usage error of this command.
            raise CliError(f"deployment {what} from the control plane: {e.message}") from None
    return objects


def _yaml(objects: list[dict[str, Any]]) -> str:
    import yaml  # type: ignore[import-untyped]  # PyYAML ships no stubs; none are locked

    class Dumper(yaml.SafeDumper):
        # Objects built from one dict (a selector used twice) would print as &id001 / *id001:
        # valid YAML, but not what a reader of a manifest expects.
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump_all(
        objects, Dumper=Dumper, sort_keys=False, default_flow_style=False, explicit_start=True
    )


def _prometheus(args: argparse.Namespace) -> int:
    from paved.control_plane.prometheus import scrape_config

    if args.output != "yaml":
        args.parser.error("argument --output: `paved render prometheus` prints YAML only")
    for flag, value in (("--credentials-file", args.credentials_file), ("--file-sd", args.file_sd)):
        if value is not None and (not value.strip() or not value.isprintable()):
            args.parser.error(f"argument {flag}: a file path")
    for rule in args.rule_files or ():
        if not rule.strip() or not rule.isprintable():
            args.parser.error("argument --rule-files: a file path or glob")
    control_plane = None
    if args.file_sd is None:
        control_plane = args.control_plane
        if control_plane is None:
            try:
                control_plane = base_url(os.environ.get("PAVED_CONTROL_PLANE_URL") or "http://127.0.0.1:8090")
            except argparse.ArgumentTypeError as exc:
                args.parser.error(f"PAVED_CONTROL_PLANE_URL: {exc}")
    elif args.control_plane is not None:
        args.parser.error("argument --file-sd: not with --control-plane (one way to discover)")
    rules = args.rule_files
    if rules is None:
        rules = [str(_RULES_DIR / "*.yml")] if _RULES_DIR.is_dir() else []
    try:
        text = scrape_config(
            control_plane_url=control_plane,
            credentials_file=args.credentials_file if args.file_sd is None else None,
            file_sd=args.file_sd,
            rule_files=rules,
            job_name=args.job_name,
            scrape_interval=args.scrape_interval,
            evaluation_interval=args.scrape_interval,
        )
    except ValueError as e:
        args.parser.error(str(e))
    sys.stdout.write(text)
    return 0


def _run(args: argparse.Namespace) -> int:
    if args.target == "prometheus":
        return _prometheus(args)
    missing = [flag for flag in _REQUIRED if getattr(args, flag[2:].replace("-", "_")) is None]
    if missing:
        args.parser.error(f"the following arguments are required: {', '.join(missing)}")
    settings = _settings(args)
    from paved.control_plane.kube_platform import platform_objects

    objects = platform_objects(settings) + _replica_objects(args, settings)
    if args.output == "json":
        out = json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2) + "\n"
    else:
        out = _yaml(objects)
    sys.stdout.write(out)
    return 0
