"""The x-kaon-ignored-fields header: whatever names a client invents, the response stays valid HTTP.

The router's fuzzing found a body with the fields "" and " " (and names made of control and
surrogate characters) answered by a dropped connection: the header's value was ", ", which h11
refuses, so uvicorn closed the socket instead of answering.
"""
from __future__ import annotations

import json

import h11
from pydantic import BaseModel, ConfigDict

from kaon_runtime.server.extensions import IGNORED_FIELDS_HEADER, ignored_fields_header


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = "m"


def parsed(fields: dict) -> Body:
    """The body as the server parses it: from JSON text (escaped surrogate pairs and all)."""
    return Body.model_validate_json(json.dumps(fields))


def valid_response_with(headers: dict[str, str]) -> bool:
    try:
        h11.Response(status_code=200, headers=list(headers.items()))
    except h11.LocalProtocolError:
        return False
    return True


def test_odd_field_names_never_make_an_invalid_header():
    odd = ["", " ", "\x7f\x01", "a,b", "\r\n", "tab\there", "\N{GRINNING FACE}", "x" * 65, " lead", "trail "]
    for name in odd:
        headers = ignored_fields_header(parsed({name: 1}))
        assert valid_response_with(headers), (name, headers)
        assert headers == {}, (name, headers)
    mixed = ignored_fields_header(parsed({"": None, " ": {}, "top_n": 1, "frobnicate": 2}))
    assert mixed == {IGNORED_FIELDS_HEADER: "frobnicate,top_n"}
    assert valid_response_with(mixed)
