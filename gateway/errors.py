"""Errors of the gateway: the lanes' OpenAI shape (``{"error": {message, type, param, code}}``).

:class:`APIError` and the body/response builders are the lanes' own (one shape for the whole
system); the middleware here turns APIError, aiohttp HTTP exceptions and unexpected
exceptions (500, traceback to the server log only) into that shape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from lanes.errors import HTTP_CODES, APIError, error_body, error_response, http_exception_response

__all__ = ["APIError", "error_body", "error_middleware", "error_response"]

log = logging.getLogger("strata.gateway")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

ERROR_CODE = web.RequestKey("strata_gateway_error_code", str)  # what the access log reports


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as e:
        request[ERROR_CODE] = e.code or e.type
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = HTTP_CODES.get(e.status, "http_error")
        request[ERROR_CODE] = code
        return http_exception_response(request, e)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        request[ERROR_CODE] = "internal_error"
        return error_response(500, "internal server error", code="internal_error")
