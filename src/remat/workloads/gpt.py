"""A GPT-style decoder with dropout: the reference workload of the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._base import Workload

__all__: list[str] = []

# ---------------------------------------------------------------------------------------------
# GPT


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT` model."""

    vocab_size: int
    seq_len: int
    d_model: int
    n_heads: int
    n_layers: int
    dropout: float


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"remat: d_model {d_model} is not divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.dropout = dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        batch, seq, width = x.shape
        head_dim = width // self.n_heads
        q, k, v = self.qkv(x).split(width, dim=2)
        q = q.view(batch, seq, self.n_heads, head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_heads, head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_heads, head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).contiguous().view(batch, seq, width)
        out: Tensor = self.resid_dropout(self.proj(y))
        return out


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer decoder block: attention and MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    """GPT-style decoder-only language model returning logits of shape (batch, seq, vocab)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(
            GPTBlock(config.d_model, config.n_heads, config.dropout) for _ in range(config.n_layers)
        )
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.apply(_gpt_init)

    def forward(self, idx: Tensor) -> Tensor:
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(f"remat: sequence length {seq} exceeds {self.config.seq_len}")
        pos = torch.arange(seq, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits: Tensor = self.head(self.ln_f(x))
        return logits


def _gpt_init(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _gpt_batch(
    batch_size: int, seq_len: int, vocab_size: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    tokens = torch.randint(
        0, vocab_size, (batch_size, seq_len + 1), generator=generator, device=generator.device
    )
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _gpt_workload(size: str) -> Workload:
    if size == "bench":
        config = GPTConfig(
            vocab_size=8192, seq_len=512, d_model=512, n_heads=8, n_layers=12, dropout=0.1
        )
        batch_size = 2
    elif size == "medium":
        config = GPTConfig(
            vocab_size=4096, seq_len=256, d_model=256, n_heads=4, n_layers=8, dropout=0.1
        )
        batch_size = 2
    else:
        config = GPTConfig(
            vocab_size=64, seq_len=16, d_model=32, n_heads=4, n_layers=4, dropout=0.1
        )
        batch_size = 2
    return Workload(
        name="gpt",
        size=size,
        build=partial(GPT, config),
        make_batch=partial(_gpt_batch, batch_size, config.seq_len, config.vocab_size),
        loss_fn=_lm_loss,
        block_types=(GPTBlock,),
        blocks_chain=True,
        description=(
            f"GPT decoder: {config.n_layers} layers, d_model {config.d_model}, "
            f"{config.n_heads} heads, seq {config.seq_len}, batch {batch_size}, "
            f"vocab {config.vocab_size}, dropout {config.dropout}"
        ),
    )
