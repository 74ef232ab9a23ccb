"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the
status OpenAI's API gives for the same problem, so clients raise their usual exceptions
(`openai.BadRequestError`, `AuthenticationError`, `NotFoundError`, ...).

Under Anthropic's paths (/v1/messages...) the same errors take Anthropic's shape instead,
`{"type": "error", "error": {"type", "message"}}` with its types for each status, so that
the `anthropic` client raises its own exceptions (`shaped_response`)."""

from __future__ import annotations

from fastapi.responses import JSONResponse

INVALID_REQUEST = "invalid_request_error"


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = INVALID_REQUEST,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.code, self.param, self.headers = code, param, headers

    def response(self, path: str = "") -> JSONResponse:
        return shaped_response(
            path,
            self.status,
            self.message,
            kind=self.kind,
            code=self.code,
            param=self.param,
            headers=self.headers,
        )

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.code, self.param)


def error_body(
    message: str, kind: str = INVALID_REQUEST, code: str | None = None, param: str | None = None
) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


ANTHROPIC_PATHS = "/v1/messages"
# Anthropic's error type for each status (its API documents these); others are api_error.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_body(status: int, message: str) -> dict:
    kind = ANTHROPIC_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def shaped_response(
    path: str,
    status: int,
    message: str,
    *,
    kind: str = INVALID_REQUEST,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """The error in the shape of the API that `path` belongs to (OpenAI's, or Anthropic's
    under /v1/messages)."""
    if path.startswith(ANTHROPIC_PATHS):
        body = anthropic_body(status, message)
    else:
        body = error_body(message, kind, code, param)
    return JSONResponse(body, status_code=status, headers=headers)


def error_response(status: int, message: str, **fields) -> JSONResponse:
    """The error in OpenAI's shape."""
    return shaped_response("", status, message, **fields)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)
