"""The one eviction rule of attnkit's caches (`attnkit.call.recent`)."""

from __future__ import annotations

import pytest

from attnkit.call.recent import Recent


def test_the_least_recently_used_entry_goes_first_and_a_lookup_is_a_use():
    cache: Recent[str, int] = Recent(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "b" is now the least recently used
    cache.put("c", 3)
    assert "b" not in cache and cache.get("a") == 1 and cache.get("c") == 3
    assert len(cache) == 2
    cache.clear()
    assert len(cache) == 0 and cache.get("a") is None


def test_a_cache_holds_at_least_one_entry():
    with pytest.raises(ValueError, match="at least one"):
        Recent(0)
