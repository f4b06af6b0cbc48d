"""jax's persistent compilation cache for the stage executables: a later process with the same
model shapes, jax version and device loads them instead of compiling again.

One cache per process, for every jax compilation in it (jax's design). Uses jax's public
``jax.experimental.compilation_cache`` and the ``jax_persistent_cache_*`` options. Imports only jax.
"""
from __future__ import annotations

import math
import os

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

__all__ = ["use_compilation_cache"]


def use_compilation_cache(path, *, min_compile_time_s: float = 1.0) -> str | None:
    """Keep the executables this process compiles from now on in a directory, and load from it.

    A stack's first step compiles one forward and one backward executable per distinct layer
    signature (and its update); a later process building the same stack (same shapes, dtypes,
    jax version and device kind) finds them in ``path`` and skips the compiler. The setting holds
    for the whole process, for every jax compilation, and takes effect also after compilations
    have already happened (jax's cache is reset to re-read it).

    Args:
      path: a directory (``str`` or ``os.PathLike``; ``~`` expanded; created if missing), or
        ``None`` to stop using a cache.
      min_compile_time_s: only executables whose compilation took at least this many seconds
        are written (jax's ``jax_persistent_cache_min_compile_time_secs``; its default 1.0). A
        float >= 0.

    Returns: the cache directory in force before the call (``None`` for none), a ``str``.

    Raises (before anything changes):
      TypeError: ``path`` is not a str, ``os.PathLike`` or ``None``; ``min_compile_time_s`` not a number.
      ValueError: ``min_compile_time_s`` negative or not finite.
      OSError: the directory cannot be created.
    """
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a directory (str or os.PathLike) or None, got {type(path).__name__}")
    if isinstance(min_compile_time_s, bool) or not isinstance(min_compile_time_s, (int, float)):
        raise TypeError(f"min_compile_time_s must be a number of seconds, got {min_compile_time_s!r}")
    if not (math.isfinite(min_compile_time_s) and min_compile_time_s >= 0):
        raise ValueError(f"min_compile_time_s must be a finite number of seconds >= 0, got {min_compile_time_s!r}")
    if path is not None:
        path = os.path.expanduser(os.fspath(path))
        os.makedirs(path, exist_ok=True)
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_time_s))
    jax.config.update("jax_compilation_cache_dir", path)
    _jax_cache.reset_cache()      # jax decides once per process whether to use a cache; decide again
    return previous
