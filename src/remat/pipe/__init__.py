"""Pipelines with skip connections: GPipe in one process, and stages across processes.

* :class:`Pipe` runs an ``nn.Sequential`` as a GPipe pipeline of partitions on devices, with
  micro-batches and remat's checkpointing per micro-batch.
* :func:`skippable`, :class:`stash`, :class:`pop`, :class:`Namespace` and
  :func:`verify_skippables` write skip connections (U-Net, encoder-decoder) into an
  ``nn.Sequential``; a :class:`Pipe` carries them between partitions through portals.
* :mod:`remat.pipe.distributed` runs the same model with one stage per process on
  ``torch.distributed.pipelining``, skip tensors routed between non-adjacent stages.
"""

from __future__ import annotations

from .batchnorm import DeferredBatchNorm as DeferredBatchNorm
from .pipe import Pipe as Pipe
from .pipeline import CheckpointMode as CheckpointMode
from .skip.namespace import Namespace as Namespace
from .skip.skippable import Skippable as Skippable
from .skip.skippable import pop as pop
from .skip.skippable import skippable as skippable
from .skip.skippable import stash as stash
from .skip.skippable import verify_skippables as verify_skippables

__all__ = [
    "CheckpointMode",
    "DeferredBatchNorm",
    "Namespace",
    "Pipe",
    "Skippable",
    "pop",
    "skippable",
    "stash",
    "verify_skippables",
]
