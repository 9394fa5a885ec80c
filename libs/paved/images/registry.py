"""A small client of the OCI distribution (registry) HTTP API: enough to push and read back.

Push of one blob: HEAD /v2/<repo>/blobs/<digest> (200: already there); else, when another
repository of the registry holds it, a cross-repo mount
POST /v2/<repo>/blobs/uploads/?mount=<digest>&from=<other> (201: mounted, no bytes sent);
else POST /v2/<repo>/blobs/uploads/ (202 + Location) and PUT <Location>&digest=<digest> with
the bytes. Manifests: PUT /v2/<repo>/manifests/<ref> with the manifest's media type; the
registry answers the digest it stored, which must equal ours.

http:// is used for loopback hosts (a test registry) or with plain_http=True; https://
otherwise. Credentials, when a registry asks (401), come from PAVED_REGISTRY_USER /
PAVED_REGISTRY_PASSWORD: Basic, or a Bearer token fetched from the challenge's realm.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import re
import urllib.parse
from pathlib import Path

from paved.images import oci

_ACCEPT = ", ".join([oci.MEDIA_MANIFEST, oci.MEDIA_INDEX, oci.DOCKER_MANIFEST, oci.DOCKER_MANIFEST_LIST])
_LOOPBACK = ("127.", "localhost", "[::1]")


class RegistryError(Exception):
    pass


def _parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.partition(" ")
    return scheme.lower(), dict(re.findall(r'(\w+)="([^"]*)"', rest))


class Registry:
    def __init__(self, host: str, plain_http: bool | None = None, timeout: float = 300.0):
        if "/" in host or not host:
            raise RegistryError(f"registry must be HOST[:PORT], got {host!r}")
        self.host = host
        self.plain_http = host.startswith(_LOOPBACK) if plain_http is None else plain_http
        self.timeout = timeout
        self._auth: dict[str, str] = {}  # scope -> Authorization header value

    # ---- transport -------------------------------------------------------------------
    def _conn(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPConnection if self.plain_http else http.client.HTTPSConnection
        return cls(self.host, timeout=self.timeout)

    def request(
        self,
        method: str,
        path: str,
        body=None,
        headers: dict[str, str] | None = None,
        repo: str | None = None,
        ok: tuple[int, ...] = (200,),
    ) -> tuple[int, dict[str, str], bytes]:
        headers = dict(headers or {})
        for attempt in range(2):
            if repo and repo in self._auth:
                headers["Authorization"] = self._auth[repo]
            if hasattr(body, "seek"):
                body.seek(0)
            conn = self._conn()
            try:
                conn.request(method, path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                status, resp_headers = resp.status, {k.lower(): v for k, v in resp.getheaders()}
            except OSError as e:
                raise RegistryError(f"{method} {self._url(path)}: {e}") from e
            finally:
                conn.close()
            if status == 401 and attempt == 0 and repo:
                self._authenticate(repo, resp_headers.get("www-authenticate", ""))
                continue
            if status not in ok:
                detail = data[:500].decode(errors="replace").strip()
                raise RegistryError(f"{method} {self._url(path)}: HTTP {status} {detail}")
            return status, resp_headers, data
        raise RegistryError(f"{method} {self._url(path)}: unauthorized")

    def _url(self, path: str) -> str:
        return f"{'http' if self.plain_http else 'https'}://{self.host}{path}"

    def _authenticate(self, repo: str, challenge: str) -> None:
        user, password = os.environ.get("PAVED_REGISTRY_USER"), os.environ.get("PAVED_REGISTRY_PASSWORD")
        if not user or password is None:
            raise RegistryError(
                f"{self.host} requires credentials: set PAVED_REGISTRY_USER / PAVED_REGISTRY_PASSWORD"
            )
        basic = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        scheme, params = _parse_challenge(challenge)
        if scheme == "basic":
            self._auth[repo] = basic
            return
        if scheme != "bearer" or "realm" not in params:
            raise RegistryError(f"{self.host}: unsupported auth challenge {challenge!r}")
        query = {"scope": f"repository:{repo}:pull,push"}
        if "service" in params:
            query["service"] = params["service"]
        realm = urllib.parse.urlsplit(params["realm"])
        cls = http.client.HTTPSConnection if realm.scheme == "https" else http.client.HTTPConnection
        conn = cls(realm.netloc, timeout=self.timeout)
        try:
            conn.request(
                "GET", f"{realm.path}?{urllib.parse.urlencode(query)}", headers={"Authorization": basic}
            )
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            raise RegistryError(f"token request to {params['realm']} failed: HTTP {resp.status}")
        token = json.loads(data).get("token") or json.loads(data).get("access_token")
        self._auth[repo] = f"Bearer {token}"

    # ---- API -------------------------------------------------------------------------
    def ping(self) -> None:
        self.request("GET", "/v2/", ok=(200, 401))

    def has_blob(self, repo: str, digest: str) -> bool:
        status, _, _ = self.request("HEAD", f"/v2/{repo}/blobs/{digest}", repo=repo, ok=(200, 404))
        return status == 200

    def mount_blob(self, repo: str, digest: str, from_repo: str) -> bool:
        """Cross-repo mount; False when the registry could not mount (it then opened an
        ordinary upload session, which we leave to expire)."""
        q = urllib.parse.urlencode({"mount": digest, "from": from_repo})
        status, _, _ = self.request("POST", f"/v2/{repo}/blobs/uploads/?{q}", repo=repo, ok=(201, 202))
        return status == 201

    def upload_blob(
        self, repo: str, digest: str, path: str | os.PathLike | None = None, data: bytes | None = None
    ) -> None:
        _, headers, _ = self.request("POST", f"/v2/{repo}/blobs/uploads/", repo=repo, ok=(202,))
        location = headers.get("location")
        if not location:
            raise RegistryError(f"{self.host}: upload to {repo} returned no Location")
        loc = urllib.parse.urlsplit(location)
        target = (
            (loc.path or location)
            + "?"
            + "&".join(x for x in (loc.query, urllib.parse.urlencode({"digest": digest})) if x)
        )
        if path is not None:
            size = Path(path).stat().st_size
            with open(path, "rb") as f:
                self.request(
                    "PUT",
                    target,
                    body=f,
                    headers={"Content-Type": "application/octet-stream", "Content-Length": str(size)},
                    repo=repo,
                    ok=(201,),
                )
        else:
            assert data is not None  # noqa: S101 - the branch above took the no-data case
            self.request(
                "PUT",
                target,
                body=data,
                headers={"Content-Type": "application/octet-stream", "Content-Length": str(len(data))},
                repo=repo,
                ok=(201,),
            )

    def put_manifest(self, repo: str, ref: str, data: bytes, media_type: str = oci.MEDIA_MANIFEST) -> str:
        _, headers, _ = self.request(
            "PUT",
            f"/v2/{repo}/manifests/{ref}",
            body=data,
            headers={"Content-Type": media_type, "Content-Length": str(len(data))},
            repo=repo,
            ok=(201,),
        )
        return headers.get("docker-content-digest", "")

    def get_manifest(self, repo: str, ref: str) -> tuple[bytes, str, str]:
        """(bytes, media type, digest) of a manifest by tag or digest."""
        _, headers, data = self.request(
            "GET", f"/v2/{repo}/manifests/{ref}", headers={"Accept": _ACCEPT}, repo=repo
        )
        return data, headers.get("content-type", ""), oci.sha256_bytes(data)

    def get_blob(self, repo: str, digest: str) -> bytes:
        _, _, data = self.request("GET", f"/v2/{repo}/blobs/{digest}", repo=repo)
        if oci.sha256_bytes(data) != digest:
            raise RegistryError(f"{repo}@{digest}: the registry returned different bytes")
        return data
