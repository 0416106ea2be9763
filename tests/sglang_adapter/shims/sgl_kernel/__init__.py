"""Test-only stand-in for sgl_kernel (SGLang's kernel package; its wheels are CUDA-only).

SGLang imports sgl_kernel at module level in many places; with SGLANG_USE_CPU_ENGINE=1 and
--device cpu a small Llama runs on torch-native code and calls none of it. Every `sgl_kernel.*`
module and attribute is a placeholder; calling one raises, so a test that does reach a kernel
fails loudly instead of computing something else.
"""

from __future__ import annotations

from stub_package import install

__version__ = "0.0.0+kvstage.stub"

install(__name__)
