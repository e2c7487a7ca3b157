"""Frozen values made as fast as plain ones: the layers' Asked and Attempt.

A frozen dataclass's __init__ sets each field through object.__setattr__, a Python-level call per
field, on every call's path. `Frozen` is mixed in before a plain slots dataclass that holds the
fields (`class Asked(Frozen, _AskedFields)`): an instance is made by the fields' own __init__ (one
slot store each) and then becomes the frozen class, whose __setattr__ and __delattr__ refuse every
change as a frozen dataclass's do (FrozenInstanceError). Construction is positional only.
"""

from __future__ import annotations

from dataclasses import FrozenInstanceError
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, Self


class Frozen:
    __slots__ = ()
    fields_class: ClassVar[type]  # the plain slots dataclass whose fields this class freezes

    def __new__(cls, *fields: Any) -> Self:  # positional, in the fields' order
        made = cls.fields_class(*fields)
        made.__class__ = cls  # the same slots: frozen from here on
        return made  # type: ignore[no-any-return]

    if not TYPE_CHECKING:  # the fields' __init__ would assign through __setattr__
        __init__ = object.__init__  # __new__ made it whole

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> NoReturn:
        raise FrozenInstanceError(f"cannot delete field {name!r}")
