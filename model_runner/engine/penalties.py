"""Penalties on the tokens a sequence already holds, applied to a batch's logits at once.

    logits:  [S, V] fp32, one row per sequence
    counts:  [S, V] fp32, how often row s holds token v (`token_counts`)

- repetition penalty (transformers' `RepetitionPenaltyLogitsProcessor`): every token in the
  row's prompt or output has its logit divided by the penalty if positive, multiplied if
  negative, once however often it occurs;
- frequency and presence penalties (OpenAI's definition, as vLLM applies it): over the row's
  output tokens only, logit -= frequency * count + presence * (count > 0).

vLLM applies the repetition penalty first, then frequency and presence, all to the raw logits
before temperature; `sampling.Sampler` does the same. A row whose penalty is off contributes no
tokens to its counts (`token_counts` takes an empty list for it), and its penalty value leaves
its logits unchanged anyway.
"""

from collections.abc import Sequence

import torch


def token_counts(token_lists: Sequence[Sequence[int]], vocab: int,
                 device: torch.device) -> torch.Tensor:
    """[S, V] fp32: how often token v occurs in token_lists[s].

    Ids >= V (an embedding table larger than the output layer) are ignored, as transformers
    does; a negative id is a ValueError.
    """
    row_index: list[int] = []
    token_index: list[int] = []
    for s, tokens in enumerate(token_lists):
        row_index.extend([s] * len(tokens))
        token_index.extend(tokens)
    if token_index and min(token_index) < 0:
        raise ValueError(f"token ids must be >= 0, got {min(token_index)}")
    # Column V collects the ids past the output layer, and is dropped.
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.float32, device=device)
    tokens_t = torch.tensor(token_index, dtype=torch.int64, device=device).clamp_(max=vocab)
    rows_t = torch.tensor(row_index, dtype=torch.int64, device=device)
    counts.index_put_((rows_t, tokens_t), torch.ones_like(tokens_t, dtype=torch.float32),
                      accumulate=True)
    return counts[:, :vocab]


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor,
                             penalty: torch.Tensor) -> torch.Tensor:
    """Seen tokens' logits divided by the row's penalty if positive, multiplied if negative.

    logits: [S, V] fp32, seen: [S, V] bool, penalty: [S] fp32 (1 = off).
    """
    penalty = penalty[:, None]
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(seen, penalized, logits)


def apply_output_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: torch.Tensor,
                           frequency: torch.Tensor) -> torch.Tensor:
    """logits - frequency * counts - presence * (counts > 0), per row (vLLM's order).

    logits: [S, V] fp32, counts: [S, V] fp32 (the output tokens'), presence and frequency: [S]
    fp32 (0 = off).
    """
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * (counts > 0).float()
