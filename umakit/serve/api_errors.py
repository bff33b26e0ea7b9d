"""Every HTTP error umakit serve answers, in OpenAI's shape by default (`APIError`)."""

from __future__ import annotations

# status -> (OpenAI error type, default code)
ERROR_TYPES = {
    400: ("invalid_request_error", None),
    401: ("invalid_request_error", "invalid_api_key"),
    404: ("invalid_request_error", "model_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_exceeded"),
    500: ("server_error", None),
    503: ("server_error", "unavailable"),
    504: ("server_error", "timeout"),
}


def internal(e: BaseException, request_id: str | None = None, what: str = "internal error") -> str:
    """What an answer says of a failure of umakit's own: its kind, never its text (which may carry paths, device
    details or a user's data); the caller logs the traceback, which the message points to."""
    where = f" (request {request_id})" if request_id else ""
    return f"{what} ({type(e).__name__}); the server's log has the details{where}"


class APIError(Exception):
    """An HTTP error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        kind, default_code = ERROR_TYPES.get(status, ERROR_TYPES[500 if status >= 500 else 400])
        self.type, self.code = kind, code if code is not None else default_code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
