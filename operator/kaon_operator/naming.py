"""Which InferenceService a request's `model` names: the addressing scheme, as pure functions.

A `model` is read in this order, and the first reading that some InferenceService answers is
the only one (served names before adapters within each reading):

1. A name served in the router's **default namespace**, as is: `llama-3`, and also
   `meta-llama/Llama-3.1-8B-Instruct` (a served name may hold a `/`).
2. `<namespace>/<served-name>`: the one of that namespace serving that name.
3. With `--cluster-wide-names`: a bare name served in another namespace (the oldest holder),
   but never a name whose part before the first `/` could be a namespace (reading 2 owns
   those), so that no namespace's `<namespace>/...` can be answered by another's, nor a name
   the default namespace holds otherwise (`reserved`: its InferenceRoutes' names, which the
   router tries after the InferenceServices' readings).

Why the default namespace comes first: a namespace's name is chosen by whoever creates it, and
the qualified reading used to come first, so the owner of a namespace called `meta-llama` took
`meta-llama/Llama-3.1-8B-Instruct` served from the default namespace (and the Authorization
header sent for it). Now a name the default namespace serves is never read as qualified, so no
namespace can take it; the default namespace is the admin's catalog and must be writable only
by whoever may name it. A namespace's own `<namespace>/<name>` is reachable unless the default
namespace serves that very string (then that InferenceService gets no traffic: `shadowed`).

Two InferenceServices of one namespace serving one name: the older (by creationTimestamp,
then name) answers it; the later one is reported as conflicting, never silently shadowing.
Used by the router (resolution) and the operator (the NameConflict condition: `conflicts`).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
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


def could_be_namespace(name: str) -> bool:
    """Whether `name` is a valid namespace name (an RFC 1123 label): only such a prefix makes a
    `model` qualified."""
    return 0 < len(name) <= 63 and name.isascii() and name[0].isalnum() and name[-1].isalnum() \
        and all(c.islower() or c.isdigit() or c == "-" for c in name)


def readings(model: str, default_namespace: str, cluster_wide: bool,
             reserved: frozenset[str] = frozenset()) -> list[tuple[str | None, str]]:
    """The (namespace, served name) pairs `model` may mean, in the order they are tried; a None
    namespace is the cluster-wide reading (any namespace), never for a `reserved` name (one the
    default namespace holds as an InferenceRoute: another namespace's service must not take it)."""
    namespace, slash, rest = model.partition("/")
    out: list[tuple[str | None, str]] = [(default_namespace, model)]
    if slash and could_be_namespace(namespace):
        out.append((namespace, rest))
    elif cluster_wide and model not in reserved:
        out.append((None, model))
    return out


def resolve(model: str, names: Names | Sequence[Names], default_namespace: str, cluster_wide: bool,
            reserved: frozenset[str] = frozenset()) -> Named | None:
    """The one InferenceService (or adapter) `model` names, from one index or several (served
    names, then adapters): each reading is tried in every index before the next reading."""
    layers = (names,) if isinstance(names, Names) else tuple(names)
    for namespace, name in readings(model, default_namespace, cluster_wide, reserved):
        for layer in layers:
            found = layer.global_.get(name) if namespace is None else layer.qualified.get((namespace, name))
            if found is not None:
                return found
    return None


def addressable(names: Names, default_namespace: str, cluster_wide: bool,
                among: Sequence[Names] = (), reserved: frozenset[str] = frozenset()) -> list[tuple[str, Named]]:
    """Each answering InferenceService once, under the shortest `model` that reaches it: its bare
    served name where that resolves to it, else `namespace/name` (sorted by that). One that no
    name reaches (the default namespace serves its `namespace/name`) is left out. `among`: the
    indexes resolution reads (default: `names` alone)."""
    layers = tuple(among) or (names,)
    out = []
    for (namespace, name), s in names.qualified.items():
        for candidate in (name, f"{namespace}/{name}"):
            if resolve(candidate, layers, default_namespace, cluster_wide, reserved) is s:
                out.append((candidate, s))
                break
    return sorted(out, key=lambda pair: pair[0])


def shadowed(services: Iterable[Named], default_namespace: str) -> dict[Key, Named]:
    """InferenceService key -> the one of the default namespace whose served name is this one's
    `namespace/name`, which therefore never reaches it (reading 1 before reading 2)."""
    names = index(services := list(services))
    return {s.key: winner for s in services if s.key[0] != default_namespace
            and (winner := names.qualified.get((default_namespace, f"{s.key[0]}/{s.served_name}"))) is not None}


def conflicts(services: Iterable[Named]) -> dict[Key, Named]:
    """InferenceService key -> the older one of its namespace that answers its served name in its
    place. Empty for the ones that answer their own name."""
    names = index(services := list(services))
    return {s.key: winner for s in services
            if (winner := names.qualified[(s.key[0], s.served_name)]) is not s}
