"""Exceptions a caller can act on. Anything else is a bug."""


class KaonError(Exception):
    """Base class of every error kaon raises on purpose."""


class InvalidRequestError(KaonError, ValueError):
    """The request itself is wrong (bad parameter, prompt too long, ...)."""


class ModelNotFoundError(KaonError, LookupError):
    """The model id does not name anything we can load."""


class ModelLoadError(KaonError):
    """The model exists but cannot be loaded (corrupt file, unsupported architecture)."""
