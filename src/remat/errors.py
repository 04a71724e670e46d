"""The exceptions remat raises.

Every error remat raises derives from :class:`RematError`, so a caller can catch them all at
once. Messages start with ``remat:``, say what was expected and what was found, and end with
how to fix it.
"""

from __future__ import annotations

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
