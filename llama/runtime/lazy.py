"""Public names imported on first use (PEP 562), so that importing a package (and answering
a command line's ``--help``) does not pay for torch or the web stack."""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, modules: dict[str, tuple[str, ...]]) -> tuple[Callable[[str], Any],
                                                                             Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose public names are those of
    ``modules`` (a submodule, relative to ``package``, and the names it defines)."""
    namespace = importlib.import_module(package).__dict__
    exports = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
