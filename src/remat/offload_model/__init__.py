"""``OffloadModel``: train a sequence of modules slice by slice from host memory or disk.

See NOTE [ OffloadModel design ] in ``_model.py``.
"""

from ._model import OffloadModel as OffloadModel

__all__ = ["OffloadModel"]
