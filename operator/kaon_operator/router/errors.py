"""The router's own refusals, in OpenAI's error shape so clients raise their usual exceptions.

Errors from an engine are never built here: they pass through as the engine wrote them.
"""
from __future__ import annotations

import json

from aiohttp import web

RETRY_AFTER_S = "1"


class RouterError(Exception):
    def __init__(self, status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
                 retry: bool = False):
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param, self.retry = \
            status, message, type_, code, param, retry

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.Response(status=self.status, text=json.dumps(self.body()), content_type="application/json",
                            headers={"Retry-After": RETRY_AFTER_S} if self.retry else None)


def bad_request(message: str, param: str | None = None) -> RouterError:
    return RouterError(400, message, "invalid_request_error", param=param)


def too_large(limit: int) -> RouterError:
    return RouterError(413, f"the request body is larger than {limit} bytes", "invalid_request_error",
                       "request_too_large")


def model_not_found(model: str) -> RouterError:
    return RouterError(404, f"the model `{model}` does not exist: no InferenceService serves it "
                            "(GET /v1/models lists the served names)", "invalid_request_error", "model_not_found",
                       "model")


def starting() -> RouterError:
    return RouterError(503, "the router is starting and has not read the InferenceServices yet; retry",
                       "service_unavailable", "router_starting", retry=True)


def no_ready_replica(model: str, service: str, waited: float) -> RouterError:
    return RouterError(503, f"no ready replica of InferenceService {service} (model `{model}`) within "
                            f"{waited:g}s: it is scaling up from zero or its pods are not ready yet; retry later",
                       "service_unavailable", "no_ready_replica", retry=True)


def queue_full(model: str, service: str, limit: int) -> RouterError:
    return RouterError(503, f"InferenceService {service} (model `{model}`) has no ready replica and {limit} "
                            "requests already wait for one; retry later", "service_unavailable", "queue_full",
                       retry=True)


def upstream_unreachable(service: str, attempts: int) -> RouterError:
    return RouterError(502, f"could not connect to a replica of InferenceService {service} "
                            f"({attempts} tried)", "server_error", "upstream_unreachable", retry=True)


def upstream_failed(service: str, pod: str, reason: str) -> RouterError:
    return RouterError(502, f"replica {pod} of InferenceService {service} failed before answering: {reason}",
                       "server_error", "upstream_failed")
