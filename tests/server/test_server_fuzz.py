"""A bounded schemathesis fuzz of the control plane from its own OpenAPI document: whatever the request,
the answer is never a 5xx, and every error has E2B's shape `{"code": N, "message": "..."}`.

Generated sandbox ids and template names do not exist, so nothing here creates a sandbox; the calls
exercise validation, lookup and error mapping (10 examples per operation)."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from agentenv.server.openapi import document

pytestmark = [pytest.mark.docker]

schema = schemathesis.openapi.from_dict(document())


@schema.parametrize()
@settings(max_examples=10, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck), derandomize=True)
def test_control_plane_never_fails_with_5xx(case, server):
    response = case.call(base_url=server.url, headers={"X-API-Key": server.api_key}, timeout=60)
    assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code} " \
                                       f"{response.text[:300]}"
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"code", "message"} and body["code"] == response.status_code, body
        assert isinstance(body["message"], str) and body["message"], body
