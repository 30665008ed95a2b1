"""Exceptions a caller can act on. Anything else is a bug."""


class KaonError(Exception):
    """Base class of every error kaon raises on purpose."""

    code: str | None = None
    """The OpenAI error body's `code`, where one names this failure: a stream the error ends in-band says it too."""


class InvalidRequestError(KaonError, ValueError):
    """The request itself is wrong (bad parameter, prompt too long, ...). `code`: OpenAI's error code for
    the HTTP answer where it has one (context_length_exceeded)."""

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.code = code


class ModelNotFoundError(KaonError, LookupError):
    """The model id does not name anything we can load."""


class ModelLoadError(KaonError):
    """The model exists but cannot be loaded (corrupt file, unsupported architecture)."""


class ModelDoesNotFitError(ModelLoadError):
    """The model's shape cannot be split as asked (tensor_parallel_size does not divide its heads)."""


class UnsupportedByModelError(KaonError):
    """A `kaon serve` flag the model cannot take (a sentence encoder's --enable-runtime-lora, --role): refused
    at start. `kaon serve` says "unsupported by the model: ...", the words the operator reads in the pod's
    termination message (the condition UnsupportedByModel)."""


class QueueFullError(KaonError):
    """Too many requests are waiting already; retry later (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OverloadedError(KaonError):
    """Past capacity: the request would wait, or has waited, longer than the admission limit for its turn
    (engine.admission); retry after `retry_after_s` (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineDeadError(KaonError):
    """The engine loop stopped on an internal error; the process needs a restart."""

    code = "engine_dead"
