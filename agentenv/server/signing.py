"""Signed file URLs (`Sandbox.download_url` / `upload_url`): a `/files` request without the envd access
token is allowed when it carries `signature` (and `signature_expiration`) made with that token, as envd
verifies them: `v1_` + unpadded base64 of sha256("<path>:<read|write>:<user>:<token>[:<expiration>]").

Such a URL names no sandbox when the SDK's sandbox URL is this server (no `E2b-Sandbox-Id` header), so
the sandbox is the one whose token makes the signature match."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from collections.abc import Iterable

from agentenv.server.store import E2BRecord

EXPIRED = "signature is already expired"


class BadSignature(Exception):
    """The signature matches no sandbox's token, or it expired (the message says which: a 401)."""


def sign(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    raw = f"{path}:{operation}:{user}:{token}" + ("" if expiration is None else f":{expiration}")
    digest = hashlib.sha256(raw.encode()).digest()
    return "v1_" + base64.b64encode(digest).rstrip(b"=").decode("ascii")


def signer(records: Iterable[E2BRecord], signature: str, path: str, operation: str, user: str | None,
           expiration: str | None) -> str:
    """The id of the sandbox whose envd token signed this request; BadSignature when none did or the
    signature has expired."""
    exp: int | None = None
    if expiration:
        try:
            exp = int(expiration)
        except ValueError:
            raise BadSignature(f"signature_expiration must be a Unix time, got {expiration!r}") from None
    match = [rec.sandbox_id for rec in records
             if hmac.compare_digest(sign(path, operation, user or "", rec.envd_token, exp), signature)]
    if not match:
        raise BadSignature(f"invalid signature for {operation} of {path!r}")
    if exp is not None and exp < time.time():
        raise BadSignature(EXPIRED)
    return match[0]
