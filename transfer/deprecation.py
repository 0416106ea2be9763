"""The public API's old forms, kept working for a release with a `DeprecationWarning`.

The rule (docs/api.md, "API stability"): a change to how a public name is called keeps the form
it replaces working, with a `DeprecationWarning` that names the new form, for at least one
release. This module holds the shims; each names the release that may remove it.

`accepts_old_positional` serves constructors that became keyword-only: the classes below took
every field positionally until 0.1.0's keyword-only change (issue 30), so code written for that
form (`KVLayout(32, 8, 128, torch.bfloat16, 16, 4, 0)`) still runs, warned, and a field given
both ways is the `TypeError` Python gives for any duplicate argument.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T", bound=type)

#: The release that may drop the shims of this module.
REMOVED_IN = "0.3.0"


def accepts_old_positional(*names: str, keep: int = 0) -> Callable[[T], T]:
    """Class decorator: positional arguments past the first `keep` (which stay positional) bind to
    `names`, the fields in their old positional order, with a `DeprecationWarning` asking for
    keywords. More positional arguments than `keep + len(names)` raise `TypeError`."""

    def wrap(cls: T) -> T:
        init = cls.__init__  # type: ignore[misc]  # the decorated class's own __init__, wrapped below

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if len(args) > keep:
                extra = args[keep:]
                if len(extra) > len(names):
                    raise TypeError(f"{cls.__name__}() takes at most {keep + len(names)} positional arguments "
                                    f"({len(args)} given)")
                taken = names[:len(extra)]
                for name in taken:
                    if name in kwargs:
                        raise TypeError(f"{cls.__name__}() got multiple values for argument {name!r}")
                warnings.warn(f"{cls.__name__}: passing {', '.join(taken)} by position is deprecated and will "
                              f"stop working in kvstage {REMOVED_IN}; name them: "
                              f"{cls.__name__}({', '.join(f'{n}=...' for n in taken)})",
                              DeprecationWarning, stacklevel=2)
                kwargs.update(zip(taken, extra))
                args = args[:keep]
            init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]  # a class decorator replaces __init__ on purpose
        return cls

    return wrap
