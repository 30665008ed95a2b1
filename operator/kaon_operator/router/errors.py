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


def too_costly(message: str) -> RouterError:
    """A body within --max-body-bytes whose JSON would cost more to parse than the router allows."""
    return RouterError(413, message, "invalid_request_error", "request_too_large")


def invalid_api_key() -> RouterError:
    # OpenAI's own words and code for it, so clients raise AuthenticationError.
    return RouterError(401, "Incorrect API key provided.", "invalid_request_error", "invalid_api_key")


def model_not_found(model: str) -> RouterError:
    """No InferenceService serves `model` here, or none that this caller holds a key of (auth.check)."""
    return RouterError(404, f"the model `{model}` does not exist: no InferenceService serves it here "
                            "(`<namespace>/<name>` names one of another namespace; GET /v1/models lists the "
                            "names you may use)", "invalid_request_error", "model_not_found", "model")


def unknown_url(method: str, path: str, routes: tuple[str, ...]) -> RouterError:
    """A method and path the router forwards nowhere; OpenAI's words for it, and what it does forward."""
    return RouterError(404, f"Invalid URL ({method} {path}): the router forwards only POST "
                            f"{', '.join(routes)} (and answers GET /v1/models)", "invalid_request_error", "unknown_url")


def request_timeout(seconds: float) -> RouterError:
    return RouterError(408, f"the request body did not arrive within {seconds:g}s", "invalid_request_error",
                       "request_timeout")


def overloaded(what: str) -> RouterError:
    """A global limit of the router ran out (a request past it is not read): retry shortly."""
    return RouterError(503, f"the router is at its limit of {what}; retry shortly", "service_unavailable",
                       "router_overloaded", retry=True)


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


def replicas_asleep(service: str, attempts: int) -> RouterError:
    return RouterError(503, f"the replicas of InferenceService {service} that were tried are asleep (standby "
                            f"replicas the operator is putting to sleep; {attempts} tried)", "service_unavailable",
                       "engine_asleep", retry=True)


def upstream_failed(service: str, pod: str, reason: str) -> RouterError:
    return RouterError(502, f"replica {pod} of InferenceService {service} failed before answering: {reason}",
                       "server_error", "upstream_failed")


def upstream_timeout(service: str, pod: str, what: str, seconds: float, attempts: int = 1) -> RouterError:
    """A replica took longer than the router's limit: nothing came back in time."""
    tried = f" ({attempts} replicas tried)" if attempts > 1 else ""
    return RouterError(504, f"replica {pod} of InferenceService {service} sent no {what} within {seconds:g}s{tried}; "
                            "the engine may be overloaded or hung", "server_error", "upstream_timeout", retry=True)


def upstream_broke_off(service: str, pod: str, reason: str) -> RouterError:
    """Mid-stream: the replica stopped answering after the response had begun."""
    return RouterError(502, f"replica {pod} of InferenceService {service} broke off the response: {reason}",
                       "server_error", "upstream_failed")


def stream_event(error: RouterError) -> bytes:
    """The error as a server-sent event, the way OpenAI ends a stream that failed part way:
    its clients raise an APIError on a `data:` event with an `error` member."""
    return b"data: " + json.dumps(error.body()).encode() + b"\n\n"
