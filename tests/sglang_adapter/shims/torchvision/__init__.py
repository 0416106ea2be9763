"""Test-only stand-in for torchvision (not installed in the SGLang test venv).

SGLang imports torchvision at module level for multimodal preprocessing that a text-only CPU
test never runs, and no torchvision wheel on the registries matches the CPU torch 2.13 build
(the PyPI 0.28.0 wheel's C++ ops do not load). Every `torchvision.*` module and attribute is a
placeholder; calling one raises, so a test that does reach vision code fails loudly.
"""

from __future__ import annotations

from stub_package import install

__version__ = "0.0.0+kvstage.stub"

install(__name__)
