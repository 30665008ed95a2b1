"""Issue 48: the engine's key checks. The adapter routes' decision (lora_routes.admin_allowed) and
the key comparison (keys.matches), which must not tell a key's length by its time."""
from __future__ import annotations

import hmac

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
