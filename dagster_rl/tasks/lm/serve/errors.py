"""The errors `dagster-rl serve` answers, in vLLM's format: `APIError` (a status, a message, vLLM's
error type, the field at fault), and `from_validation`, which words a pydantic `ValidationError` of
a request as one: a 400 naming the first field at fault."""

from http import HTTPStatus
from typing import Any

from pydantic import ValidationError


class APIError(Exception):
    """An error answered as vLLM answers it: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: HTTPStatus, message: str, err_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": int(self.status)}}


class AdapterLoadError(APIError):
    """A load refused, or failed: the server holds what it held before."""


# pydantic's error types of a request field, as this server words them: "<field> must be ..., got <value>"
_MUST_BE = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
}

# a field's bound (pydantic's `ge`, `gt`, `le`, `lt`), as this server words it
_BOUND = {
    "greater_than_equal": ("ge", "at least"),
    "greater_than": ("gt", "more than"),
    "less_than_equal": ("le", "at most"),
    "less_than": ("lt", "less than"),
}


def from_validation(error: ValidationError) -> APIError:
    """The first fault of a request's `ValidationError` as a 400 naming its field (`param`): the
    message a validator raised, or "<field> must be <type or bound>, got <value>" (its repr, cut at 200
    characters)."""
    first = error.errors()[0]
    ctx = first.get("ctx") or {}
    loc = first["loc"]
    param = str(ctx.get("param") or (loc[0] if loc else "")) or None
    value, error_type = first.get("input"), first["type"]
    if "message" in ctx:  # a validator's own message
        message = str(ctx["message"])
    elif error_type == "value_error":
        message = str(ctx.get("error", first["msg"]))
    elif error_type == "finite_number" or (
        error_type == "float_type" and isinstance(value, int) and not isinstance(value, bool)
    ):  # nan, inf, beyond float64
        message = f"{param} must be finite, got {str(value)[:50]}"
    elif error_type in _MUST_BE:
        message = f"{param} must be {_MUST_BE[error_type]}, got {repr(value)[:200]}"
    elif error_type in _BOUND:
        bound, words = _BOUND[error_type]
        message = f"{param} must be {words} {ctx[bound]}, got {repr(value)[:200]}"
    else:
        message = f"{param}: {first['msg']}, got {str(value)[:100]}"
    return APIError(HTTPStatus.BAD_REQUEST, message, param=param)
