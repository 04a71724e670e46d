"""The base of remat's ``TorchDispatchMode``s, which run in eager code only."""

from __future__ import annotations

from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

__all__: list[str] = []


class EagerMode(TorchDispatchMode):
    """A dispatch mode for eager execution.

    Without the override below, torch wraps every ``__torch_dispatch__`` call of a subclass in
    a frame that disables Dynamo, which costs more per op than what remat's modes do there.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)  # type: ignore[no-untyped-call]

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False
