"""The tokens constrained requests may produce next, applied to a step's logits.

The host fills one bitmask row per constrained row of the step (worker/sample/grammars.py:
`ceil(vocab / 32)` int32 words, bit `t % 32` of word `t // 32` set when token t is allowed)
while the device runs the forward; the rows go to the device in one copy, and the sampler
sets every token whose bit is clear to -inf before penalties, greedy or drawing. Logprobs stay
those of the raw logits, as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["TokenMasks", "HostBitmask", "apply_token_bitmask"]


def apply_token_bitmask(logits: Tensor, bitmask: Tensor, rows: Tensor) -> Tensor:
    """`logits` `[batch, vocab]` with the tokens that `bitmask` `[len(rows), words]` (int32,
    on the logits' device) clears in its row for `rows` set to -inf; a new tensor. Tokens past
    the bitmask's `32 x words` are cleared too."""
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().view(bitmask.shape[0], -1)
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    masked = logits.clone()
    masked[rows] = logits[rows].masked_fill(~allowed[:, :vocab_size], float("-inf"))
    return masked


@dataclass(slots=True)
class TokenMasks:
    """A step's masks: `rows` (int64, the sampled rows they constrain, on the device) and their
    bitmask rows, already on (or being copied to) the device."""

    rows: Tensor
    bitmask: Tensor

    def apply(self, logits: Tensor) -> Tensor:
        return apply_token_bitmask(logits, self.bitmask, self.rows)


class HostBitmask:
    """A host buffer of bitmask rows reused every step (pinned on CUDA, so its copy to the
    device is asynchronous), filled row by row then sent as a `TokenMasks`. It starts with a
    row a sequence and doubles when a step verifying drafts needs more."""

    def __init__(self, buffer: Tensor, device: torch.device) -> None:
        self.device = device
        self._buffer = self._placed(buffer)

    def _placed(self, buffer: Tensor) -> Tensor:
        return buffer.pin_memory() if self.device.type == "cuda" else buffer

    def send(self, rows: list[int], fill) -> TokenMasks:
        """`fill(bitmask, k)` writes the k-th row; rows k < len(rows) go to the device."""
        if len(rows) > self._buffer.shape[0]:
            size = max(len(rows), 2 * self._buffer.shape[0])
            self._buffer = self._placed(self._buffer.new_empty((size, self._buffer.shape[1])))
        host = self._buffer[: len(rows)]
        for k in range(len(rows)):
            fill(host, k)
        return TokenMasks(torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True),
                          host.to(self.device, non_blocking=True))
