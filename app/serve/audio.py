"""`POST /v1/audio/transcriptions` (not built yet: the router has no routes)."""

from __future__ import annotations

from fastapi import APIRouter


def audio_router(served, options) -> APIRouter:
    return APIRouter()
