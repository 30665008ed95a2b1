"""Issue 48: the engine's key checks. The adapter routes' decision (lora_routes.admin_allowed) and
the key comparison (keys.matches), which must not tell a key's length by its time."""
from __future__ import annotations

import hmac

import pytest

from kaon_runtime import cli
from kaon_runtime.server import keys
from kaon_runtime.server.lora_routes import admin_allowed


def test_adapter_changes_are_off_unless_enabled_with_an_admin_key():
    assert admin_allowed(False, "admin", "Bearer admin") == 404  # off: as a route that does not exist
    assert admin_allowed(True, None, "") == 404  # on with no key is off, never open
    assert admin_allowed(True, "", "Bearer ") == 404
    assert admin_allowed(True, "admin", "") == 401
    assert admin_allowed(True, "admin", "Bearer serving-key") == 401
    assert admin_allowed(True, "admin", "Basic admin") == 401
    assert admin_allowed(True, "admin", "Bearer admin") is None
    assert admin_allowed(True, "admin", "bearer admin") is None


def test_the_comparison_sees_equal_lengths_whatever_the_key(monkeypatch):
    """It failed before: compare_digest was given the token and the key as they are, and returns at
    once when their lengths differ, so the time told the key's length."""
    seen, compare = [], hmac.compare_digest

    def spy(a, b):
        seen.append((len(a), len(b)))
        return compare(a, b)

    monkeypatch.setattr(keys.hmac, "compare_digest", spy)
    assert keys.matches(b"a-key", (b"short", b"a-key", b"a much longer key than the token"))
    assert not keys.matches(b"x", (b"a-key",))
    assert seen and len(set(seen)) == 1 and seen[0][0] == seen[0][1]


@pytest.mark.parametrize("serving", [["--api-key", "same"], ["--api-key-file", "keys"]], ids=["key", "key-file"])
@pytest.mark.parametrize("admin_route", ["--enable-runtime-lora", "--enable-sleep-mode"])
def test_an_admin_key_that_is_also_a_serving_key_is_refused_at_start(tmp_path, monkeypatch, serving, admin_route):
    """It started before (sweep48): `--api-key K --admin-key K` (one value in both variables) let every client
    administer the engine. Refused before the model loads; a key file is read for it too."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "keys").write_text("other\nsame\n")

    def started(args):  # past the checks: the engine would load and serve (this test would hang there)
        raise AssertionError("kaon serve started with its admin key among the serving keys")
    monkeypatch.setattr(cli, "engine_config", started)
    command = ["serve", "--model", "builtin://smollm2-135m-instruct", "--task", "generate", *serving]
    with pytest.raises(SystemExit, match="also a serving key"):
        cli.main([*command, "--admin-key", "same", admin_route])
    with pytest.raises(AssertionError, match="started"):  # a key of its own passes the check
        cli.main([*command, "--admin-key", "admin-only", admin_route])
