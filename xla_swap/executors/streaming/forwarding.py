"""Public attributes of a runtime that one of its components owns: :class:`Forwarded` reads (and, where
allowed, writes) the component's attribute of the same or another name, so the runtime's surface
stays one object while each piece of state lives in one component.

Pure Python.
"""
from __future__ import annotations

import types

__all__ = ["Forwarded"]


class Forwarded:
    """A class attribute ``name = Forwarded("component", "attr")``: ``obj.name`` is
    ``obj.component.attr`` (a method comes back bound to the component); with ``settable=True``,
    ``obj.name = v`` sets ``obj.component.attr``, otherwise it raises ``AttributeError``.

    The docstring is ``doc``, else that of the attribute of the component's class ``of`` (a property's
    or method's), where given.
    """

    def __init__(self, component: str, attr: str | None = None, *, of: type | None = None, settable: bool = False,
                 doc: str | None = None):
        self.component, self.attr, self.of, self.settable, self.__doc__ = component, attr, of, settable, doc

    def __set_name__(self, owner, name: str) -> None:
        self.name = name
        if self.attr is None:
            self.attr = name
        target = getattr(self.of, self.attr, None) if self.of is not None else None
        if self.__doc__ is None and isinstance(target, (property, types.FunctionType)):
            self.__doc__ = target.__doc__

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return getattr(getattr(obj, self.component), self.attr)

    def __set__(self, obj, value) -> None:
        if not self.settable:
            raise AttributeError(f"{type(obj).__name__}.{self.name} is read-only (held by its {self.component})")
        setattr(getattr(obj, self.component), self.attr, value)
