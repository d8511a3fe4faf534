"""Errors of the OpenAI-compatible API, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every message says what to do next; the status is the one OpenAI's clients expect (their
SDKs turn 400/401/404/429/5xx into their own exception classes).
"""

from __future__ import annotations

from django.http import JsonResponse

# Board errors that start like this are the context check of inference.serving.run.context_error.
CONTEXT_ERROR_START = "the prompt has "
CONTEXT_ERROR_MARK = "but the context holds"


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JsonResponse:
        response = JsonResponse(self.body(), status=self.status)
        for name, value in self.headers.items():
            response[name] = value
        return response


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def board_error(message: str, *, param: str | None, device: str) -> ApiError:
    """The error a board reported for a run, with the status that fits it."""
    if message.startswith(CONTEXT_ERROR_START) and CONTEXT_ERROR_MARK in message:
        return ApiError(
            400,
            f"This model's context is too small for the request: {message}",
            param=param,
            code="context_length_exceeded",
        )
    if message.startswith("the board failed"):
        return ApiError(
            500,
            f"Board {device!r} failed while answering: {message}. Try again; if it persists, look at the board's log.",
            type="server_error",
            code="board_failed",
        )
    if message.startswith("refused by the board"):
        return ApiError(
            502,
            f"Board {device!r} refused the request ({message}); is it running an older version? Restart it from this version.",
            type="server_error",
            code="board_refused",
        )
    if message.startswith("expired"):
        return ApiError(504, f"No board started the run in time: {message}", type="server_error", code="board_timeout")
    return ApiError(400, f"Board {device!r} could not run this prompt: {message}", param=param)
