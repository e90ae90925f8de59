"""Who may call what: an API key for ``/v1/*``, the admin key for ``/admin/*``; and which
tenant an API key belongs to."""

from __future__ import annotations

import dataclasses
import hmac

from starlette.requests import Request

from jax_kvcached.serve.protocol import APIError


@dataclasses.dataclass(frozen=True)
class TenantKey:
    """An API key of a named tenant: its requests share cached prefixes only with
    requests of keys of the same tenant."""

    tenant: str
    key: str


@dataclasses.dataclass(frozen=True)
class AuthConfig:
    """Keys are compared in constant time.

    ``/v1/*`` are open when neither ``api_key`` nor ``tenant_keys`` is set; otherwise a
    caller sends one of them. ``api_key`` callers are the default tenant (no salt).
    """

    api_key: str | None = None  # the default tenant's key
    admin_key: str | None = None  # required on /admin/* when set
    allow_unauthenticated_admin: bool = False  # /admin/* open when no admin key is set
    tenant_keys: tuple[TenantKey, ...] = ()

    def __post_init__(self) -> None:
        keys = [t.key for t in self.tenant_keys] + [self.api_key] * (self.api_key is not None)
        if not all(keys) or self.admin_key == "":
            raise ValueError("an empty key would let a bare 'Authorization: Bearer' pass")
        if len(set(keys)) != len(keys):
            raise ValueError("an API key is given twice (each key names one tenant)")

    @property
    def open(self) -> bool:
        """Whether ``/v1/*`` take calls without a key."""
        return self.api_key is None and not self.tenant_keys

    def check(self, request: Request, admin: bool) -> str | None:
        """The caller's tenant (None: the default one); APIError 401 / 403 unless
        ``request`` may call its route."""
        if admin:
            if self.admin_key is None:
                if self.allow_unauthenticated_admin:
                    return None
                raise APIError(
                    403, "admin routes are disabled: start the server with --admin-key "
                    "(or --allow-unauthenticated-admin)", code="admin_disabled",
                )  # fmt: skip
            keys = [(None, self.admin_key)]
        elif self.open:
            return None
        else:
            keys = [(t.tenant, t.key) for t in self.tenant_keys]
            if self.api_key is not None:
                keys.append((None, self.api_key))
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip().encode()
        found, tenant = False, None
        for name, key in keys:  # (every key compared: the time names none of them)
            if hmac.compare_digest(given, key.encode()):
                found, tenant = True, name
        if scheme.lower() != "bearer" or not found:
            what = "admin key" if admin else "API key"
            raise APIError(
                401, f"invalid or missing {what}: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )  # fmt: skip
        return tenant


def tenant_salt(tenant: str | None, cache_salt: str | None) -> str | None:
    """The salt a request's blocks are keyed with: its own ``cache_salt`` within its
    tenant. Request salts hold no NUL (the protocol refuses them), so no request salt
    equals a tenant's."""
    if tenant is None:
        return cache_salt
    return f"\x00tenant\x00{tenant}\x00{cache_salt or ''}"
