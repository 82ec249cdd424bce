"""Package attributes loaded on first use (PEP 562), so importing a package does not import torch with it."""

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(package: str, module_of: dict[str, str]) -> Callable[[str], Any]:
    """A module-level `__getattr__` that imports `module_of[name]` (a full module path) when `name` is first
    read from `package`."""

    def __getattr__(name: str) -> Any:
        if name not in module_of:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module_of[name]), name)

    return __getattr__
