"""The reference the incremental decoders are compared with: a vanilla Transformer's decoding, which runs the whole
prefix again, in one segment without memory, for every new token."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from txl_dist.inference import TokenSampler
from txl_dist.model import TransformerXLLM


def generate_ids_recompute(
    model: TransformerXLLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    max_context: int | None = None,
    stop_ids: Collection[int] = (),
    **sampling,
) -> list[int]:
    """Like `txl_dist.inference.generate_ids` (``sampling``: its temperature, top_k, top_p, seed and greedy), but
    every new token recomputes the whole prefix (its last ``max_context`` tokens when given)."""
    device = next(model.parameters()).device
    choose = TokenSampler(device, **sampling)
    ids = list(prompt_ids)
    new_ids: list[int] = []
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            while len(new_ids) < max_new_tokens:
                context = ids if max_context is None else ids[-max_context:]
                hidden, _ = model.hidden_states(torch.tensor([context], dtype=torch.long, device=device))
                token = choose.from_hidden(model, hidden[-1])
                new_ids.append(token)
                ids.append(token)
                if token in stop_ids:
                    break
    finally:
        model.train(was_training)
    return new_ids
