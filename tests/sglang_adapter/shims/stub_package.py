"""Turns a test-only package into a placeholder: every submodule and attribute of it exists,
and calling one raises, so SGLang's module-level imports succeed and a test that does reach the
stubbed code fails loudly. Used by the sgl_kernel and torchvision stand-ins here."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types


def install(package: str) -> None:
    """Make the already-imported `package` and every `package.*` a placeholder."""

    class Placeholder:
        def __init__(self, name: str):
            self._name = name

        def __getattr__(self, item: str) -> "Placeholder":
            if item.startswith("__"):
                raise AttributeError(item)
            return Placeholder(f"{self._name}.{item}")

        def __call__(self, *args, **kwargs):
            raise RuntimeError(f"{self._name}: {package} is stubbed in the kvstage SGLang test venv")

        def __mro_entries__(self, bases):
            return (object,)

    class StubModule(types.ModuleType):
        def __getattr__(self, item: str):
            if item.startswith("__"):
                raise AttributeError(item)
            return Placeholder(f"{self.__name__}.{item}")

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path, target=None):
            if fullname.startswith(package + "."):
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            module = StubModule(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module):
            pass

    sys.meta_path.insert(0, Finder())
    sys.modules[package].__class__ = StubModule
