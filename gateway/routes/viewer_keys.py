"""Viewer keys (admin): read-only keys for the /ui pages, created, listed and revoked over the API.

A key is shown once, when created; the store keeps its SHA-256. Revoking ends its signed-in /ui cookies in
the same transaction. A viewer key opens only /ui (gateway/viewer_auth.py); every other route answers it 403.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from gateway.auth import admin
from gateway.protocol import Strict
from gateway.routes.common import json_response, read_body
from gateway.services import services

router = APIRouter()


class CreateViewerKey(Strict):
    name: str = Field(default="viewer", min_length=1, max_length=200)
    """Who or what the key is for: shown in GET /v1/viewer_keys, so a key can be found and revoked."""


@router.post("/v1/viewer_keys")
async def create(request: Request) -> Response:
    await admin(request)
    body = await read_body(request, CreateViewerKey)
    return json_response(await services(request).store.create_viewer_key(body.name), 201)


@router.get("/v1/viewer_keys")
async def list_keys(request: Request) -> Response:
    await admin(request)
    return json_response({"data": await services(request).store.list_viewer_keys()})


@router.delete("/v1/viewer_keys/{key_id}")
async def revoke(request: Request, key_id: str) -> Response:
    await admin(request)
    return json_response({**await services(request).store.revoke_viewer_key(key_id), "revoked": True})
