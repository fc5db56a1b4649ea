"""tether's tiny models and character tokenizer load as ordinary Hugging Face directories."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tether.models import build_tiny_model, load_model, warm_start
from tether.models.tokenizer import encode_exact
from tether.tasks import ALPHABET, CountdownTask


def test_char_tokenizer_is_21_tokens_and_round_trips(tokenizer, tmp_path):
    assert len(tokenizer) == 21 and (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    text = "3,7,9:42=(9-3)*7"
    ids = encode_exact(tokenizer, text)
    assert len(ids) == len(text)
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again(text, add_special_tokens=False)["input_ids"] == ids
    assert again.decode(ids) == text


def test_unknown_characters_are_refused(tokenizer):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        encode_exact(tokenizer, "3 + x")


@pytest.mark.parametrize("moe", [False, True])
def test_tiny_model_saves_and_loads_with_auto_classes(tokenizer, tmp_path, moe):
    model = build_tiny_model(len(tokenizer), moe=moe, seed=0)
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n <= 5_000_000
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded).__name__ == ("Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM")
    x = torch.tensor([[2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.allclose(model(x).logits, loaded(x).logits, atol=1e-6)
    _m2, t2 = load_model(tmp_path)
    assert len(t2) == 21


def test_load_model_names_a_wrong_directory(tmp_path):
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        load_model(tmp_path)


def test_warm_start_is_deterministic_and_learns(tokenizer):
    task = CountdownTask(seed=0)
    runs = []
    for _ in range(2):
        model = build_tiny_model(len(tokenizer), seed=3)
        runs.append(warm_start(model, tokenizer, task, steps=6, batch_size=16, seed=3))
    assert runs[0] == runs[1]
    assert runs[0][-1] < runs[0][0]
    assert set(ALPHABET) <= set(tokenizer.get_vocab())
