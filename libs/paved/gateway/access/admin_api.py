"""The admin API (`/admin/v1`): tenants and API keys, for `paved keys` / `paved tenants`.

Routes (all require `Authorization: Bearer <admin key>`):
  POST   /admin/v1/tenants                {name, models?, limits?}          -> 201 tenant
  GET    /admin/v1/tenants                                   -> {"object": "list", "data": [...]}
  PATCH  /admin/v1/tenants/{name}         {models?, limits?}                -> tenant
  POST   /admin/v1/keys                   {tenant, name?, expires_in_s? | expires_at?, limits?}
                                          -> 201 {"key": "<plaintext, shown once>", ...key info}
  GET    /admin/v1/keys?tenant=T                                            -> list of key info
  POST   /admin/v1/keys/{key_id}/revoke   and   DELETE /admin/v1/keys/{key_id}  -> key info

Invariants:
- The admin key is checked before anything else about the request (body parsing included), so
  an unauthenticated caller learns nothing, not even whether its body was valid.
- Failures are GatewayError / AuthError (the app renders them as OpenAI error bodies); bodies are
  pydantic models with extra="forbid" and bounds (the app turns validation errors into 400s).
- No response carries a secret hash; the plaintext key appears only in the 201 of POST /keys.
- A PATCH's `limits`, when present, replaces the tenant's limits whole (an omitted field means
  "no limit of that kind"). An omitted PATCH field leaves that field as it is; an explicit null
  is a 400 (as create answers for `models`), never "unchanged" nor "empty": `{"models": null}`
  must not lock a tenant out of every model, and `{"limits": {}}` is how limits are cleared.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.routing import APIRoute
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)

from paved.gateway.access.auth import AdminAuth
from paved.gateway.access.state import (
    MAX_KEY_NAME_LEN,
    MAX_LIMIT,
    MAX_MODEL_LEN,
    MAX_MODELS,
    GatewayStore,
    tenant_to_dict,
)
from paved.gateway.errors import GatewayError
from paved.gateway.types import Limits

MAX_EXPIRES_IN_S = 10 * 366 * 24 * 3600  # ten years

_LimitValue = Annotated[StrictInt | None, Field(ge=0, le=MAX_LIMIT)]
_Model = Annotated[StrictStr, Field(min_length=1, max_length=MAX_MODEL_LEN)]
_TenantName = Annotated[StrictStr, Field(pattern=r"^[a-z0-9][a-z0-9._-]{0,62}$")]


class LimitsBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests_per_min: _LimitValue = None
    tokens_per_min: _LimitValue = None
    max_concurrent: _LimitValue = None

    def to_limits(self) -> Limits:
        return Limits(self.requests_per_min, self.tokens_per_min, self.max_concurrent)


class TenantCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: _TenantName
    models: list[_Model] = Field(default_factory=lambda: ["*"], max_length=MAX_MODELS)
    limits: LimitsBody | None = None


class TenantPatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # None is only the default (the field was omitted): validators do not run on defaults, so
    # `_no_null` sees exactly the nulls the client sent.
    models: list[_Model] | None = Field(default=None, max_length=MAX_MODELS)
    limits: LimitsBody | None = None

    @field_validator("models", "limits", mode="before")
    @classmethod
    def _no_null(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            if info.field_name == "models":
                raise ValueError('Input should be a valid list (omit "models" to leave them unchanged)')
            raise ValueError(
                'Input should be a valid object ({} clears every limit; omit "limits" to keep them)'
            )
        return value


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: _TenantName
    name: StrictStr = Field(default="", max_length=MAX_KEY_NAME_LEN)
    expires_in_s: StrictInt | None = Field(default=None, gt=0, le=MAX_EXPIRES_IN_S)
    expires_at: AwareDatetime | None = None
    limits: LimitsBody | None = None


def _admin_route_class(admin: AdminAuth) -> type[APIRoute]:
    class AdminRoute(APIRoute):
        """Checks the admin key before FastAPI reads the body or runs the endpoint."""

        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def checked(request: Request) -> Response:
                admin.check(request.headers.get("authorization"))
                return await handler(request)

            return checked

    return AdminRoute


def admin_router(
    store: GatewayStore, admin: AdminAuth, on_revoke: Callable[[str], None] | None = None
) -> APIRouter:
    """`on_revoke(key_id)` runs after each revocation: the replica's Authenticator.invalidate,
    so the key stops working here at once, not when its cached lookup ages out."""
    router = APIRouter(prefix="/admin/v1", route_class=_admin_route_class(admin))

    @router.post("/tenants", status_code=201)
    async def create_tenant(body: TenantCreate) -> dict[str, Any]:
        limits = body.limits.to_limits() if body.limits else Limits()
        tenant = await store.create_tenant(body.name, models=body.models, limits=limits)
        return tenant_to_dict(tenant)

    @router.get("/tenants")
    async def list_tenants() -> dict[str, Any]:
        return {"object": "list", "data": [tenant_to_dict(t) for t in await store.list_tenants()]}

    @router.patch("/tenants/{name}")
    async def update_tenant(name: str, body: TenantPatch) -> dict[str, Any]:
        tenant = await store.update_tenant(
            name,
            models=body.models,
            limits=body.limits.to_limits() if body.limits is not None else None,
        )
        return tenant_to_dict(tenant)

    @router.post("/keys", status_code=201)
    async def create_key(body: KeyCreate) -> dict[str, Any]:
        if body.expires_in_s is not None and body.expires_at is not None:
            raise GatewayError(
                400, "give expires_in_s or expires_at, not both", code="invalid_request", param="expires_in_s"
            )
        expires_at = body.expires_at
        if body.expires_in_s is not None:
            expires_at = datetime.now(UTC) + timedelta(seconds=body.expires_in_s)
        info, plaintext = await store.create_key(
            body.tenant,
            name=body.name,
            expires_at=expires_at,
            limits=body.limits.to_limits() if body.limits else Limits(),
        )
        return {"key": plaintext, **info.to_dict()}

    @router.get("/keys")
    async def list_keys(
        tenant: Annotated[str | None, Query(max_length=63)] = None,
    ) -> dict[str, Any]:
        return {"object": "list", "data": [k.to_dict() for k in await store.list_keys(tenant)]}

    async def revoke(key_id: str) -> dict[str, Any]:
        info = await store.revoke_key(key_id)
        if on_revoke is not None:
            on_revoke(info.key_id)
        return info.to_dict()

    router.add_api_route("/keys/{key_id}/revoke", revoke, methods=["POST"])
    router.add_api_route("/keys/{key_id}", revoke, methods=["DELETE"])
    return router
