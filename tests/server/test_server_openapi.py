"""The control plane's OpenAPI document: served at /openapi.json, identical to the committed
docs/agentenv-openapi.json (regenerate with `python -m agentenv.server.openapi`), and complete."""

from __future__ import annotations

import json

import httpx
import pytest

from agentenv.server.openapi import DEFAULT_PATH, document

pytestmark = [pytest.mark.docker]

LIFECYCLE_PATHS = {"/sandboxes", "/v2/sandboxes", "/sandboxes/{sandbox_id}", "/sandboxes/{sandbox_id}/pause",
                   "/sandboxes/{sandbox_id}/connect", "/v2/sandboxes/{sandbox_id}/connect",
                   "/sandboxes/{sandbox_id}/resume", "/sandboxes/{sandbox_id}/timeout",
                   "/sandboxes/{sandbox_id}/refreshes", "/sandboxes/{sandbox_id}/fork",
                   "/sandboxes/{sandbox_id}/snapshots", "/snapshots", "/templates/{template_id}",
                   "/sandboxes/{sandbox_id}/metrics",
                   "/host", "/sandboxes/{sandbox_id}/agentenv",  # AgentENV's: placement, the CLI's view
                   "/sandboxes/{sandbox_id}/agentenv/move", "/agentenv/imports", "/agentenv/imports/check",
                   "/agentenv/imports/{move_id}"}  # and moves between hosts


def test_openapi_document_is_served_and_committed(server):
    served = httpx.get(server.url + "/openapi.json").json()
    assert served == document()
    assert json.loads(DEFAULT_PATH.read_text()) == served, \
        "docs/agentenv-openapi.json is stale: run `python -m agentenv.server.openapi`"
    assert set(served["paths"]) == LIFECYCLE_PATHS
    assert served["components"]["securitySchemes"]["APIKeyHeader"]["name"] == "X-API-Key"
