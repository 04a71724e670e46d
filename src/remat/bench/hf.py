"""Hugging Face models as ``remat bench`` workloads, built from a config with random weights.

Nothing is downloaded: each model is made from its configuration class. The benchmark size
matches the built-in GPT (12 layers, width 512, 8 heads, sequence 512, batch 2, vocabulary 8192).
The blocks that every strategy wraps are the layers that :func:`remat.hf.enable` makes
regions, found by the same call (:func:`remat.hf.layer_classes`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import RematError, did_you_mean
from ..workloads import Workload

__all__: list[str] = []

HF_MODELS = ("gpt2", "llama", "bert")


def _shape(size: str) -> dict[str, int]:
    if size == "bench":
        return {"layers": 12, "width": 512, "heads": 8, "seq": 512, "batch": 2, "vocab": 8192}
    if size == "medium":
        return {"layers": 8, "width": 256, "heads": 4, "seq": 256, "batch": 2, "vocab": 4096}
    if size == "small":
        return {"layers": 2, "width": 32, "heads": 4, "seq": 16, "batch": 2, "vocab": 64}
    raise RematError(f"remat bench: unknown size {size!r}; expected one of: small, medium, bench.")


def _build(name: str, s: dict[str, int]) -> nn.Module:
    # use_cache=False as for any training run: a key/value cache is state that a recompute
    # would extend a second time (remat's determinism check reports it if it is left on).
    tf = _transformers()

    common = {"vocab_size": s["vocab"], "num_attention_heads": s["heads"]}
    if name == "gpt2":
        config = tf.GPT2Config(
            vocab_size=s["vocab"],
            n_positions=s["seq"],
            n_embd=s["width"],
            n_layer=s["layers"],
            n_head=s["heads"],
            # GPT-2's own (50256) lies outside the smaller vocabularies here: transformers warns.
            bos_token_id=s["vocab"] - 1,
            eos_token_id=s["vocab"] - 1,
            use_cache=False,
            attn_implementation="eager",
        )
        model: nn.Module = tf.GPT2LMHeadModel(config)
        return model
    if name == "llama":
        config = tf.LlamaConfig(
            **common,
            hidden_size=s["width"],
            intermediate_size=4 * s["width"],
            num_hidden_layers=s["layers"],
            num_key_value_heads=s["heads"],
            max_position_embeddings=s["seq"],
            attention_dropout=0.1,
            use_cache=False,
            attn_implementation="eager",
        )
        model = tf.LlamaForCausalLM(config)
        return model
    config = tf.BertConfig(
        **common,
        hidden_size=s["width"],
        intermediate_size=4 * s["width"],
        num_hidden_layers=s["layers"],
        max_position_embeddings=s["seq"],
        attn_implementation="eager",
    )
    model = tf.BertForMaskedLM(config)
    return model


def preload(name: str) -> list[str]:
    """The modules each measurement of the Hugging Face model ``name`` imports (about 2.5 s),
    for a fork server to import once (see ``_child.ForkServer``)."""
    return ["transformers", f"transformers.models.{name}.modeling_{name}"]


def _transformers() -> Any:
    import importlib

    return importlib.import_module("transformers")


def _block_types(name: str, s: dict[str, int]) -> tuple[type[nn.Module], ...]:
    # The layers that remat.hf.enable makes regions, found the same way (_no_split_modules),
    # on a copy of the model built on the meta device: no memory, no initialisation.
    from .. import hf

    with torch.device("meta"):
        return hf.layer_classes(_build(name, s))


def _batch(s: dict[str, int], generator: torch.Generator) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _loss(output: Any, target: Tensor) -> Tensor:
    logits: Tensor = output.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def get_hf_workload(name: str, size: str = "small") -> Workload:
    """A Hugging Face model as a :class:`~remat.workloads.Workload`; needs ``transformers``."""
    import importlib.util

    if name not in HF_MODELS:
        raise RematError(
            f"remat bench: unknown --hf model {name!r}{did_you_mean(name, HF_MODELS)}; expected "
            f"one of: {', '.join(HF_MODELS)}."
        )
    if importlib.util.find_spec("transformers") is None:
        raise RematError(
            "remat bench: --hf needs the transformers package; install it with "
            "pip install transformers (weights are random, nothing is downloaded)."
        )
    s = _shape(size)
    return Workload(
        name=f"hf-{name}",
        size=size,
        build=partial(_build, name, s),
        make_batch=partial(_batch, s),
        loss_fn=_loss,
        block_types=_block_types(name, s),
        description=(
            f"Hugging Face {name} from config: {s['layers']} layers, width {s['width']}, "
            f"{s['heads']} heads, seq {s['seq']}, batch {s['batch']}, vocab {s['vocab']}"
        ),
    )
