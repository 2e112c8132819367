"""The HTTP API's errors: OpenAI's `{"error": {message, type, param, code}}`. Torch-free."""

from __future__ import annotations


class ApiError(Exception):
    """An error answered as OpenAI's `{"error": {message, type, param, code}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, param, "invalid_value" if param else None)
