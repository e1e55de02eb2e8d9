"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Route handlers and the request parsers raise `ApiError`; the app turns it (and FastAPI's own request
errors) into that body, so a client SDK raises its usual exception and a bad request never shows a
traceback.
"""

from __future__ import annotations

from starlette.responses import JSONResponse


class ApiError(Exception):
    """A refused request: ``param`` names the offending field (None when no one field is at fault)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def unknown_model(asked: str, served: str, status: int = 400) -> ApiError:
    """A model the gateway does not serve (``code`` model_not_found): a bad field of a request body is a
    400 naming ``model``; ``GET /v1/models/{id}`` of an unknown one is a 404, as OpenAI's."""
    return ApiError(f"the model {asked!r} is not served here; the served policy is {served!r}", "model",
                    status=status, code="model_not_found")  # fmt: skip
