"""The exceptions remat raises, and how it warns.

Every error remat raises derives from :class:`RematError`, so a caller can catch them all at
once. Messages start with ``remat:``, say what was expected and what was found, and end with
how to fix it. Warnings name the user's line that led to them (see :func:`warn`).
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch.utils.checkpoint

__all__ = ["CheckpointError", "NoPlanFits", "RematError"]


class RematError(RuntimeError):
    """Root of every error remat raises: bad arguments, infeasible requests, broken replays."""


class CheckpointError(RematError, torch.utils.checkpoint.CheckpointError):
    """A recompute did not reproduce what the forward pass saved, or could not run.

    Also a ``torch.utils.checkpoint.CheckpointError``, so ``except`` clauses written for torch's
    checkpoint catch it.
    """


class NoPlanFits(RematError):
    """No plan fits the memory budget given to ``remat.plan`` or ``remat.fit``; ``smallest`` is
    the budget in bytes the message names instead."""

    def __init__(self, message: str, smallest: int) -> None:
        super().__init__(message)
        self.smallest = smallest


# Frames in these folders are remat's or torch's (a module's ``__call__``, a hook), never the
# user's line a warning should name.
_INTERNAL = tuple(
    os.path.dirname(os.path.abspath(m.__file__)) + os.sep
    for m in (sys.modules[__name__.rpartition(".")[0]], torch)
    if m.__file__ is not None
)


def warn(message: str) -> None:
    """``warnings.warn(message)`` attributed to the first frame outside remat and torch: the
    user's call (``remat.fit``, a model's forward, ``loss.backward()``), however deep inside
    remat the warning is raised. Python 3.12's ``skip_file_prefixes`` does this; remat
    supports 3.10."""
    frame = sys._getframe(1)
    level = 2  # the caller of this function
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame = frame.f_back
        level += 1
    warnings.warn(message, stacklevel=level)


def did_you_mean(found: str, choices: list[str] | tuple[str, ...]) -> str:
    """A ``" (did you mean 'x'?)"`` suffix when *found* is close to one of *choices*."""
    import difflib

    close = difflib.get_close_matches(found, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def saved_and_written(what: str, t: Any, version: int) -> CheckpointError:
    """The error for a tensor a region saved for backward that was written in place since:
    autograd checks the version of a tensor it saves itself, and skips the check for one a
    saved-tensors hook packed, as remat's regions pack theirs."""
    return CheckpointError(
        f"remat: {what} (shape {tuple(t.shape)}) has been modified by an inplace operation "
        f"since it was saved for backward (its version was {version}, it is "
        f"{t._version}), as plain autograd raises too. Write a copy (out = out * 2, not "
        "out.mul_(2)), or clone it first."
    )
