"""Name -> factory registries for every pluggable kind (storage, eviction, write, prefetch).

Plain dict lookups keep the choice of a kind out of if/elif chains; an unknown name is a
clear error that lists the known ones.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """A named set of factories for one pluggable kind."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator: register a factory (a class or a function) under `name`."""

        def add(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._factories[name] = factory
            return factory

        return add

    def get(self, name: str) -> Callable[..., T]:
        try:
            return self._factories[name]
        except KeyError:
            known = ", ".join(sorted(self._factories))
            raise ValueError(f"unknown {self.kind} {name!r}; known: {known}") from None

    def create(self, name: str, *args: object, **kwargs: object) -> T:
        return self.get(name)(*args, **kwargs)

    def names(self) -> list[str]:
        return sorted(self._factories)
