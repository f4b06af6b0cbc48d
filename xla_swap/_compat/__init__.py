"""Compatibility layer: every private torch_xla / torch / jax / jaxlib API xla_swap calls, wrapped once.

* :mod:`xla_swap._compat.jax` - jax and jaxlib internals (``jax._src``, ``xla_client``, the
  PJRT client and loaded executables). Imports jax and numpy only, never torch or torch_xla,
  so the executors import on machines without them.
* :mod:`xla_swap._compat.torch_xla` - torch_xla internals (``torch_xla._XLAC``, the XLA
  builder, the private helpers of ``scan_layers``) and the torch internals the front end's
  scan helpers use (``torch._functorch``, ``torch.utils._pytree``).

Each wrapper is a small named function whose docstring names the upstream API it wraps and
the versions it was verified on. When an API is missing (an upstream release renamed or
removed it) the wrapper raises :class:`MissingUpstreamAPI` naming that API and the installed
version, instead of an ``AttributeError`` deep inside xla_swap. The rest of the package calls
these wrappers and no private upstream API directly (``tests/integration/test_layering.py``
checks the sources; ``xla_swap/stack/swapped_stack.py`` and ``xla_swap/executors/streaming/runtime.py`` are listed
there as the known exceptions).

This package's ``__init__`` imports nothing heavy: ``import xla_swap._compat.jax`` loads jax
alone.
"""
from __future__ import annotations

import importlib
from typing import Callable

__all__ = ["MissingUpstreamAPI"]


class MissingUpstreamAPI(ImportError):
    """A private upstream API that xla_swap relies on is missing from the installed version.

    Attributes:
      api: the dotted name of the missing API (e.g. ``"torch_xla._XLAC._xla_user_computation"``).
      installed: the installed version of the package that should provide it (a string).
      verified: the versions the wrapper was verified on (a string).
    """

    def __init__(self, api: str, installed: str, verified: str, detail: str = ""):
        self.api, self.installed, self.verified = api, installed, verified
        msg = (f"xla_swap needs the upstream API {api}, which is missing from the installed {installed} "
               f"(xla_swap was verified with {verified}); install a version in that range")
        super().__init__(msg + (f": {detail}" if detail else ""))


def _resolve(module: str, path: str, installed: Callable[[], str], verified: str):
    """The object ``module.path`` (``path``: a dotted attribute path, may be empty).

    Raises:
      MissingUpstreamAPI: ``module`` cannot be imported or an attribute on ``path`` is missing;
        the message names ``module.path``, ``installed()`` and ``verified``.
    """
    api = f"{module}.{path}" if path else module
    try:
        obj = importlib.import_module(module)
    except ImportError as e:
        raise MissingUpstreamAPI(api, installed(), verified, str(e)) from e
    for part in path.split(".") if path else ():
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise MissingUpstreamAPI(api, installed(), verified) from None
    return obj
