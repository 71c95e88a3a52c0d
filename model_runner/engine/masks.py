"""The tokens a row may not sample this step: the sampler's step 2, on the raw logits, before
penalties, temperature and truncation (vLLM applies its bitmask before its sampler, and min_tokens
as a logits processor).

    logits: [S, V] fp32 (left as it is: a row to mask makes a copy); rows: S SamplingRow records

- structured outputs: one xgrammar token bitmask for the batch, [S, ceil(V / 32)] int32, filled
  for the constrained rows only (`GrammarState.fill`, after the matcher caught up with the row's
  output tokens) and applied to those rows in one call (`apply_token_bitmask_inplace` with
  their indices); the other rows' logits are untouched.
- min_tokens (vLLM's): a row that has generated fewer than min_tokens tokens has its stop token
  ids at -inf, in one indexed write for the batch. Where that would leave a constrained row
  nothing to sample (its constraint is complete and allows only its stop token), the
  constraint wins and the row keeps its stop token.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

if TYPE_CHECKING:
    from pagedkv.model_runner.engine.sampling import SamplingRow


def mask_logits(logits: torch.Tensor, rows: Sequence["SamplingRow"]) -> torch.Tensor:
    """`logits` with what each row may not sample next at -inf. [S, V] fp32"""
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    early = [i for i, row in enumerate(rows)
             if len(row.output_token_ids) < row.params.min_tokens and row.params.stop_token_ids]
    if not constrained and not early:
        return logits
    logits = logits.clone()
    if constrained:
        bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
        for i in constrained:
            grammar = rows[i].grammar
            assert grammar is not None
            grammar.sync(rows[i].output_token_ids)
            grammar.fill(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=constrained)
    if early:
        _mask_early_stops(logits, rows, early)
    return logits


def _mask_early_stops(logits: torch.Tensor, rows: Sequence["SamplingRow"],
                      early: list[int]) -> None:
    """Stop token ids at -inf, in place, in the `early` rows (fewer than min_tokens
    generated)."""
    row_ids = [i for i in early for _ in rows[i].params.stop_token_ids]
    token_ids = [t for i in early for t in rows[i].params.stop_token_ids]
    kept = logits[early]  # a copy: restored where the mask leaves nothing
    logits[row_ids, token_ids] = float("-inf")
    empty = torch.isneginf(logits[early]).all(dim=-1)
    if bool(empty.any()):
        index = torch.tensor(early, device=logits.device)[empty]
        logits[index] = kept[empty]
