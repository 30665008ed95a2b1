"""spec.engine.task (generate | embed) reaches `kaon serve --task`, and the engine's own parser
reads the flag the operator writes (the two packages share the contract, not code)."""
from __future__ import annotations

import pydantic
import pytest

from kaon_operator import api
from kaon_operator.children import pod_template


def engine_args(**engine) -> list[str]:
    spec = api.InferenceServiceSpec.model_validate({"model": {"uri": "builtin://smollm2-135m-instruct"},
                                                    "engine": engine})
    return pod_template.engine_args("svc", spec)


@pytest.mark.parametrize(("engine", "task"), [({}, "generate"), ({"task": "generate"}, "generate"),
                                              ({"task": "embed"}, "embed")])
def test_the_task_reaches_kaon_serve(engine, task):
    from kaon_runtime.cli import build_parser

    args = engine_args(**engine)
    assert args[args.index("--task") + 1] == task
    assert build_parser().parse_args(args[1:]).task == task  # ["kaon", "serve", ...]: the engine reads it


def test_an_unknown_task_is_refused():
    with pytest.raises(pydantic.ValidationError, match="task"):
        engine_args(task="classify")
