"""`GET /metrics` (not built yet: the router has no routes)."""

from __future__ import annotations

from fastapi import APIRouter


def metrics_router(served, options) -> APIRouter:
    return APIRouter()
