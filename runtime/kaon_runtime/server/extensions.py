"""The unknown request fields we ignore, and how a client still sees them. (vLLM's extensions that
we implement are fields of the protocol's models, which turn them into SamplingParams: protocol.py.)

Unknown top-level fields are ignored, as vLLM does, so clients that send extensions of their
own still work. A typo must stay visible, though: each such name is logged once (not once per
request: a client sending it on every call would flood the log) and every response to a request
that carried any lists them in the x-kaon-ignored-fields header.
"""
from __future__ import annotations

import logging
import re

from pydantic import BaseModel

IGNORED_FIELDS_HEADER = "x-kaon-ignored-fields"
FIELD_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # what a field name in the header may be
MAX_LOGGED_NAMES = 1000  # a client inventing names on every call must not grow this set without end

log = logging.getLogger("kaon.server")
_logged: set[str] = set()


def ignored_fields(body: BaseModel) -> list[str]:
    """The unknown top-level fields of a request, logged once per name."""
    names = sorted(body.model_extra or {})
    for name in names:
        if name not in _logged and len(_logged) < MAX_LOGGED_NAMES:
            _logged.add(name)
            log.warning("ignoring the unknown request field %r (this server does not implement it)", name[:100])
    return names


def ignored_fields_header(body: BaseModel) -> dict[str, str]:
    names = ignored_fields(body)
    # Only names that are plain tokens go in the header (the rest are still ignored): a header value
    # must not be empty around its commas nor start or end with a space (h11 refuses the response).
    shown = [n for n in names if FIELD_NAME.fullmatch(n)][:50]
    return {IGNORED_FIELDS_HEADER: ",".join(shown)} if shown else {}
