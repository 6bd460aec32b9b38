"""A small generic registry: ``@registry.register(name)``, lazy entries, "did you mean" errors.

One mechanism serves every pluggable family in gascan (architectures, tasks, interventions...).
Entries may be registered eagerly (the object) or lazily (an ``"module:attr"`` string imported on
first use), so importing gascan stays cheap.
"""
from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from discovery.errors import GascanError

T = TypeVar("T")


class Registry(Generic[T]):
    """Name → object map with lazy import and helpful lookup errors."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: dict[str, T | str] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, *, aliases: tuple[str, ...] = ()) -> Callable[[T], T]:
        """Decorator: register the decorated object under ``name`` (and ``aliases``)."""

        def decorate(obj: T) -> T:
            self.add(name, obj, aliases=aliases)
            return obj

        return decorate

    def add(self, name: str, obj: T | str, *, aliases: tuple[str, ...] = ()) -> None:
        """Register ``obj`` (or a lazy ``"module:attr"`` reference) under ``name``."""
        key = name.lower()
        if key in self._entries and self._entries[key] is not obj:
            raise ValueError(f"{self.what} {name!r} is registered twice")
        self._entries[key] = obj
        for alias in aliases:
            self._aliases[alias.lower()] = key

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        key = name.lower()
        return key in self._entries or key in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def get(self, name: str) -> T:
        """Return the entry for ``name``; unknown names raise a one-line error with suggestions."""
        key = self._aliases.get(name.lower(), name.lower())
        if key not in self._entries:
            known = self.names() + sorted(self._aliases)
            close = difflib.get_close_matches(name.lower(), known, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise GascanError(
                f"unknown {self.what} {name!r}{' — ' + hint if hint else ''}",
                f"use one of: {', '.join(self.names())}",
            )
        entry = self._entries[key]
        if isinstance(entry, str):
            module_name, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module_name), attr)
            self._entries[key] = entry
        return entry  # type: ignore[return-value]
