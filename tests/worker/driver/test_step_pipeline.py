"""The step pipeline's parts without a model: which plans run ahead, what the executor
receives, where tokens are committed, how a request is refused, what a Stats report costs."""

from __future__ import annotations

import msgspec
import pytest
import torch

from spillway.protocol.hashing import DEFAULT_HASH_SEED, root_hash
from spillway.protocol.messages import Generate, SamplingParams, StructuredKind, StructuredOutput
from spillway.protocol.reasoning import Phase, ThinkingPolicy
from spillway.worker.core.block_manager import BlockManager
from spillway.worker.runner.executor import PackedStep
from spillway.worker.core.step_plan import KVCopies
from spillway.worker.runner.model_runner import ChunkInput
from spillway.worker.driver.pipeline import LaunchedStep, pack_step
from spillway.worker.core.request import Request, refusal
from spillway.worker.core.scheduler import Scheduler
from spillway.worker.driver.stats import collect_stats
from spillway.worker.attention.step_inputs import StepInputs

BLOCK = 4
ROOT = root_hash(DEFAULT_HASH_SEED, "test-model")


CHOICE = StructuredOutput(kind=StructuredKind.CHOICE, spec='["yes", "no"]')

def make_scheduler(num_blocks: int = 32, max_model_len: int = 32, max_num_batched_tokens: int = 64) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BLOCK, True), max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                     max_model_len=max_model_len, block_size=BLOCK, root_hash=ROOT, eos_token_ids=[999],
                     vocab_size=500)


def make_request(request_id: str, prompt: list[int], arrival: int = 0, thinking: ThinkingPolicy | None = None,
                 **params) -> Request:
    msg = Generate(request_id=request_id, prompt_token_ids=prompt, block_hashes=[],
                   params=SamplingParams(**{"max_tokens": 8, "temperature": 0.0, **params}), thinking=thinking)
    return Request.from_generate(msg, arrival)


def prefill_then_plan(scheduler: Scheduler, *requests: Request):
    """Add the requests, run their prefill step (each samples 7), return the next plan."""
    for request in requests:
        scheduler.add(request)
    plan = scheduler.schedule()
    expected = all((r.samples_on_device or r.samples_after_commit) and not r.params.min_tokens for r in requests)
    assert plan.run_ahead is expected  # a prompt's first token, like any other
    scheduler.update(plan, {chunk.request.request_id: 7 for chunk in plan.chunks})
    return scheduler.schedule()


@pytest.mark.parametrize("params, thinking, expected", [
    ({}, None, True),
    ({"temperature": 0.8, "seed": 3}, None, True),
    ({"logprobs": 2}, None, False),
    ({"repetition_penalty": 1.2}, None, False),
    ({"presence_penalty": 0.5}, None, False),
    ({"min_tokens": 3}, None, False),  # one output so far
    ({}, ThinkingPolicy(start_token_ids=(5,), end_token_ids=(6,), budget=4), False),
    ({"structured": CHOICE}, None, True),  # under a mask filled after the commit before
    ({"structured": CHOICE, "logprobs": 1}, None, False),
])
def test_a_decode_plan_runs_ahead_only_when_the_device_chooses_every_token_alone(params, thinking, expected):
    scheduler = make_scheduler()
    plain = make_request("plain", [1, 2, 3], 0)
    other = make_request("other", [4, 5, 6, 7, 8], 1, thinking, **params)
    device_alone = not params.keys() & {"logprobs", "repetition_penalty", "presence_penalty"} and thinking is None
    assert other.samples_on_device == (device_alone and "structured" not in params)
    assert other.samples_after_commit == (device_alone and "structured" in params)
    plan = prefill_then_plan(scheduler, plain, other)
    assert [(c.request.request_id, c.num_tokens, c.sample) for c in plan.chunks] == [("plain", 1, True),
                                                                                      ("other", 1, True)]
    assert plan.run_ahead is expected
    assert plan.samples_after_commit is (expected and "structured" in params)


def test_min_tokens_reached_lets_the_plan_run_ahead():
    scheduler = make_scheduler()
    request = make_request("r", [1, 2, 3], min_tokens=2)
    plan = prefill_then_plan(scheduler, request)
    assert not plan.run_ahead and request.num_output_tokens == 1
    scheduler.update(plan, {"r": 8})
    assert scheduler.schedule().run_ahead


def test_a_plan_mixing_a_prompt_into_decodes_runs_ahead_and_an_earlier_chunk_never_holds_it_back():
    scheduler = make_scheduler(max_model_len=64, max_num_batched_tokens=16)
    plan = prefill_then_plan(scheduler, make_request("d", [1, 2, 3]))
    assert plan.run_ahead
    scheduler.update(plan, {"d": 8})
    long_prompt = make_request("p", list(range(2, 30)), 1)  # 28 tokens: chunks of 15 and 13
    scheduler.add(long_prompt)
    plan = scheduler.schedule()
    assert [(c.request.request_id, c.num_tokens, c.sample) for c in plan.chunks] == [("d", 1, True),
                                                                                      ("p", 15, False)]
    assert plan.run_ahead
    scheduler.update(plan, {"d": 9})
    plan = scheduler.schedule()
    assert [(c.request.request_id, c.num_tokens, c.sample) for c in plan.chunks] == [("d", 1, True),
                                                                                      ("p", 13, True)]
    assert plan.run_ahead
    scheduler.update(plan, {"d": 10, "p": 11})
    scheduler.add(make_request("l", [5, 6], 2, logprobs=1))  # its first token is read on the host
    assert not scheduler.schedule().run_ahead


def test_pack_step_is_plain_data_with_the_pending_tokens_fed_from_the_step_before():
    scheduler = make_scheduler()
    first, second = make_request("a", [1, 2, 3], 0), make_request("b", [4, 5, 6, 7, 8, 9], 1)
    plan = prefill_then_plan(scheduler, first, second)
    scheduler.mark_in_flight(plan)
    late = make_request("c", [10, 11], 2)
    scheduler.add(late)
    ahead = scheduler.schedule(ahead=True)
    # The step in flight sampled b in row 0 and a in row 1 of its token ids.
    previous = LaunchedStep(plan, torch.tensor([40, 30]), None, None, {"b": 0, "a": 1}, {})
    packed = pack_step(ahead, previous)
    assert [(c.token_ids, c.start, c.slot_table) for c in packed.chunks] == [
        ([0], 4, [0, 3]), ([0], 7, [1, 2]), ([10, 11], 0, [4])]
    assert (packed.feed_rows, packed.feed_sources, packed.sample_rows) == ([0, 1], [1, 0], [0, 1, 2])
    wire = msgspec.msgpack.encode(packed)  # what a driver would broadcast to N executors
    assert msgspec.msgpack.decode(wire, type=PackedStep) == packed


def test_a_chunk_that_does_not_reach_the_last_token_is_not_sampled():
    scheduler = make_scheduler(num_blocks=64, max_model_len=200)
    scheduler.max_num_batched_tokens = 6
    scheduler.add(make_request("long", list(range(1, 11))))
    packed = pack_step(scheduler.schedule(), None)
    assert [(c.token_ids, c.start) for c in packed.chunks] == [([1, 2, 3, 4, 5, 6], 0)]
    assert (packed.feed_rows, packed.sample_rows) == ([], [])


def test_the_commit_advances_the_thinking_state_and_forces_the_end_at_the_budget():
    scheduler = make_scheduler()
    policy = ThinkingPolicy(start_token_ids=(5,), end_token_ids=(6,), budget=2)
    request = make_request("think", [1, 2, 3], thinking=policy)
    plan = prefill_then_plan(scheduler, request)  # samples 7: not the start marker
    assert request.thinking_state.phase == Phase.BEFORE
    for token in (5, 20, 21):
        scheduler.update(plan, {"think": token})
        plan = scheduler.schedule()
    assert request.output_token_ids == [7, 5, 20, 21]
    assert (request.thinking_state.phase, request.thinking_state.forced) == (Phase.FORCING, (6,))


@pytest.mark.parametrize("prompt, params, thinking, in_use, message", [
    ([1, 2], {}, None, True, "request id 'r' is already in use"),
    ([], {}, None, False, "the prompt is empty"),
    (list(range(1, 33)), {}, None, False, "the prompt has 32 tokens; max_model_len=32 leaves no room for output"),
    ([1, 500], {}, None, False, "prompt token ids must lie in [0, 500)"),
    ([1, -1], {}, None, False, "prompt token ids must lie in [0, 500)"),
    ([1, 2], {"max_tokens": 0}, None, False, "max_tokens must be at least 1, got 0"),
    ([1, 2], {}, ThinkingPolicy(start_token_ids=(), end_token_ids=(6,)), False,
     "the thinking policy needs start and end markers and a non-negative budget"),
    ([1, 2], {}, ThinkingPolicy(start_token_ids=(5,), end_token_ids=(6,), budget=-1), False,
     "the thinking policy needs start and end markers and a non-negative budget"),
    ([1, 2], {}, None, False, None),
])
def test_one_function_refuses_a_request_with_a_message(prompt, params, thinking, in_use, message):
    request = make_request("r", prompt, thinking=thinking, **params)
    assert refusal(request, max_model_len=32, block_size=BLOCK, vocab_size=500, in_use=in_use) == message


def test_the_scheduler_refuses_through_the_same_function():
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match=r"lie in \[0, 500\)"):
        scheduler.add(make_request("r", [1, 777]))
    assert not scheduler.has_unfinished


def test_a_routine_stats_report_does_not_walk_the_blocks():
    scheduler = make_scheduler()
    prefill_then_plan(scheduler, make_request("a", [1, 2, 3, 4, 5]))
    manager = scheduler.block_manager
    walks = []
    manager.check_invariants = lambda: walks.append(1)
    stats = collect_stats(manager, scheduler, num_steps=3, check_invariants=False)
    assert walks == [] and stats.invariants_ok is None
    assert (stats.num_running, stats.num_gpu_blocks, stats.num_free_gpu_blocks, stats.num_steps) == (1, 32, 30, 3)
    assert collect_stats(manager, scheduler, num_steps=3, check_invariants=True).invariants_ok is True
    assert walks == [1]

    def broken():
        raise AssertionError("a block is in the free list twice")

    manager.check_invariants = broken
    assert collect_stats(manager, scheduler, num_steps=3, check_invariants=True).invariants_ok is False


@pytest.mark.parametrize("query_lens, starts", [([3, 1], [0, 20]), ([1, 1, 1], [4, 17, 0])])
def test_triton_metadata_of_an_eager_step_reads_the_staged_views(query_lens, starts):
    """Prefill / mixed and eager decode steps: the kernels read the context lengths and row
    starts that the step's one host-to-device copy brought, never a second copy."""
    from spillway.worker.attention.triton_paged import TritonAttentionBackend

    inputs = StepInputs(max_num_tokens=16, max_num_seqs=4, max_blocks_per_seq=8, block_size=16,
                        device=torch.device("cpu"))
    chunks = [ChunkInput([9] * n, start, [seq, 4 + seq]) for seq, (n, start) in enumerate(zip(query_lens, starts))]
    layout = inputs.stage(chunks)
    metadata = TritonAttentionBackend(16).metadata_for(layout)
    if metadata.prefill is not None:
        assert len(set(query_lens)) > 1
        assert metadata.prefill.query_start_loc is layout.query_start_loc
        assert metadata.prefill.seq_lens is layout.context_lens
        assert metadata.prefill.seq_lens.tolist() == [s + n for s, n in zip(starts, query_lens)]
    else:
        assert metadata.decode.context_lens is layout.context_lens
        assert metadata.decode.context_lens.tolist() == [s + 1 for s in starts]
    assert metadata.slot_mapping is layout.slot_mapping


def test_engine_stats_walk_the_blocks_only_when_asked_or_in_debug_mode(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from spillway.protocol.config import WorkerConfig
    from spillway.worker.driver.engine import Engine

    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path)
    engine = Engine(WorkerConfig(model=str(tmp_path), device="cpu", dtype="float32", max_num_seqs=2,
                                 num_gpu_blocks_override=40))
    assert engine.debug_invariants  # tests/conftest.py turns debug mode on for every engine
    walks = []
    engine.block_manager.check_invariants = lambda: walks.append(1)
    engine.debug_invariants = False
    assert engine.stats().invariants_ok is None and walks == []
    assert engine.stats(check_invariants=True).invariants_ok is True and walks == [1]
    engine.debug_invariants = True
    assert engine.stats().invariants_ok is True and walks == [1, 1]
    assert engine.stats().num_free_gpu_blocks == 40


def test_the_executor_refuses_kv_copies_without_a_cpu_tier(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from spillway.protocol.config import WorkerConfig
    from spillway.worker.driver.engine import Engine

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    engine = Engine(WorkerConfig(model=str(tmp_path), device="cpu", dtype="float32", max_num_seqs=2,
                                 num_gpu_blocks_override=8))
    step = PackedStep([ChunkInput([1, 2], 0, [0])], [], [], [0])
    assert engine.executor.execute(step).shape == (1, 64)
    copying = PackedStep([ChunkInput([1, 2], 0, [0])], [], [], [0], KVCopies(gpu_to_cpu=((0, 0),)))
    with pytest.raises(ValueError, match="no CPU tier"):
        engine.executor.execute(copying)


def test_packed_prompt_ids_arrive_as_the_list_and_are_range_checked_by_their_maximum():
    from spillway.protocol.hashing import pack_token_ids

    def packed(request_id: str, prompt: list[int]) -> Request:
        msg = Generate(request_id=request_id, prompt_token_ids=pack_token_ids(prompt), block_hashes=[],
                       params=SamplingParams(max_tokens=8))
        return Request.from_generate(msg, 0)

    request = packed("p", [3, 499, 0, 7])
    assert request.prompt_token_ids == [3, 499, 0, 7] and request.max_prompt_token_id == 499
    assert refusal(request, max_model_len=32, block_size=BLOCK, vocab_size=500) is None
    assert refusal(packed("q", [3, 500]), max_model_len=32, block_size=BLOCK,
                   vocab_size=500) == "prompt token ids must lie in [0, 500)"
    with pytest.raises(ValueError, match="not a multiple of 4"):
        Request.from_generate(Generate(request_id="r", prompt_token_ids=b"\x01\x00\x00", block_hashes=[],
                                       params=SamplingParams(max_tokens=8)), 0)


def test_packed_prompt_ids_stay_packed_through_a_request_and_its_block_hashes_match():
    from spillway.protocol.hashing import block_hashes, pack_token_ids

    prompt = list(range(10, 23))  # 3 full blocks and a token
    scheduler = make_scheduler()
    request = Request.from_generate(Generate(request_id="p", prompt_token_ids=pack_token_ids(prompt),
                                             block_hashes=block_hashes(prompt, BLOCK, ROOT),
                                             params=SamplingParams(max_tokens=4, temperature=0.0)), 0)
    scheduler.add(request)
    plan = scheduler.schedule()
    assert [chunk.token_ids for chunk in pack_step(plan, None).chunks] == [prompt]
    for token in (40, 41, 42, 43):
        scheduler.update(plan, {"p": token})
        plan = scheduler.schedule()
    assert request.is_finished and request.outputs == [40, 41, 42, 43]
    assert not isinstance(request.prompt, list)  # never made Python ints
    assert request.token_ids(11, 15) == [21, 22, 40, 41] and request.token_ids(14, 16) == [41, 42]
    # the output block's hash continues the gateway's chain from the packed ids
    assert request.block_hashes == block_hashes(prompt + [40, 41, 42, 43], BLOCK, ROOT)
    assert request.all_token_ids == prompt + [40, 41, 42, 43] and request.prompt_token_ids == prompt
    request.append_token(44)
    assert request.all_token_ids[-2:] == [43, 44] and request.token_ids(16, 18) == [43, 44]
    # the sampler gets the packed prompt as it is, unless a penalty reads it: then a list, made once
    fresh = Request.from_generate(Generate(request_id="q", prompt_token_ids=pack_token_ids(prompt), block_hashes=[],
                                           params=SamplingParams(max_tokens=4)), 0)
    penalized = Request.from_generate(Generate(request_id="r", prompt_token_ids=pack_token_ids(prompt),
                                               block_hashes=[], params=SamplingParams(repetition_penalty=1.2)), 0)
    assert not isinstance(fresh.sampling_prompt, list) and list(fresh.sampling_prompt) == prompt
    assert penalized.sampling_prompt == prompt and penalized.sampling_prompt is penalized.sampling_prompt
