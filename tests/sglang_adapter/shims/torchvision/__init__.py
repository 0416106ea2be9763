"""Test-only stand-in for torchvision (not installed in the SGLang test venv).

SGLang imports torchvision at module level for multimodal preprocessing that a text-only CPU
test never runs, and no torchvision wheel on the registries matches the CPU torch 2.13 build
(the PyPI 0.28.0 wheel's C++ ops do not load). Every `torchvision.*` module and attribute is a
placeholder; calling one raises, so a test that does reach vision code fails loudly.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kvstage.stub"


class _Placeholder:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, item: str) -> "_Placeholder":
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self._name}.{item}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torchvision is stubbed in the kvstage SGLang test venv")

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, item: str):
        if item.startswith("__"):
            raise AttributeError(item)
        return _Placeholder(f"{self.__name__}.{item}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _StubModule
