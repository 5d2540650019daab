"""A worker's speculative decoding, built from its `SpeculativeConfig`."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from spillway.protocol.config import SpeculativeConfig
from spillway.worker.sample.sampler import Sampler
from spillway.worker.speculative.decoder import SpecDecoder
from spillway.worker.speculative.proposer import NgramProposer, Proposer, ReplayProposer
from spillway.worker.speculative.switch import SpeculationSwitch

logger = logging.getLogger(__name__)

# Proposing one token with a draft model, relative to one decode step of the target: a guess
# for a draft about a tenth of the target's size. Calibrate on the GPU.
DRAFT_MODEL_COST = 0.1


def build_spec_decoder(config: SpeculativeConfig, sampler: Sampler, *, target_vocab_size: int,
                       device: torch.device, dtype: torch.dtype, max_model_len: int, max_num_seqs: int,
                       block_size: int, max_num_batched_tokens: int, cuda_graphs: bool = False,
                       draft_pool_blocks: Callable[[int], int] | None = None) -> SpecDecoder:
    """The proposer, the switch and the verification; ValueError for a configuration no
    worker can run (a draft model whose vocabulary differs from the target's, a draft pool
    that cannot hold one request, ...). `cuda_graphs`: a draft model's runner captures its
    graphs, decode batches up to the largest the switch speculates in. `draft_pool_blocks`: a
    draft model's pool size from the bytes of one of its blocks (`DraftModelProposer.load`)."""
    problem = config.problem()
    if problem is not None:
        raise ValueError(problem)
    proposer: Proposer
    draft_cost = 0.0
    match config.method:
        case "ngram":
            proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        case "replay":
            proposer = ReplayProposer(load_replay(Path(config.replay_path)))
        case "draft_model":
            from spillway.worker.speculative.draft_model import DraftModelProposer

            proposer = DraftModelProposer.load(
                config.model, target_vocab_size=target_vocab_size, device=device, dtype=dtype,
                max_model_len=max_model_len, max_num_seqs=max_num_seqs, block_size=block_size,
                max_num_batched_tokens=max_num_batched_tokens, num_speculative_tokens=config.num_speculative_tokens,
                max_graph_batch_size=min(config.disable_by_batch_size, max_num_seqs) if cuda_graphs else None,
                pool_blocks=draft_pool_blocks)
            draft_cost = DRAFT_MODEL_COST
            if config.draft_tensor_parallel_size > 1:
                logger.info("speculative draft tensor parallel size %d: the draft model runs whole on the first "
                            "rank's device, beside its shard of the target (a draft is small; it needs no "
                            "collectives)", config.draft_tensor_parallel_size)
        case _:
            raise AssertionError(config.method)
    switch = SpeculationSwitch(config.num_speculative_tokens, max_batch_size=config.disable_by_batch_size,
                               draft_cost=draft_cost)
    return SpecDecoder(proposer, switch, sampler)


def load_replay(path: Path) -> dict[tuple[int, ...], list[int]]:
    """Recorded outputs by prompt: JSON lines {"prompt_token_ids": [...], "output_token_ids": [...]}."""
    outputs = {}
    with path.open() as lines:
        for line in lines:
            if line.strip():
                record = json.loads(line)
                outputs[tuple(record["prompt_token_ids"])] = list(record["output_token_ids"])
    return outputs
