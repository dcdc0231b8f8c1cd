"""Tenants: the API keys a request must carry, and the prefix-cache scope a request gets
(requests share cached prompt prefixes only within one scope).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Optional, Sequence

from llama.serve.openai_api import APIError


class APIKeys:
    """The keys ``Authorization: Bearer KEY`` must name (none: anyone may call)."""

    def __init__(self, keys: Sequence[str] = ()) -> None:
        self._keys = [key.encode("utf-8") for key in keys]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: Optional[str]) -> bytes:
        """The request's key, or a 401 :class:`APIError`."""
        key = bearer_token(authorization)
        # compare_digest: the time taken does not tell how much of a guess was right.
        if key is None or not any(hmac.compare_digest(key, k) for k in self._keys):
            raise APIError(
                401, "a valid API key is needed: send the header 'Authorization: Bearer <key>'",
                type="invalid_request_error", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
            )
        return key


def bearer_token(header: Optional[str]) -> Optional[bytes]:
    """The key of an ``Authorization: Bearer KEY`` header, or None."""
    if not header:
        return None
    scheme, _, key = header.partition(" ")
    return key.strip().encode("utf-8") if scheme.lower() == "bearer" and key.strip() else None


def cache_scope(api_key: Optional[bytes], cache_salt: Optional[str]) -> Optional[str]:
    """The engine's ``cache_scope`` of a request: requests share cached prompt prefixes only
    within one scope.  The key enters as a hash (the scope travels to every rank)."""
    parts = []
    if api_key is not None:
        parts.append("key:" + hashlib.sha256(api_key).hexdigest()[:32])
    if cache_salt is not None:
        parts.append("salt:" + hashlib.sha256(cache_salt.encode("utf-8")).hexdigest()[:32])
    return "/".join(parts) or None
