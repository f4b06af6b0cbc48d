"""One bounded cache: a mapping of at most ``maxsize`` entries, the least recently used dropped first.

Pure Python; for caches keyed by something ``functools.lru_cache`` cannot take (entries put by
one caller and read by another, or a value that is not a function's result).
"""
from __future__ import annotations

import collections
from typing import Any, Hashable

__all__ = ["LRUCache"]


class LRUCache:
    """A mapping of at most ``maxsize`` entries; a ``put`` beyond it drops the least recently used.

    Args:
      maxsize: the most entries kept (int >= 1).

    Raises: ValueError: ``maxsize`` not an int >= 1.
    """

    def __init__(self, maxsize: int = 64):
        if isinstance(maxsize, bool) or not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"maxsize must be an int >= 1, got {maxsize!r}")
        self.maxsize = maxsize
        self._entries: collections.OrderedDict = collections.OrderedDict()

    def get(self, key: Hashable, default: Any = None) -> Any:
        """The value under ``key`` (marked most recently used), or ``default``."""
        if key not in self._entries:
            return default
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: Hashable, value: Any) -> list:
        """Keep ``value`` under ``key`` as the most recently used; drop the oldest beyond ``maxsize``.

        Returns: the dropped ``(key, value)`` pairs, oldest first (empty when nothing was dropped).
        """
        self._entries[key] = value
        self._entries.move_to_end(key)
        dropped = []
        while len(self._entries) > self.maxsize:
            dropped.append(self._entries.popitem(last=False))
        return dropped

    def values(self) -> list:
        """The values, least recently used first (reading them marks none as used)."""
        return list(self._entries.values())

    def clear(self) -> None:
        """Forget every entry."""
        self._entries.clear()

    def __contains__(self, key) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
