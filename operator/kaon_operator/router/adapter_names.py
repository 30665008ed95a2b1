"""LoRA adapters as names a request's `model` may take: `<adapter>` or `<namespace>/<adapter>`,
under the same rules as served names (naming.py: the default namespace, cluster-wide names when
allowed). The endpoint table indexes them after the served names, so a served name wins."""
from __future__ import annotations

import logging
from typing import NamedTuple

from pydantic import ValidationError

from kaon_operator import api

logger = logging.getLogger("kaon.router.endpoints")


class AdapterName(NamedTuple):
    """An adapter as naming.index takes it (naming.Named): it answers for its InferenceService."""

    key: api.Key
    served_name: str
    created: int


def valid(key: object, adapters: object) -> tuple[str, ...]:
    """The names of spec.adapters' valid entries (one the apiserver would refuse is left out, and logged)."""
    names = []
    for entry in adapters if isinstance(adapters, list) else ():
        try:
            names.append(api.AdapterSpec.model_validate(entry).name)
        except ValidationError as exc:
            logger.warning("InferenceService %s: an entry of spec.adapters is not valid, so it is not routed: %s",
                           key, exc)
    return tuple(names)
