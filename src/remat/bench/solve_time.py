"""``remat bench --solve-time``: how long ``remat.plan`` takes on a deep model.

The model is the medium GPT's family (d_model 256, 4 heads, seq 256, batch 2, vocab 4096,
dropout 0.1) at 48 layers: one block type, profiled once, and a chain of 48 blocks for the
chain DP, with segments of up to 12 blocks among the options. One ``remat.plan`` call at 25%
of the plain step's activation peak, timed whole; the plan says how long its profile and its
solvers took and what one measured step of it peaked at.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

__all__: list[str] = []

LAYERS = 48


def measure(
    layers: int = LAYERS, budget: str = "25%", seed: int = 0, autocast: torch.dtype | None = None
) -> dict[str, Any]:
    """Plan a ``layers``-layer GPT of the medium family at ``budget``; the figures. With
    ``autocast``, the plan is made inside ``torch.autocast("cpu", dtype=autocast)``: for a loop
    that runs each forward and loss in that context."""
    from ..planning.planner import plan
    from ..workloads.gpt import GPT, GPTConfig, _gpt_batch, _lm_loss

    config = GPTConfig(
        vocab_size=4096, seq_len=256, d_model=256, n_heads=4, n_layers=layers, dropout=0.1
    )
    torch.manual_seed(seed)
    model = GPT(config).train()
    inputs, target = _gpt_batch(
        2, config.seq_len, config.vocab_size, torch.Generator().manual_seed(seed)
    )

    def loss_fn(out: Any) -> torch.Tensor:
        return _lm_loss(out, target)

    context = (
        torch.autocast("cpu", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    )
    start = time.perf_counter()
    with context:
        planned = plan(model, inputs, budget, loss_fn)
    total = time.perf_counter() - start
    options = {o.name for b in planned.blocks for o in [planned.option(b)]}
    return {
        "layers": layers,
        "budget": budget,
        "seconds": total,
        "profile_seconds": float(planned.measured["profile_seconds"]),
        "solve_seconds": float(planned.solver["solve_seconds"]),
        "plain_peak_bytes": planned.plain_peak,
        "predicted_peak_bytes": planned.predicted_peak,
        "verified_peak_bytes": int(planned.measured["verified_peak"]),
        "predicted_time_ratio": planned.predicted_seconds / max(planned.plain_seconds, 1e-12),
        "options_used": sorted(options),
        "autocast": None if autocast is None else str(autocast).removeprefix("torch."),
        "chain_solver": str(planned.solver["chain"]),
    }


def report(result: dict[str, Any]) -> str:
    """The figures as plain lines of text."""
    mib = 2**20
    return "\n".join(
        [
            f"remat.plan on a {result['layers']}-layer GPT (medium family, one block type) at "
            f"{result['budget']}"
            + (f", under torch.autocast ({result['autocast']})" if result.get("autocast") else "")
            + ":",
            f"  whole call {result['seconds']:.1f} s: profile {result['profile_seconds']:.1f} s, "
            f"solve {result['solve_seconds']:.2f} s (block MILPs and the chain DP), the rest "
            "the measured check",
            f"  plain peak {result['plain_peak_bytes'] / mib:,.1f} MiB; predicted "
            f"{result['predicted_peak_bytes'] / mib:,.1f} MiB at "
            f"{result['predicted_time_ratio']:.2f}x, measured "
            f"{result['verified_peak_bytes'] / mib:,.1f} MiB in one step of the plan",
            f"  options used: {', '.join(result['options_used'])}",
            f"  chain: {result['chain_solver']}",
        ]
    )
