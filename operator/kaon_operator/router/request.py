"""What the router takes from a client's request: its `model`, the body the engine gets, and
the headers passed on. Pure functions."""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence

import msgspec
from multidict import CIMultiDict, CIMultiDictProxy

from kaon_operator.router import errors

# RFC 9110 7.6.1: these, and every field the Connection header names, describe one connection only.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "trailers", "transfer-encoding", "upgrade"})
# The body is already read (and any 100-continue answered); aiohttp sets the length itself.
NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "expect"}


def parse_request(body: bytes) -> tuple[str, dict]:
    """The `model` field of an OpenAI request body, and the body."""
    try:
        # msgspec's decoder, about 7x json.loads on a request's body (py-spy: parsing was ~2% of the router's CPU).
        # It refuses what json.loads reads beyond the standard (NaN, Infinity, a lone surrogate, a float past the
        # double range, an encoded surrogate): those, and every malformed body, are read again by json.loads, so
        # the payload and each refusal's message stay json's. Where both read a body, they read it alike: ints of
        # any size stay ints (not floats, as orjson makes them), the last of duplicate keys wins.
        payload = _DECODER.decode(body)
    except (msgspec.MsgspecError, ValueError, RecursionError):
        payload = _json_payload(body)
    if not isinstance(payload, dict):
        raise errors.bad_request("the request body must be a JSON object")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise errors.bad_request("`model` is required and must be a string", param="model")
    return model, payload


_DECODER = msgspec.json.Decoder()


def _json_payload(body: bytes) -> object:
    try:
        # UTF-8 only (RFC 8259 8.1): json.loads would take UTF-16 and UTF-32 too, which json_cost's scan misreads.
        payload = json.loads(body.decode("utf-8", "surrogatepass"))
    except UnicodeDecodeError:
        raise errors.bad_request("the request body is not valid JSON: it is not UTF-8") from None
    except RecursionError:  # deeper than the interpreter's stack allows (about a thousand levels)
        raise too_deep() from None
    except ValueError as exc:
        raise errors.bad_request(f"the request body is not valid JSON: {exc}") from None
    return payload


def engine_body(body: bytes, payload: dict, model: str, served_name: str) -> bytes:
    """The body to send: with `model` rewritten to the served name when the client addressed
    the service otherwise (`namespace/name`), since the engine answers only that. The JSON is
    rebuilt only then; a bare name goes on byte for byte."""
    if served_name == model:
        return body
    payload["model"] = served_name
    try:
        return json.dumps(payload, ensure_ascii=False).encode()
    except UnicodeEncodeError:  # a lone surrogate (a valid JSON escape, no UTF-8): sent escaped, as it came
        return json.dumps(payload).encode()
    except RecursionError:  # parsed just within the stack's depth, one level short of it to encode
        raise too_deep() from None


def too_deep() -> errors.RouterError:
    return errors.bad_request("the request body nests JSON arrays or objects too deeply")


def connection_options(headers: Mapping[str, str]) -> frozenset[str]:
    """The fields a `Connection` header names (`Connection: close, X-Foo`): they are for the next
    hop only, whatever their names (RFC 9110 7.6.1)."""
    values = headers.getall("Connection", ()) if isinstance(headers, CIMultiDict | CIMultiDictProxy) \
        else [headers.get("Connection", "")]
    return frozenset(token.strip().lower() for value in values for token in value.split(",") if token.strip())


# A client's credentials and what it says of itself: they go to no pod (an open one has asked for
# none, and a pod runs a tenant's code), except a keyed service's own key (upstream_headers).
# Beside the usual names, the tokens other gateways and clouds send (X-Auth-Token, AWS's session token,
# Google's API key) and the client addresses CDNs and proxies write (True-Client-IP, CF-Connecting-IP, ...).
CREDENTIALS = frozenset({"authorization", "proxy-authorization", "cookie", "cookie2", "x-api-key", "api-key",
                         "x-auth-token", "x-amz-security-token", "x-goog-api-key", "forwarded", "x-real-ip",
                         "x-client-ip", "true-client-ip", "cf-connecting-ip", "x-cluster-client-ip"})
CREDENTIAL_PREFIXES = ("x-forwarded-", "x-original-forwarded-")


def upstream_headers(headers: Mapping[str, str], authorization: str | None) -> CIMultiDict:
    """The headers an engine pod gets: the client's without hop-by-hop fields and without its
    credentials (cookies, Authorization, X-Forwarded-*). `authorization`: the client's header when
    the service is keyed and it holds one of that service's keys (auth.check), for the engine
    checks it too; an open service gets None, so no key at all."""
    out = forwarded(headers)
    for name in {k for k in out if k.lower() in CREDENTIALS or k.lower().startswith(CREDENTIAL_PREFIXES)}:
        del out[name]
    if authorization is not None:
        out["Authorization"] = authorization
    return out


def forwarded(headers: Mapping[str, str], dropped: frozenset[str] = NOT_FORWARDED) -> CIMultiDict:
    """The headers without those that describe one connection only (and, for a request, those
    the router's own connection sets)."""
    dropped = dropped | connection_options(headers)
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in dropped)


# The same rules on the raw fields (name and value bytes as aiohttp's parser and httptools give them):
# the hot path builds the engine's request head and the client's response headers from these in one
# pass, without a CIMultiDict per direction (tests/unit/operator/router/test_upstream.py checks that
# both ways agree).
_NOT_FORWARDED_RAW = frozenset(name.encode() for name in NOT_FORWARDED)
_HOP_BY_HOP_RAW = frozenset(name.encode() for name in HOP_BY_HOP)
_CREDENTIALS_RAW = frozenset(name.encode() for name in CREDENTIALS)
_CREDENTIAL_PREFIXES_RAW = tuple(prefix.encode() for prefix in CREDENTIAL_PREFIXES)


def _connection_options_raw(fields: Sequence[tuple[bytes, bytes]]) -> frozenset[bytes]:
    return frozenset(token.strip().lower() for name, value in fields if name.lower() == b"connection"
                     for token in value.split(b",") if token.strip())


# A field name as a client spelled it -> KEEP, DROP or CONNECTION (the field that names more to drop). Names only,
# never values, so nothing a client sends as a credential is kept; bounded, as a client may invent names.
KEEP, DROP, CONNECTION = 0, 1, 2
_VERDICTS: dict[bytes, int] = {}
_MOST_VERDICTS = 4096


def _verdict(name: bytes) -> int:
    lower = name.lower()
    verdict = CONNECTION if lower == b"connection" else \
        DROP if lower in _NOT_FORWARDED_RAW or lower in _CREDENTIALS_RAW or lower.startswith(_CREDENTIAL_PREFIXES_RAW) \
        else KEEP
    if len(_VERDICTS) < _MOST_VERDICTS:
        _VERDICTS[name] = verdict
    return verdict


def upstream_fields(fields: Sequence[tuple[bytes, bytes]], authorization: str | None) -> list[bytes]:
    """upstream_headers on the client's raw fields, as the lines of the engine's request head."""
    out = []
    for name, value in fields:  # each name's verdict once per spelling (_VERDICTS), not a lower() per request
        verdict = _VERDICTS.get(name)
        if verdict is None:
            verdict = _verdict(name)
        if verdict == KEEP:
            out.append(name + b": " + value + b"\r\n")
        elif verdict == CONNECTION:  # rare: the fields it names are dropped too
            return _upstream_fields_naming(fields, authorization)
    if authorization is not None:
        out.append(b"Authorization: " + authorization.encode("utf-8", "surrogateescape") + b"\r\n")
    return out


def _upstream_fields_naming(fields: Sequence[tuple[bytes, bytes]], authorization: str | None) -> list[bytes]:
    """upstream_fields when a Connection field names more fields to drop."""
    dropped = _NOT_FORWARDED_RAW | _CREDENTIALS_RAW | _connection_options_raw(fields)
    out = [name + b": " + value + b"\r\n" for name, value in fields
           if (lower := name.lower()) not in dropped and not lower.startswith(_CREDENTIAL_PREFIXES_RAW)]
    if authorization is not None:
        out.append(b"Authorization: " + authorization.encode("utf-8", "surrogateescape") + b"\r\n")
    return out


def response_headers(fields: Sequence[tuple[bytes, bytes]], drop_length: bool = False) -> CIMultiDictProxy:
    """forwarded(headers, HOP_BY_HOP) on an engine's raw response fields; without Content-Length
    when the body is sent whole (the server sets it). The same fields (an engine's answers differ by
    their Date once a second, and by Content-Length) give the same headers: they are kept
    (_response_headers), so the result is shared and read-only: copy it to change it (aiohttp's
    Response copies what it is given)."""
    return _response_headers(tuple(fields), drop_length)


@functools.lru_cache(maxsize=256)  # an engine's fields only: no client credential is kept here
def _response_headers(fields: tuple[tuple[bytes, bytes], ...], drop_length: bool) -> CIMultiDictProxy:
    dropped = _HOP_BY_HOP_RAW | {b"content-length"} if drop_length else _HOP_BY_HOP_RAW
    if any(name.lower() == b"connection" for name, _ in fields):
        dropped = dropped | _connection_options_raw(fields)
    return CIMultiDictProxy(CIMultiDict((name.decode("latin-1"), value.decode("latin-1")) for name, value in fields
                                        if name.lower() not in dropped))


def response_lines(fields: Sequence[tuple[bytes, bytes]]) -> tuple[bytes, bool]:
    """response_headers(fields, drop_length=True) as the lines of the router's own server's answer head (front.Whole),
    and whether a Date is among them: the engine's bytes as they came, with no CIMultiDict nor str in between."""
    return _response_lines(tuple(fields))


@functools.lru_cache(maxsize=256)  # an engine's fields only, as _response_headers
def _response_lines(fields: tuple[tuple[bytes, bytes], ...]) -> tuple[bytes, bool]:
    dropped = _HOP_BY_HOP_RAW | {b"content-length"}
    if any(name.lower() == b"connection" for name, _ in fields):
        dropped = dropped | _connection_options_raw(fields)
    kept = [(name, value) for name, value in fields if name.lower() not in dropped]
    return b"".join(name + b": " + value + b"\r\n" for name, value in kept), any(n.lower() == b"date" for n, _ in kept)
