"""Qwen3-MoE and Mixtral against Hugging Face transformers: tiny random models saved with
`save_pretrained` and read back through the loader, run batched with chunked prefill; logits
within 1e-4 in float32, greedy tokens equal. Also: what loading refuses, dummy weights, and a
Qwen3-MoE GGUF converted through transformers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_gguf import write_mixtral_gguf, write_qwen3_moe_gguf
from tiny_models import tiny_mixtral, tiny_qwen3_moe

from spillway.gateway import LLM, SamplingParams
from spillway.protocol.local import model_files
from spillway.worker.models import build_model, loader
from spillway.worker.models.sparse_moe import SparseMoeBlock
from spillway.worker.runner.model_runner import ChunkInput, ModelRunner

TOLERANCE = 1e-4
CPU = torch.device("cpu")
BLOCK_SIZE = 4
FAMILIES = {"qwen3_moe": tiny_qwen3_moe, "mixtral": tiny_mixtral}


@pytest.fixture(scope="module", params=FAMILIES)
def saved(request, tmp_path_factory):
    """(folder written by `save_pretrained`, the transformers model)."""
    hf = FAMILIES[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path, hf


def load(path) -> torch.nn.Module:
    files = model_files.resolve_model(str(path))
    model = build_model(model_files.load_config(files), device=CPU, dtype=torch.float32)
    model.load_weights(loader.iter_weights(files))
    return model


def hf_logits(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def random_prompts(lengths: tuple[int, ...], vocab_size: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def chunked_greedy(runner: ModelRunner, prompts: list[list[int]], budget: int, new_tokens: int):
    """Greedy decoding under a token budget per step, as the scheduler packs steps: requests in
    order, each taking what is left of the budget, so long prompts are prefilled in chunks
    beside other prompts' chunks and decodes. Returns the sequences and, per sequence, the
    logits of every position a step sampled at."""
    tables = [list(range(i * 16, i * 16 + 16)) for i in range(len(prompts))][::-1]  # far from one another
    sequences = [list(p) for p in prompts]
    computed = [0] * len(prompts)
    sampled: list[dict[int, torch.Tensor]] = [{} for _ in prompts]
    while any(len(s) - len(p) < new_tokens for s, p in zip(sequences, prompts)):
        chunks, rows, left = [], [], budget
        for i, sequence in enumerate(sequences):
            take = min(len(sequence) - computed[i], left)
            if len(sequence) - len(prompts[i]) >= new_tokens or take == 0:
                continue
            chunks.append(ChunkInput(sequence[computed[i]: computed[i] + take], computed[i], tables[i]))
            computed[i] += take
            left -= take
            rows.append(i)
        logits = runner.execute(chunks)
        for row, i in enumerate(rows):
            if computed[i] == len(sequences[i]):  # the chunk ended the known tokens: sample
                sampled[i][computed[i] - 1] = logits[row].clone()
                sequences[i].append(int(logits[row].argmax()))
    return sequences, sampled


def test_chunked_batched_prefill_and_decode_match_hf(saved):
    path, hf = saved
    runner = ModelRunner(load(path), num_blocks=80, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32)
    prompts = random_prompts((3, 11, 18, 26), hf.config.vocab_size)
    new_tokens = 6

    sequences, sampled = chunked_greedy(runner, prompts, budget=10, new_tokens=new_tokens)

    for prompt, sequence, logits_at in zip(prompts, sequences, sampled):
        reference = hf_logits(hf, sequence)
        assert sorted(logits_at) == list(range(len(prompt) - 1, len(sequence) - 1))
        for position, logits in logits_at.items():
            assert (logits - reference[position]).abs().max().item() < TOLERANCE, position
        assert sequence[len(prompt):] == hf_greedy(hf, prompt, new_tokens)


def test_the_engine_generates_hf_greedy_tokens_with_chunked_prefill(saved):
    path, hf = saved
    prompts = random_prompts((5, 23, 40, 9), hf.config.vocab_size, seed=1)
    with LLM(str(path), device="cpu", dtype="float32", max_num_batched_tokens=16, max_model_len=128,
             enable_prefix_caching=False) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)

    assert [out.outputs[0].token_ids for out in outputs] == [hf_greedy(hf, p, 8) for p in prompts]


def test_sparse_and_dense_layers_follow_the_config(saved):
    path, hf = saved
    model = load(path)
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert any(sparse)


def test_transformers_in_memory_names_load_too(saved):
    """transformers 5 holds the experts stacked under our own names: its state dict loads."""
    path, hf = saved
    model = build_model(hf.config, device=CPU, dtype=torch.float32)
    model.load_weights(hf.state_dict().items())
    from_disk = dict(load(path).checkpoint_weights())
    for name, tensor in model.checkpoint_weights():
        assert torch.equal(tensor, from_disk[name]), name


def rewritten_checkpoint(path, tmp_path, change) -> str:
    """A copy of the saved folder whose tensors `change(dict)` edited in place."""
    folder = shutil.copytree(path, tmp_path / "edited")
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


def expert_name(hf, layer: int, expert: int, projection: str) -> str:
    """A per-expert checkpoint name: Mixtral calls its block `block_sparse_moe` and gate/up/down w1/w3/w2."""
    if hf.config.model_type == "mixtral":
        short = {"gate": "w1", "up": "w3", "down": "w2"}[projection]
        return f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{short}.weight"
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}_proj.weight"


def test_a_missing_expert_weight_is_named(saved, tmp_path):
    path, hf = saved
    missing = expert_name(hf, 0, 3, "up")
    folder = rewritten_checkpoint(path, tmp_path, lambda tensors: tensors.pop(missing))

    with pytest.raises(ValueError, match=rf"missing \['{missing}'\], unexpected \[\]"):
        load(folder)


def test_an_expert_past_the_configured_count_is_unexpected(saved, tmp_path):
    path, hf = saved
    extra = expert_name(hf, 0, hf.config.num_local_experts if hf.config.model_type == "mixtral"
                        else hf.config.num_experts, "gate")
    folder = rewritten_checkpoint(path, tmp_path, lambda tensors: tensors.update({extra: torch.zeros(1)}))

    with pytest.raises(ValueError, match=rf"missing \[\], unexpected \['{extra}'\]"):
        load(folder)


def test_an_expert_of_the_wrong_width_is_refused(saved, tmp_path):
    path, hf = saved
    name = expert_name(hf, 0, 1, "down")
    folder = rewritten_checkpoint(path, tmp_path, lambda tensors: tensors.update({name: tensors[name][:, :-1].contiguous()}))

    with pytest.raises(ValueError, match=rf"weight {name} has shape"):
        load(folder)


def test_a_missing_stacked_tensor_names_every_expert_it_holds():
    hf = tiny_qwen3_moe()
    state = dict(hf.state_dict())
    del state["model.layers.2.mlp.experts.down_proj"]
    model = build_model(hf.config, device=CPU, dtype=torch.float32)

    expected = [f"model.layers.2.mlp.experts.{e}.down_proj.weight" for e in range(6)]
    with pytest.raises(ValueError, match=rf"missing {expected!r}".replace("[", r"\[").replace("]", r"\]")):
        model.load_weights(state.items())


def test_dummy_weights_fill_the_experts_and_the_router():
    hf = tiny_qwen3_moe(num_layers=2, mlp_only_layers=())
    model = build_model(hf.config, device=CPU, dtype=torch.float32)
    loader.init_dummy_weights(model, seed=0)

    block = model.model.layers[1].mlp
    for tensor in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
        assert 0.019 < tensor.std().item() < 0.021 and tensor.abs().max() > 0
    runner = ModelRunner(model, num_blocks=16, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32)
    logits = runner.execute([ChunkInput([5, 9, 200, 3, 17], 0, [0, 1]), ChunkInput([8], 0, [2])])
    assert torch.isfinite(logits).all() and (logits.std(dim=-1) > 0).all()


def test_a_qwen3_moe_gguf_converts_through_transformers(tmp_path, monkeypatch):
    """Written with the `gguf` package as llama.cpp lays a qwen3moe file out, converted in the
    model cache (a child interpreter), then loaded: the logits of the model it was written from.
    Its expert width (32) is not transformers' default (768): the conversion must read it."""
    monkeypatch.setenv("SPILLWAY_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_qwen3_moe(mlp_only_layers=(), rms_norm_eps=0.0625)  # a float32-exact epsilon
    gguf_path = write_qwen3_moe_gguf(hf, tmp_path / "tiny-qwen3-moe.gguf")

    files = model_files.resolve_model(str(gguf_path))
    config = json.loads((files.path / "config.json").read_text())
    model = load(files.path)

    assert (config["model_type"], config["moe_intermediate_size"], config["norm_topk_prob"]) == ("qwen3_moe", 32, True)
    assert model_files.load_tokenizer(files).eos_token == "<|im_end|>"
    prompt = random_prompts((21,), hf.config.vocab_size, seed=2)[0]
    runner = ModelRunner(model, num_blocks=16, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32)
    logits = runner.execute([ChunkInput(prompt, 0, list(range(6)))])
    assert (logits[0] - hf_logits(hf, prompt)[-1]).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("expert_by_expert", [False, True])
def test_a_mixtral_gguf_converts_with_its_experts(tmp_path, monkeypatch, expert_by_expert):
    """transformers reads llama.cpp's Mixtral (architecture "llama" with experts) as a dense
    Llama whose MLPs it leaves random: the conversion takes its attention (the q/k rows put back
    in order) and reads the routers and experts from the file, stacked or one tensor an expert
    as older files hold them. The result gives the logits of the model it was written from."""
    monkeypatch.setenv("SPILLWAY_CACHE_DIR", str(tmp_path / "cache"))
    hf = tiny_mixtral(rms_norm_eps=0.0625)  # a float32-exact epsilon
    gguf_path = write_mixtral_gguf(hf, tmp_path / "tiny-mixtral.gguf", expert_by_expert=expert_by_expert)

    files = model_files.resolve_model(str(gguf_path))
    config = json.loads((files.path / "config.json").read_text())
    model = load(files.path)

    assert (config["model_type"], config["architectures"]) == ("mixtral", ["MixtralForCausalLM"])
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    assert config["intermediate_size"] == hf.config.intermediate_size
    prompt = random_prompts((21,), hf.config.vocab_size, seed=2)[0]
    runner = ModelRunner(model, num_blocks=16, block_size=BLOCK_SIZE, device=CPU, dtype=torch.float32)
    logits = runner.execute([ChunkInput(prompt, 0, list(range(6)))])
    assert (logits[0] - hf_logits(hf, prompt)[-1]).abs().max().item() < TOLERANCE


def test_a_gguf_whose_experts_transformers_drops_and_no_mixtral_is_refused(tmp_path):
    """Another architecture whose experts transformers loses is refused, naming what happened."""
    from spillway.worker.models import gguf_convert

    dense = type("Dense", (), {})()
    header = {"general.architecture": _Field("gemmamoe"), "gemmamoe.expert_count": _Field(8)}
    assert gguf_convert._lost_experts(header, torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="experts of GGUF architecture 'gemmamoe'"):
        gguf_convert._mixtral_with_experts(tmp_path / "x.gguf", header, dense)


class _Field:
    """A GGUF header field as GGUFReader gives it: `contents()`."""

    def __init__(self, value) -> None:
        self.value = value

    def contents(self):
        return self.value
