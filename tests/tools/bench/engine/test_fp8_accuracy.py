"""FP8 weights on the real default model (SmolLM2-135M-Instruct, float32 on the CPU), teacher-forced
over 1,000 tokens of the Python language reference, through tools/bench/engine/fp8_accuracy.py.

Measured on the CPU (docs/performance.md): top-1 agreement 0.905, mean KL 0.030 nats. The two
roundings add up: FP8 weights alone give 0.93 / 0.018, per-token FP8 activations alone 0.952 /
0.010, and bfloat16 alone (no FP8) 0.978 / 0.0011 against float32, so a 135M model with 3-bit
mantissas moves this far by itself. The bounds leave room for another torch's summation order
(a position whose top two logits nearly tie flips either way) and no more: mean KL at most
twice the measured, top-1 at least 0.88. A wrong scale (a missing per-row or per-token factor,
a transposed scale) gives KL above 1 nat."""

from __future__ import annotations

import pytest
import torch

from spillway.protocol.local.model_files import load_tokenizer
from spillway.tools.bench.engine.fp8_accuracy import compare_logits, measure, reference_text
from spillway.worker.models import loader

CPU = torch.device("cpu")


def test_compare_logits_counts_agreement_and_kl():
    reference = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    other = torch.tensor([[2.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    result = compare_logits(reference, other)
    assert result.positions == 2 and result.top1_agreement == 0.5
    p = torch.softmax(reference[1].double(), -1)
    kl = float((p * (p.log() - torch.log_softmax(other[1].double(), -1))).sum())
    assert result.mean_kl == pytest.approx(kl / 2) and result.max_kl == pytest.approx(kl)


@pytest.mark.slow
def test_fp8_weights_keep_smollm2s_next_token_distributions():
    files = loader.resolve_model(None)
    token_ids = load_tokenizer(files)(reference_text(), add_special_tokens=False)["input_ids"][:1000]
    assert len(token_ids) == 1000
    result = measure(None, token_ids, device=CPU, dtype=torch.float32)
    assert result.positions == 1000
    assert result.top1_agreement >= 0.88
    assert 0 < result.mean_kl <= 0.06
