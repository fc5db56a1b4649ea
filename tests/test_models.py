"""tether's tiny models and character tokenizer load as ordinary Hugging Face directories."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tether.models import build_tiny_model, load_model
from tether.models.tokenizer import encode_exact
from tether.tasks import ALPHABET, CountdownTask
from tether.testbed import warm_start


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


def test_a_default_model_build_prints_its_progress_as_lines_on_its_threads(tmp_path, capsys,
                                                                          monkeypatch):
    """Output to a file (not a terminal): what is built, on how many threads (`run.threads`,
    which the process gets back after), then a line per step's progress."""
    import json

    from tether.testbed import default_model

    seen = []
    real = default_model.warm_start
    monkeypatch.setattr(default_model, "warm_start",
                        lambda *a, **k: seen.append(torch.get_num_threads()) or real(*a, **k))
    before = torch.get_num_threads()  # 1 in tests (conftest): ask for another count
    out = default_model.ensure_default_model(str(tmp_path), warmstart_steps=3,
                                             threads=before + 1)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("building tether's tiny dense model once: 3 warm-start steps "
                               f"on {before + 1} thread(s)")
    assert [x.split(" loss ")[0] for x in lines[1:]] == [f"warm-start step {s}/3" for s in (1, 2, 3)]
    assert seen == [before + 1] and torch.get_num_threads() == before
    assert json.loads((out / "tether_build.json").read_text())["threads"] == before + 1


def test_build_progress_prints_a_line_per_twentieth_of_the_steps_and_the_last(capsys):
    from tether.testbed.default_model import build_progress

    report = build_progress(910)  # a line every round(910 * 0.05) = 46 steps, and at 910
    for step in range(1, 911):
        report(step, 2.0 if step <= 46 else 1.0)
    lines = capsys.readouterr().out.splitlines()
    assert [int(x.split()[2].split("/")[0]) for x in lines] == [*range(46, 911, 46), 910]
    assert lines[0].startswith("warm-start step 46/910 loss 2.0000 ")  # the mean since the last line
    assert lines[1].startswith("warm-start step 92/910 loss 1.0000 ") and "s left" in lines[1]
