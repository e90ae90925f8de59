"""Who may call what: the API key for ``/v1/*``, the admin key for ``/admin/*``."""

from __future__ import annotations

import dataclasses
import hmac

from starlette.requests import Request

from jax_kvcached.serve.protocol import APIError


@dataclasses.dataclass(frozen=True)
class AuthConfig:
    """Keys are compared in constant time. ``/health`` and ``/metrics`` are open."""

    api_key: str | None = None  # required on /v1/* when set
    admin_key: str | None = None  # required on /admin/* when set
    allow_unauthenticated_admin: bool = False  # /admin/* open when no admin key is set

    def check(self, request: Request, admin: bool) -> None:
        """Raises APIError 401 / 403 unless ``request`` may call its route."""
        if admin:
            if self.admin_key is None:
                if self.allow_unauthenticated_admin:
                    return
                raise APIError(
                    403, "admin routes are disabled: start the server with --admin-key "
                    "(or --allow-unauthenticated-admin)", code="admin_disabled",
                )  # fmt: skip
            key = self.admin_key
        elif self.api_key is None:
            return
        else:
            key = self.api_key
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        ok = scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), key.encode()
        )
        if not ok:
            what = "admin key" if admin else "API key"
            raise APIError(
                401, f"invalid or missing {what}: send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
            )  # fmt: skip
