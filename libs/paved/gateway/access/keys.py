"""API key format, generation, parsing and hashing.

A key reads `pvd_<key_id>_<secret>`:
- `key_id`: 12 lowercase base32 characters (60 random bits). Public: it is the row's primary key,
  the "visible prefix" admin listings show, and what logs may name.
- `secret`: `secrets.token_urlsafe(24)` (192 random bits, 32 URL-safe characters). Only its
  SHA-256 is stored; the plaintext exists once, in the answer to the create call.

Invariants: `parse_key` accepts exactly what `generate_key` produces (bounded length and charset,
so nothing unbounded or non-ASCII reaches a hash or a query); no function here logs, formats or
reprs a secret; comparisons of hashes are constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

from paved.gateway.errors import AuthError

KEY_PREFIX = "pvd_"
KEY_ID_LEN = 12
SECRET_LEN = 32  # len(secrets.token_urlsafe(24))
KEY_LEN = len(KEY_PREFIX) + KEY_ID_LEN + 1 + SECRET_LEN
_BASE32 = "abcdefghijklmnopqrstuvwxyz234567"
KEY_ID_RE = re.compile(rf"[a-z2-7]{{{KEY_ID_LEN}}}")
_KEY_RE = re.compile(rf"pvd_([a-z2-7]{{{KEY_ID_LEN}}})_([A-Za-z0-9_-]{{{SECRET_LEN}}})")


def new_key_id() -> str:
    return "".join(secrets.choice(_BASE32) for _ in range(KEY_ID_LEN))


def generate_key() -> tuple[str, str]:
    """A fresh (key_id, plaintext key). The caller stores `hash_secret` of the secret part only."""
    key_id = new_key_id()
    return key_id, f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(24)}"


def is_key_id(value: str) -> bool:
    return KEY_ID_RE.fullmatch(value) is not None


def parse_key(token: str) -> tuple[str, str]:
    """(key_id, secret) of a well-formed key; AuthError (invalid_api_key) for anything else.

    The message never echoes the token: a malformed token may still be someone's real secret.
    """
    # The length check comes first so a huge header costs nothing beyond this comparison.
    if not isinstance(token, str) or len(token) != KEY_LEN:
        raise AuthError("malformed API key: expected 'pvd_<id>_<secret>' as issued by the gateway")
    match = _KEY_RE.fullmatch(token)
    if match is None:
        raise AuthError("malformed API key: expected 'pvd_<id>_<secret>' as issued by the gateway")
    return match.group(1), match.group(2)


def hash_secret(secret: str) -> str:
    """SHA-256 hex of a key's secret part.

    A fast, unsalted hash is the right tool here, unlike for passwords: the secret is 192 bits
    from `secrets`, so there is no dictionary to try and brute force over 2^192 is out of
    reach however fast each guess is; a slow KDF (bcrypt, scrypt) would only turn every
    authenticated request (and every flood of bad keys) into CPU burnt on the gateway. Salting
    defends against precomputed tables, which cannot exist for uniformly random 192-bit inputs.
    """
    return hashlib.sha256(secret.encode("ascii")).hexdigest()


def secret_matches(secret: str, secret_hash: str) -> bool:
    """Whether `secret` hashes to `secret_hash`, compared in constant time."""
    return hmac.compare_digest(hash_secret(secret).encode("ascii"), secret_hash.encode("ascii"))
