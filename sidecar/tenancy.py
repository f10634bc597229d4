"""Who the caller is: one answer for the cache's scope and for admission's budgets alike.

The upstream may answer two credentials differently (per-organisation fine-tunes, injected
instructions, per-key memory), and a cache hit plus its `age` header tells a caller that
somebody else asked the same thing and when. So by default each credential is its own tenant:
  - a route that shares its cache (`shared`): tenant "shared", one cache for everybody;
  - a route's `tenant_header` names a header that Envoy sets from a verified identity (and
    strips from clients), e.g. `x-sluice-tenant`: the tenant is a keyed hash of its value.
    When the route names one and the header is missing, the caller is anonymous: there is
    no fall-back to `authorization`, since the route said identity comes from the header;
  - otherwise a keyed hash of the `authorization` header.
Credentials are HMAC-SHA256'd with the sidecar secret (domain-separated by source) and never
kept in clear; rotating the secret empties every cache in effect.
No credential at all gives None: the caller is *anonymous*; the cache does not serve it (policy
reason "anonymous") and admission counts it as ANONYMOUS. A missing `authorization` header
does not mean there is no identity, only that the sidecar cannot see it (mTLS, cookies, an
`api-key` header): pooling such callers would share answers across tenants we cannot tell
apart. A route that really serves the public says so with `shared`.

Pure functions; no I/O.
"""
from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping
from typing import Protocol

SHARED_TENANT = "shared"
ANONYMOUS = "anonymous"          # admission's name for a caller without a credential
MIN_SECRET_BYTES = 16



class TenantSettings(Protocol):
    """What a route says about its callers (sidecar.cache.policy.CachePolicy has both)."""
    tenant_header: str     # a header Envoy sets from a verified identity; "": Authorization
    shared: bool           # one tenant for everybody


_AUTH_SCHEME = re.compile(r"([^ \t]*)([ \t]*)(.*)", re.DOTALL)


def credential_header(tenant_header: str = "") -> str:
    """The header naming the caller: the route's tenant header, else Authorization."""
    return tenant_header or "authorization"


def credential(headers: Mapping[str, str], tenant_header: str = "") -> tuple[str, str] | None:
    """(source, value) of the caller's identity as sent, or None when there is none.

    source is "header:<name>" for the route's tenant header, "authorization" otherwise.
    Header names are lower-case (as the codec gives them); blank values count as absent.
    Authorization's scheme is case-insensitive and may be followed by several spaces (RFC 9110
    11.1): "bearer  K" is the upstream's "Bearer K", so it is one tenant, with one budget.
    """
    name = credential_header(tenant_header)
    value = (headers.get(name) or "").strip()
    if not value:
        return None
    if tenant_header:
        return f"header:{name}", value
    scheme, blank, rest = _AUTH_SCHEME.match(value).groups()
    return "authorization", (f"{scheme.lower()} {rest}" if blank and rest else value)


def tenant_of(headers: Mapping[str, str], secret: bytes, *, tenant_header: str = "",
              shared: bool = False) -> str | None:
    """The tenant part of a scope: "shared", a 64-hex keyed hash, or None (anonymous)."""
    if shared:
        return SHARED_TENANT
    _check_secret(secret)
    found = credential(headers, tenant_header)
    if found is None:
        return None
    source, value = found
    message = source.encode("ascii") + b"\0" + value.encode("utf-8", "surrogatepass")
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def _check_secret(secret: bytes) -> None:
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"secret: must be at least {MIN_SECRET_BYTES} bytes")
