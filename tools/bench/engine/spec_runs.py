"""Driving one engine with and without speculation for tools/bench/engine/spec.py.

One engine serves every run of a section: speculation is attached (`attach_spec`, through
the same `build_spec_decoder` the engine's constructor calls) and detached between runs,
so the runs differ in nothing else. The prefix cache is emptied before each run: a prompt
seen by an earlier run would otherwise skip its prefill.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from spillway.protocol.config import SpeculativeConfig
from spillway.protocol.local.envs import worker_config_from_env
from spillway.protocol.messages import Generate, SamplingParams
from spillway.protocol.local.model_files import builtin_config_names
from spillway.worker.driver.engine import Engine
from spillway.worker.models import build_model, loader
from spillway.worker.speculative.decoder import SpecDecoder
from spillway.worker.speculative.setup import build_spec_decoder
from spillway.worker.speculative.switch import SpeculationSwitch
from spillway.worker.core.step_plan import StepPlan


def make_engine(model: str, device: str, *, max_model_len: int, max_num_seqs: int, num_blocks: int | None,
                async_scheduling: bool | None) -> Engine:
    """A built-in config gets dummy weights; a folder or GGUF file its own. Built with speculation
    (detached at once), so that its executor captures the verify graphs the attached runs use."""
    engine = Engine(worker_config_from_env(
        model=model, load_format="dummy" if model in builtin_config_names() else "auto",
        dtype="bfloat16" if device == "cuda" else "float32", device=device, max_model_len=max_model_len,
        max_num_seqs=max_num_seqs, num_gpu_blocks_override=num_blocks, async_scheduling=async_scheduling,
        speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=1)))
    engine.use_speculation(None)
    return engine


class CountedSpec(SpecDecoder):
    """The engine's speculation, counting per step what the switch answered and whether
    any request got drafts (the proposer may find none)."""

    def __init__(self, spec: SpecDecoder, switch: SpeculationSwitch | None = None) -> None:
        super().__init__(spec.proposer, switch or spec.switch, spec.sampler)
        self.steps_on = self.steps_off = self.steps_drafted = 0

    def lookahead(self, batch_size: int) -> int:
        slots = super().lookahead(batch_size)
        if slots:
            self.steps_on += 1
        else:
            self.steps_off += 1
        return slots

    def propose(self, plan: StepPlan) -> bool:
        drafted = super().propose(plan)
        self.steps_drafted += drafted
        return drafted


def attach_spec(engine: Engine, config: SpeculativeConfig | None, *, always_on: bool = False) -> CountedSpec | None:
    """Speculation as `config` builds it (None: off). `always_on`: the switch's costs zeroed,
    so it speculates whenever the batch allows."""
    if config is None:
        engine.use_speculation(None)
        return None
    built = build_spec_decoder(
        config, engine.sampler, target_vocab_size=engine.vocab_size, device=engine.device, dtype=engine.dtype,
        max_model_len=engine.max_model_len, max_num_seqs=engine.config.max_num_seqs,
        block_size=engine.block_size, max_num_batched_tokens=engine.max_num_batched_tokens,
        cuda_graphs=engine.device.type == "cuda" and not engine.config.enforce_eager,
        draft_pool_blocks=lambda block_bytes: late_draft_pool_blocks(engine, block_bytes))
    switch = replace(built.switch, draft_cost=0.0, verify_cost=0.0) if always_on else None
    spec = CountedSpec(built, switch)
    engine.use_speculation(spec)
    return spec


def late_draft_pool_blocks(engine: Engine, draft_block_bytes: int) -> int:
    """A draft attached after the target's pool: as many blocks as the target's (as the engine
    sizes them), within half the device memory still free."""
    if engine.device.type != "cuda":
        return engine.block_manager.num_gpu_blocks
    free, _ = torch.cuda.mem_get_info(engine.device)
    return min(engine.block_manager.num_gpu_blocks, free // 2 // draft_block_bytes)


def recount(engine: Engine) -> CountedSpec:
    """The attached speculation with its counts from zero and its switch as a server starts
    it: the same proposer (a draft model stays loaded) and costs, but nothing of what the
    warm-up measured (its prompt is not one the replay proposer knows)."""
    old = engine.spec.switch
    spec = CountedSpec(engine.spec, SpeculationSwitch(old.num_speculative_tokens, max_batch_size=old.max_batch_size,
                                                      draft_cost=old.draft_cost, verify_cost=old.verify_cost))
    engine.use_speculation(spec)
    return spec


def random_prompts(count: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256, vocab_size) for _ in range(length)] for _ in range(count)]


QUOTED_FILES = ("docs/architecture.md", "worker/core/scheduler.py", "README.md", "worker/core/block_manager.py")
RESTART_CUE = 24  # tokens of the document repeated after it: the model goes on quoting


def quote_back_prompts(model: str, count: int, length: int) -> list[list[int]]:
    """Repetitive text for prompt lookup: each prompt is the start of a file of this tree
    (prose, then code) followed by the document's first tokens again, so that a greedy
    continuation quotes the document back and its n-grams are in the prompt. Needs `model`'s
    tokenizer (a folder or GGUF file with real weights: dummy weights quote nothing)."""
    from spillway.protocol.local.model_files import load_tokenizer, resolve_model

    tokenizer = load_tokenizer(resolve_model(model))
    root = Path(__file__).resolve().parents[3]
    prompts = []
    for index in range(count):
        text = (root / QUOTED_FILES[index % len(QUOTED_FILES)]).read_text()
        document = tokenizer.encode(text, add_special_tokens=False)[: length - RESTART_CUE - 2]
        newline = tokenizer.encode("\n\n", add_special_tokens=False)
        prompts.append(document + newline + document[:RESTART_CUE])
    return prompts


def write_replay(path: Path, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """The JSON lines the replay proposer reads (`worker/speculative/setup.py` `load_replay`)."""
    with path.open("w") as lines:
        for prompt, output in zip(prompts, outputs):
            lines.write(json.dumps({"prompt_token_ids": prompt, "output_token_ids": output}) + "\n")


@dataclass(slots=True)
class Run:
    """Greedy runs over some prompts: their outputs, and the timed tokens and seconds."""

    outputs: list[list[int]] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0  # engine steps committed

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _synchronize(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def _add(engine: Engine, request_id: str, prompt: list[int], new_tokens: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    refused = engine.add_request(Generate(request_id=request_id, prompt_token_ids=prompt, block_hashes=[],
                                          params=params))
    assert refused is None, refused.error


def decode_one_at_a_time(engine: Engine, prompts: list[list[int]], new_tokens: int, tag: str) -> Run:
    """Each prompt alone (batch 1), greedy. Timed from the call that returns a request's first
    tokens to its last: the prefill is left out, and so are the tokens of that first call
    (with speculation it may also hold a verified step's)."""
    assert engine.reset_prefix_cache()
    run, steps_before = Run(), engine.num_steps
    for index, prompt in enumerate(prompts):
        _add(engine, f"{tag}-{index}", prompt, new_tokens)
        output: list[int] = []
        started = None
        while engine.has_work:
            output += [token for delta in engine.step() for token in delta.new_token_ids]
            if started is None and output:
                _synchronize(engine)
                started, first = time.perf_counter(), len(output)
        _synchronize(engine)
        run.seconds += time.perf_counter() - started
        run.tokens += len(output) - first
        assert len(output) == new_tokens, (len(output), new_tokens)
        run.outputs.append(output)
    run.steps = engine.num_steps - steps_before
    return run


def generate_all_at_once(engine: Engine, prompts: list[list[int]], new_tokens: int, tag: str) -> Run:
    """Every prompt added at once, stepped until all are done: output tokens over the whole
    time, prefills included."""
    assert engine.reset_prefix_cache()
    steps_before = engine.num_steps
    _synchronize(engine)
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        _add(engine, f"{tag}-{index}", prompt, new_tokens)
    outputs: dict[str, list[int]] = {f"{tag}-{index}": [] for index in range(len(prompts))}
    while engine.has_work:
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
    _synchronize(engine)
    seconds = time.perf_counter() - started
    assert all(len(output) == new_tokens for output in outputs.values())
    return Run(list(outputs.values()), new_tokens * len(prompts), seconds, engine.num_steps - steps_before)


def matching_tokens(got: list[list[int]], want: list[list[int]]) -> int:
    """Tokens of `got` that follow `want` before the first difference, summed over requests."""
    total = 0
    for got_tokens, want_tokens in zip(got, want):
        same = next((i for i, (a, b) in enumerate(zip(got_tokens, want_tokens)) if a != b),
                    min(len(got_tokens), len(want_tokens)))
        total += same
    return total


def write_truncated_copy(engine: Engine, num_layers: int, folder: Path) -> None:
    """A checkpoint of the engine's model cut to its first `num_layers` decoder layers (same
    embedding, final norm and head): a draft that agrees with the target as far as those
    layers decide. A dummy model is rebuilt from its seed (the loaded one's weights are
    re-laid for the device), a checkpoint's weights are read from its files."""
    from safetensors.torch import save_file

    files = loader.resolve_model(engine.config.model, engine.config.load_format)
    hf_config = loader.load_config(files)
    if files.load_format == "dummy":
        model = build_model(hf_config, device=engine.device, dtype=engine.dtype)
        loader.init_dummy_weights(model, seed=engine.config.seed)
        weights = model.checkpoint_weights()
    else:
        weights = loader.iter_weights(files)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    kept = {}
    for name, tensor in weights:
        if name.startswith("model.layers.") and int(name.split(".")[2]) >= num_layers:
            continue
        if tied and name == "lm_head.weight":  # the embedding's own tensor
            continue
        kept[name] = tensor.detach().to("cpu", engine.dtype).contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(kept, str(folder / "model.safetensors"))
    config = json.loads((files.path / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    if "max_window_layers" in config:
        config["max_window_layers"] = min(config["max_window_layers"], num_layers)
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:num_layers]
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def damp_layers_after(engine: Engine, num_layers: int, factor: float) -> None:
    """Scale the two norm weights of the engine's decoder layers from `num_layers` on by
    `factor`: what the attention reads as values and what the MLP reads shrink with it (q and
    k are normed again where the family norms them), so each of those layers adds a small
    update to the stream the first `num_layers` computed, and a draft cut to those layers
    (`write_truncated_copy`, which rebuilds them unscaled) agrees with the target often. It
    makes a dummy target whose acceptance by a cut draft is measurable; the weights are
    changed in place, so captured graphs read them."""
    with torch.no_grad():
        for layer in engine.runner.model.model.layers[num_layers:]:
            layer.input_layernorm.weight.mul_(factor)
            layer.post_attention_layernorm.weight.mul_(factor)


def blocks_for(max_model_len: int, block_size: int, num_requests: int) -> int:
    return num_requests * math.ceil(max_model_len / block_size)
