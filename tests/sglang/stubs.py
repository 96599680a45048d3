"""Import stand-ins for the two packages SGLang imports that a CPU test box cannot install.

- torchvision: PyPI's wheels break beside the CPU torch build (or pull a CUDA torch).
- triton: imported unconditionally by SGLang's utilities; ~1 GB and unused on CPU.

Nothing under test calls into them: SGLang only imports them at module level. A stand-in
module answers every attribute with a MagicMock. `install()` must run before SGLang is
imported, and after transformers has cached that torchvision is absent.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from unittest import mock

_VERSIONS = {"triton": "3.9.0", "torchvision": "0.28.0"}


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        if (self.__name__, name) == ("triton", "runtime"):
            return importlib.import_module("triton.runtime")
        if (self.__name__, name) == ("triton.runtime", "driver"):
            # A CPU box has no active triton driver: code that probes for one (FLA's
            # get_available_device) then takes its CPU branch instead of a mock device.
            raise AttributeError("no triton driver on a CPU box")
        if name[:1].isupper():
            # Class-like names (JITFunction, Config, ...) must work in isinstance().
            value = type(name, (), {"__init__": lambda self, *a, **k: None})
        else:
            value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in _VERSIONS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = _VERSIONS[spec.name.split(".")[0]]
        return module

    def exec_module(self, module) -> None:
        return None


def _really_installed(name: str) -> bool:
    return any(
        f.find_spec(name, None) is not None
        for f in sys.meta_path
        if not isinstance(f, _StubFinder) and hasattr(f, "find_spec")
    )


def install() -> None:
    """Idempotent. Leaves real installs of either package alone."""
    if any(isinstance(f, _StubFinder) for f in sys.meta_path):
        return
    # transformers and torch cache these answers; they must be the true ones ("absent").
    import torch.utils._triton
    from transformers.utils import import_utils

    import_utils.is_torchvision_available()
    torch.utils._triton.has_triton_package()
    missing = [name for name in _VERSIONS if not _really_installed(name)]
    if missing:
        finder = _StubFinder()
        finder_roots = set(missing)
        finder.find_spec = (  # type: ignore[method-assign]
            lambda fullname, path, target=None, _f=_StubFinder.find_spec: (
                _f(finder, fullname, path, target)
                if fullname.split(".")[0] in finder_roots
                else None
            )
        )
        sys.meta_path.insert(0, finder)
