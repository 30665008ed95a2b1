"""Which InferenceService a request's `model` names: the addressing scheme, as pure functions.

- `<namespace>/<served-name>` names the InferenceService of that namespace serving that name.
- A bare `<served-name>` names the one in the router's default namespace; only when the admin
  allows cluster-wide names (`--cluster-wide-names`) does it also name one in another served
  namespace (the oldest, when several namespaces serve it).
- Two InferenceServices of one namespace serving one name: the older (by creationTimestamp,
  then name) answers it; the later one is reported as conflicting, never silently shadowing.

The qualified form is tried first: a namespace name cannot hold a `/`, a served name can
(`Qwen/Qwen2.5-7B`), so such a name still resolves as a bare one when no namespace matches.
Used by the router (resolution) and the operator (the NameConflict condition).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, Protocol

from kaon_operator.api import Key


class Named(Protocol):
    @property
    def key(self) -> Key: ...

    @property
    def served_name(self) -> str: ...

    @property
    def created(self) -> int: ...


class Names(NamedTuple):
    """The name indexes: (namespace, served name) -> the one answering it, and served name ->
    the oldest of each namespace's answering ones (for cluster-wide bare names)."""

    qualified: dict[tuple[str, str], Named]
    global_: dict[str, Named]


def _age(s: Named) -> tuple:
    return s.created, tuple(s.key)


def index(services: Iterable[Named]) -> Names:
    qualified: dict[tuple[str, str], Named] = {}
    global_: dict[str, Named] = {}
    for s in sorted(services, key=_age):
        qualified.setdefault((s.key[0], s.served_name), s)
        global_.setdefault(s.served_name, s)
    return Names(qualified, global_)


def resolve(model: str, names: Names, default_namespace: str, cluster_wide: bool) -> Named | None:
    namespace, slash, rest = model.partition("/")
    if slash and (found := names.qualified.get((namespace, rest))) is not None:
        return found
    if (found := names.qualified.get((default_namespace, model))) is not None:
        return found
    return names.global_.get(model) if cluster_wide else None


def addressable(names: Names, default_namespace: str, cluster_wide: bool) -> list[tuple[str, Named]]:
    """Each answering InferenceService once, under the shortest `model` that reaches it: its bare
    served name where that resolves to it, else `namespace/name` (sorted by that)."""
    out = []
    for (namespace, name), s in names.qualified.items():
        bare = resolve(name, names, default_namespace, cluster_wide) is s
        out.append((name if bare else f"{namespace}/{name}", s))
    return sorted(out, key=lambda pair: pair[0])


def conflicts(services: Iterable[Named]) -> dict[Key, Named]:
    """InferenceService key -> the older one of its namespace that answers its served name in its
    place. Empty for the ones that answer their own name."""
    names = index(services := list(services))
    return {s.key: winner for s in services
            if (winner := names.qualified[(s.key[0], s.served_name)]) is not s}
