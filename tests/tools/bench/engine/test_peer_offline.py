"""tools/bench/engine/peer_offline.py: the prompts both engines get, and clear errors for a
folder that is not a model folder."""

import json

import pytest

from spillway.tools.bench.engine.peer_offline import folder_vocab_size, make_prompts


def test_prompts_are_seeded_token_ids_of_the_asked_length_above_the_special_ids():
    prompts = make_prompts(1000, 5, 40, seed=3)
    assert prompts == make_prompts(1000, 5, 40, seed=3) != make_prompts(1000, 5, 40, seed=4)
    assert [len(p["prompt_token_ids"]) for p in prompts] == [40] * 5
    assert all(256 <= token < 1000 for p in prompts for token in p["prompt_token_ids"])


def test_the_vocabulary_comes_from_the_folders_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 49152}))
    assert folder_vocab_size(str(tmp_path)) == 49152


def test_a_folder_without_a_usable_config_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="must be a folder holding config.json"):
        folder_vocab_size(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(SystemExit, match="no integer vocab_size"):
        folder_vocab_size(str(tmp_path))
