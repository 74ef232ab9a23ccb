"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the
status OpenAI's API gives for the same problem, so clients raise their usual exceptions
(`openai.BadRequestError`, `AuthenticationError`, `NotFoundError`, ...)."""

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

    def response(self) -> JSONResponse:
        return error_response(
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


def error_response(
    status: int,
    message: str,
    *,
    kind: str = INVALID_REQUEST,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(message, kind, code, param), status_code=status, headers=headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)
