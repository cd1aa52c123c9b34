"""Errors of the gateway: the shared OpenAI shape (``{"error": {message, type, param, code}}``,
common/errors.py), the same for the lanes and the gateway.

:data:`error_middleware` turns APIError, aiohttp HTTP exceptions and unexpected exceptions
(500, traceback to the server log only) into that shape and notes the code under
:data:`ERROR_CODE` for the access log.
"""

from __future__ import annotations

import logging

from aiohttp import web

from common.errors import APIError, error_body, error_response, make_error_middleware

__all__ = ["ERROR_CODE", "APIError", "error_body", "error_middleware", "error_response"]

log = logging.getLogger("strata.gateway")

ERROR_CODE = web.RequestKey("strata_gateway_error_code", str)  # what the access log reports


def _note(request: web.Request, code: str, param: str | None) -> None:
    request[ERROR_CODE] = code


error_middleware = make_error_middleware(log, _note)
