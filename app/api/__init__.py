"""The OpenAI-compatible HTTP API, served by the page's own FastAPI app (no second server)."""

from __future__ import annotations

from app.api.routes import ApiOptions, build_router
from app.api.worker import ReplyWorker
from app.service import Service

__all__ = ["ApiOptions", "mount"]


def mount(app, service: Service, options: ApiOptions) -> ReplyWorker:
    """Add the /v1 routes to `app` (Gradio's FastAPI app) ahead of Gradio's own routes, so no
    catch-all path of the page can shadow them. Returns the worker running their replies."""
    router, worker = build_router(service, options)
    before = len(app.router.routes)
    app.include_router(router)
    ours = app.router.routes[before:]
    del app.router.routes[before:]
    app.router.routes[:0] = ours
    return worker
