"""Pure: where a disaggregated InferenceService's decode pods find its prefill pool (spec.prefill), and the
`kaon serve` flags that say so. prefill_pool.py renders the pool itself; pod_template.py adds these flags."""
from __future__ import annotations

from kaon_operator import api

SUFFIX = "-prefill"
SERVICE_PORT = 80


def name_of(name: str) -> str:
    """The prefill pool's Deployment and Service of the InferenceService `name`."""
    return name + SUFFIX


def url(name: str) -> str:
    """The prefill Service, as the decode pods (in the same namespace) reach it."""
    return f"http://{name_of(name)}:{SERVICE_PORT}"


def decode_args(name: str, spec: api.InferenceServiceSpec) -> list[str]:
    """The decode pods' `kaon serve` flags that send long prompts to the prefill pool (none without one)."""
    prefill = spec.prefill
    if prefill is None or prefill.replicas == 0:
        return []
    args = ["--role", "decode", "--prefill-url", url(name), "--disagg-timeout", str(prefill.timeout_seconds)]
    if prefill.min_prompt_tokens is not None:
        args += ["--disagg-min-prompt-tokens", str(prefill.min_prompt_tokens)]
    return args
