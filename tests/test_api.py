"""``stree.generate``: text prompts go through the model folder's tokenizer (``model.tokenizer``, kept by
``stree.load_model``); without one a text prompt is a clear error worded for the Python API."""

from __future__ import annotations

import pytest

import stree


@pytest.mark.parametrize("prompt", ["ab c", ["ab", "x y z"]])
def test_a_text_prompt_generates_what_its_token_ids_generate(models, prompt):
    model = models["mamba2"]
    assert model.tokenizer is not None
    out = stree.generate(model, prompt, drafter="chain", draft_model=models["draft"], max_new_tokens=5)
    outs, texts = (out, prompt) if isinstance(prompt, list) else ([out], [prompt])
    assert len(outs) == len(texts)
    for text, res in zip(texts, outs):
        want = stree.generate(model, model.tokenizer.encode(text).ids, max_new_tokens=5)
        assert res.token_ids == want.token_ids
        assert res.text == want.text == model.tokenizer.decode(res.token_ids)


def test_load_model_keeps_the_folders_tokenizer_or_none(model_dirs, tmp_path):
    import shutil

    folder = shutil.copytree(model_dirs["mamba2"], tmp_path / "m")
    assert stree.load_model(folder).tokenizer.encode("ab").ids
    (folder / "tokenizer.json").unlink()
    model = stree.load_model(folder)
    assert model.tokenizer is None
    with pytest.raises(ValueError, match=r"prompt is text, but the model has no tokenizer .*pass token ids"):
        stree.generate(model, "hello")
    assert len(stree.generate(model, [1, 2, 3], max_new_tokens=3).token_ids) == 3
    assert stree.generate(model, [1, 2, 3], max_new_tokens=3).text is None


def test_bad_text_prompts_name_the_prompt(models):
    model = models["mamba2"]
    with pytest.raises(ValueError, match=r"all strings or all token-id lists"):
        stree.generate(model, ["ab", [1, 2]])
    with pytest.raises(ValueError, match=r"prompt\[1\] encodes to no tokens"):
        stree.generate(model, ["ab", ""])
