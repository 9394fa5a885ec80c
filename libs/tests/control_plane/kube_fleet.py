"""The scenario fleet (fleet.py) on a real API server: the control-plane main with
`--driver kubernetes`, its replicas pods of Deployments that a played node runs as local
launchers (kube_cluster.py), a gateway main following its routes."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fleet import make_fleet
from kube_cluster import Cluster, PlayedNode, kube_cluster, played_node

IMAGE_REPO = "registry.test/paved/launcher"
IMAGE = IMAGE_REPO + "@sha256:" + "0" * 64


def driver_args(cluster: Cluster, namespace: str, cache: Path) -> list[str]:
    """The control-plane flags that put region "local" on `cluster`."""
    return [
        "--driver", "kubernetes",
        "--kube-region", f"local={cluster.context}",
        "--kubeconfig", str(cluster.kubeconfig),
        "--kube-namespace", namespace,
        "--kube-image", IMAGE,
        "--kube-model-cache", f"host:{cache}",
        "--kube-gpu-resource", "",
        "--kube-cpu", "100m",
        "--kube-memory", "1Gi",
        "--drain-timeout", "10",
    ]  # fmt: skip


@contextlib.contextmanager
def kube_node(root: Path) -> Iterator[tuple[Cluster, PlayedNode]]:
    """An API server and one played node running the launcher image's pods (any namespace)."""
    with kube_cluster(root) as cluster:
        images = {IMAGE_REPO: [sys.executable, "-m", "paved.launcher.main"]}
        with played_node(cluster, images=images) as node:
            yield cluster, node


@contextlib.contextmanager
def kube_fleet(
    cluster: Cluster, tmp_path: Path, namespace: str
) -> Iterator[Callable[..., tuple[Any, Any, str]]]:
    """`make(*cp_args)` -> (control plane, gateway, key), the control plane driving region
    "local" as pods in `namespace` (created here); both stopped on exit."""
    cluster.namespace(namespace)
    cache = tmp_path / "model-cache"
    cache.mkdir(exist_ok=True)
    with make_fleet(tmp_path) as make:

        def make_kube(*cp_args: str) -> tuple[Any, Any, str]:
            return make((), *driver_args(cluster, namespace, cache), *cp_args)

        yield make_kube
