"""Errors in OpenAI's shape — ``{"error": {"message", "type", "param", "code"}}`` — and the
exception handlers that give each failure its HTTP status.

  400 invalid parameters, malformed JSON, wrong types, a prompt longer than the context
  401 missing or wrong API key          404 unknown model or route
  408 the request timed out in the queue 413 body too large
  429 queue limits reached (Retry-After) 503 the engine is dead
A bug is a 500 with a generic message; bad input never is.
"""
from __future__ import annotations

import logging
import re
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from llmtower.core.errors import AdmissionError, QueueFullError
from llmtower.engine.async_llm import RequestTimeoutError, ServerShuttingDownError
from llmtower.engine.core_client import EngineDeadError, EngineLostError

logger = logging.getLogger(__name__)

# Seconds a client is told to wait after a 429: about the time a busy queue needs to move.
RETRY_AFTER_S = 1

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 409: "conflict_error",
    405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
    429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable_error",
}


class APIError(Exception):
    """An error with its HTTP status and OpenAI error fields, raised by the handlers."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status_code: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status_code, "error"),
                      "param": param, "code": code}}


def error_response(status_code: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, param, code), status_code=status_code,
                        headers=headers)


def to_api_error(exc: BaseException) -> APIError:
    """The HTTP form of any exception a handler or the engine may raise."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineLostError):
        return APIError(str(exc), 503, code="engine_unavailable",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return APIError(f"the engine is not running: {exc}", 503, code="engine_dead")
    if isinstance(exc, ServerShuttingDownError):
        return APIError(str(exc), 503, code="server_shutting_down")
    if isinstance(exc, QueueFullError):
        return APIError(str(exc), 429, code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, RequestTimeoutError):
        return APIError(str(exc), 408, code="request_timeout")
    if isinstance(exc, AdmissionError):
        return APIError(str(exc), 400, code="context_length_exceeded")
    if isinstance(exc, ValueError):
        return APIError(str(exc), 400, param=_param_of(str(exc)))
    if isinstance(exc, OverflowError):  # a number too large for the engine's wire or torch
        return APIError(f"a number in the request is out of range: {exc}", 400)
    logger.error("internal error", exc_info=exc)
    return APIError(f"internal server error ({type(exc).__name__}); see the server log", 500)


def _param_of(message: str) -> str | None:
    """Our ValueErrors start with 'name=value ...': that name is the offending parameter."""
    m = re.match(r"(\w+)=", message)
    return m.group(1) if m else None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return ("the request body is not valid JSON: "
                    f"{err.get('ctx', {}).get('error', err.get('msg'))}", None)
        where = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        parts.append(f"{where}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts[:5]), param


def install_exception_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        status = exc.status_code
        message = exc.detail if isinstance(exc.detail, str) else HTTPStatus(status).phrase
        if status == 404 and message == "Not Found":
            message = f"no route {request.method} {request.url.path}"
        return error_response(status, message, headers=getattr(exc, "headers", None))

    async def _known(_request: Request, exc: Exception):
        err = to_api_error(exc)
        return error_response(err.status_code, err.message, err.param, err.code, err.headers)

    # Registered one by one: a handler for plain Exception runs in Starlette's outermost
    # middleware, which logs and re-raises even after answering.
    for exc_type in (APIError, EngineDeadError, QueueFullError, RequestTimeoutError,
                     AdmissionError, ValueError, ServerShuttingDownError, OverflowError):
        app.add_exception_handler(exc_type, _known)
    app.add_exception_handler(Exception, _known)
