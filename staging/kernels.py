"""Which gather/scatter implementation a KV cache gets: the fused Triton kernels on CUDA, the
torch reference everywhere else (docs/staging_kernels.md, "Choosing the kernels").

``KVSTAGE_STAGING_KERNELS`` (default ``auto``):

- ``auto``: Triton for a CUDA cache, torch otherwise. Triton not importable on a CUDA machine
  falls back to torch with one warning in the log (the torch path is correct, only slower);
- ``torch``: always the torch reference;
- ``triton``: always Triton. On a non-CUDA cache only under Triton's interpreter
  (``TRITON_INTERPRET=1`` set before triton is imported: the tests); otherwise ValueError.
  Triton not importable: RuntimeError (it was asked for by name, so no silent fallback).

The choice is made once per worker, when it is built, so a bad setting fails at start-up and
not inside a transfer thread.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import TYPE_CHECKING, TypeAlias

import torch

from ..transfer.protocol.kinds import StrKind
from .gather_scatter import Gatherer, GathersKV, Scatterer, ScattersKV

if TYPE_CHECKING:  # imported only when chosen: triton may be missing
    from .triton_kernels import TritonGatherer, TritonScatterer

#: the gatherer and scatterer classes a worker builds (both take `Planner`'s arguments)
GathererClass: TypeAlias = "type[Gatherer] | type[TritonGatherer]"
ScattererClass: TypeAlias = "type[Scatterer] | type[TritonScatterer]"

__all__ = ["ENV_VAR", "CHOICES", "KernelChoice", "requested_kernels", "kernel_choice", "gatherer_class", "scatterer_class", "make_gatherer",
           "make_scatterer"]

log = logging.getLogger(__name__)

ENV_VAR = "KVSTAGE_STAGING_KERNELS"


class KernelChoice(StrKind):
    """KVSTAGE_STAGING_KERNELS: which gather/scatter implementation (see the module docstring)."""

    AUTO = "auto"
    TORCH = "torch"
    TRITON = "triton"


CHOICES = tuple(c.value for c in KernelChoice)

_warned_fallback = False


def requested_kernels() -> KernelChoice:
    """The value of KVSTAGE_STAGING_KERNELS (auto when unset); ValueError naming it otherwise."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"{ENV_VAR}={os.environ.get(ENV_VAR)!r}: expected one of {', '.join(CHOICES)}")
    return KernelChoice(value)


def _triton_module(device: torch.device, required: bool) -> ModuleType | None:
    """The Triton kernels module, or None (auto only) when triton cannot be imported."""
    global _warned_fallback
    try:
        triton_kernels = importlib.import_module(".triton_kernels", __package__)
    except ImportError as exc:
        if required:
            raise RuntimeError(f"{ENV_VAR}=triton but triton cannot be imported ({exc}); install the "
                               f"pinned version (requirements/base.txt) or set {ENV_VAR}=torch") from exc
        if not _warned_fallback:
            _warned_fallback = True
            log.warning("%s=auto: triton cannot be imported (%s); the CUDA cache on %s uses the torch "
                        "gather/scatter instead", ENV_VAR, exc, device)
        return None
    return triton_kernels


def _triton_for(device: torch.device | str) -> ModuleType | None:
    """The Triton kernels module for a cache on `device`, or None for the torch path."""
    device = torch.device(device)
    requested = requested_kernels()
    if requested == KernelChoice.TORCH or (requested == KernelChoice.AUTO and device.type != "cuda"):
        return None
    mod = _triton_module(device, required=requested == KernelChoice.TRITON)
    if mod is not None and device.type != "cuda" and not mod.interpreted():
        raise ValueError(f"{ENV_VAR}=triton needs a CUDA KV cache, got one on {device} (on the CPU the "
                         f"kernels only run under Triton's interpreter: TRITON_INTERPRET=1 set before "
                         f"triton is imported)")
    return mod


def kernel_choice(device: torch.device | str) -> KernelChoice:
    """TORCH or TRITON for a KV cache on `device` (see the module docstring)."""
    return KernelChoice.TORCH if _triton_for(device) is None else KernelChoice.TRITON


def gatherer_class(device: torch.device | str) -> GathererClass:
    """The Gatherer class to build per worker thread for a cache on `device`."""
    mod = _triton_for(device)
    if mod is None:
        return Gatherer
    triton_class: type[TritonGatherer] = mod.TritonGatherer
    return triton_class


def scatterer_class(device: torch.device | str) -> ScattererClass:
    """The Scatterer class to build per scatter thread for a cache on `device`."""
    mod = _triton_for(device)
    if mod is None:
        return Scatterer
    triton_class: type[TritonScatterer] = mod.TritonScatterer
    return triton_class


def make_gatherer(device: torch.device | str) -> GathersKV:
    """A new gatherer for a cache on `device` (Gatherer or TritonGatherer)."""
    return gatherer_class(device)()


def make_scatterer(device: torch.device | str) -> ScattersKV:
    """A new scatterer for a cache on `device` (Scatterer or TritonScatterer)."""
    return scatterer_class(device)()
