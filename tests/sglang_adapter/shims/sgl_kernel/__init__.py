"""Test-only stand-in for sgl_kernel (SGLang's kernel package; its wheels are CUDA-only).

SGLang imports sgl_kernel at module level in many places; with SGLANG_USE_CPU_ENGINE=1 and
--device cpu a small Llama runs on torch-native code and calls none of it. Every `sgl_kernel.*`
module and attribute is a placeholder; calling one raises, so a test that does reach a kernel
fails loudly instead of computing something else.
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
        raise RuntimeError(f"{self._name}: sgl_kernel is stubbed in the kvstage SGLang test venv")

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
