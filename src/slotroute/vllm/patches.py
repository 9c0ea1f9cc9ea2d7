"""How slotroute replaces a vLLM internal: verify the target first, then swap it.

A :class:`Patch` names one attribute of a vLLM module (a function, a method or a
module-level name), the parameters it must have and source fragments it must contain
(the hook points slotroute relies on). :func:`apply` verifies every patch of a set
before installing any, so a set either goes in whole or not at all.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Patch", "PatchError", "apply", "is_installed", "original"]

_MARK = "__slotroute_original__"


class PatchError(RuntimeError):
    """A vLLM internal slotroute patches is missing or does not look as expected."""


def _contains(source: str, fragment: str | tuple[str, ...]) -> bool:
    """Whether ``source`` contains ``fragment``, or a tuple's fragments in its order."""
    if isinstance(fragment, str):
        return fragment in source
    at = 0
    for part in fragment:
        at = source.find(part, at)
        if at < 0:
            return False
        at += len(part)
    return True


@dataclass(frozen=True)
class Patch:
    """Replace ``module.qualname`` with ``make(original)``. The target may be
    inherited; the replacement is set on the named owner.

    Invariant: ``make`` is only called with the attribute that passed :meth:`verify`.

    Parameters
    ----------
    module, qualname
        Where the target lives, e.g. ``"vllm.v1.core.block_pool"`` and
        ``"BlockPool.get_new_blocks"``.
    params
        The target's parameter names, in order (``self`` included); a last entry
        ``"..."`` checks only the names before it (a replacement that passes the rest
        through); ``None`` skips the check (module-level names that are not callables).
    needs
        Source fragments the target (or, for a module-level name, its module) must
        contain: the lines slotroute's replacement relies on. A tuple of fragments
        must appear in that order (calls whose order the replacement relies on).
    make
        Builds the replacement from the original; ``None`` for a target slotroute
        relies on but does not replace (only verified).
    """

    module: str
    qualname: str
    params: tuple[str, ...] | None
    needs: tuple[str | tuple[str, ...], ...]
    make: Callable[[Any], Any] | None

    @property
    def where(self) -> str:
        return f"{self.module}.{self.qualname}"

    def _owner_and_name(self) -> tuple[Any, str]:
        try:
            owner: Any = importlib.import_module(self.module)
        except ImportError as exc:
            raise PatchError(f"cannot import {self.module} (needed for {self.where}): {exc}") from exc
        *path, name = self.qualname.split(".")
        for part in path:
            if not hasattr(owner, part):
                raise PatchError(f"{self.where}: {owner.__name__} has no attribute {part!r}")
            owner = getattr(owner, part)
        return owner, name

    def verify(self) -> Any:
        """Return the current target after checking it.

        Raises
        ------
        PatchError
            If the target is missing, its parameters differ from ``params`` or its source
            lacks one of ``needs``; the message says what was expected and found.
        """
        owner, name = self._owner_and_name()
        if not hasattr(owner, name):
            raise PatchError(f"{self.where} not found in the installed vLLM")
        target = original(getattr(owner, name))
        if self.params is not None:
            found = tuple(inspect.signature(target).parameters)
            if self.params[-1:] == ("...",):
                found = found[: len(self.params) - 1] + ("...",)
            if found != self.params:
                raise PatchError(f"{self.where} has parameters {found}, expected {self.params}")
        if self.needs:
            source = inspect.getsource(target)
            missing = [fragment for fragment in self.needs if not _contains(source, fragment)]
            if missing:
                raise PatchError(f"{self.where} no longer contains {missing}; slotroute's patch relies on them")
        return target

    def install(self, target: Any) -> None:
        if self.make is None:
            return
        owner, name = self._owner_and_name()
        if is_installed(getattr(owner, name)):
            return  # idempotent: vLLM may load plugins more than once per process
        replacement = self.make(target)
        setattr(replacement, _MARK, target)
        setattr(owner, name, replacement)


def original(obj: Any) -> Any:
    """The vLLM object a slotroute replacement wraps, or ``obj`` itself."""
    return getattr(obj, _MARK, obj)


def is_installed(obj: Any) -> bool:
    """Whether ``obj`` is a slotroute replacement."""
    return hasattr(obj, _MARK)


def apply(patches: Sequence[Patch]) -> None:
    """Verify every patch, then install them all.

    Raises
    ------
    PatchError
        If any target fails verification; nothing is installed then.
    """
    targets = [patch.verify() for patch in patches]
    for patch, target in zip(patches, targets):
        patch.install(target)
