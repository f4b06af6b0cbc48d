"""``xla_swap.planning.cache.LRUCache``: the one bounded cache (the chooser's choices, the streaming
runtime's signatures, loss functions and update executables)."""
import pytest

from xla_swap.planning.cache import LRUCache


def test_least_recently_used_is_dropped_and_returned():
    cache = LRUCache(maxsize=2)
    assert cache.put("a", 1) == [] and cache.put("b", 2) == []
    assert cache.get("a") == 1                       # "a" becomes the most recently used
    assert cache.put("c", 3) == [("b", 2)]           # so "b" is dropped, and returned
    assert "b" not in cache and len(cache) == 2
    assert cache.values() == [1, 3]                  # least recently used first
    assert cache.values() == [1, 3]                  # reading the values marks none as used
    assert cache.put("a", 10) == [] and cache.values() == [3, 10]
    cache.clear()
    assert len(cache) == 0 and cache.get("a", "none") == "none"


@pytest.mark.parametrize("maxsize", [0, -1, 1.5, True, "2"])
def test_bad_maxsize_is_refused(maxsize):
    with pytest.raises(ValueError, match="maxsize"):
        LRUCache(maxsize)
