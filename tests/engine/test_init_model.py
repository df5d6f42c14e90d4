"""`rollway init-model --arch ... --tokenizer DIR`: a small random model of a real architecture on a tokenizer.

The Qwen3 and Llama 3.2 cases use the families' real vocabularies and templates (tests/realfiles.py; they skip
when no package index answers); the rest use the tiny demo tokenizer saved to a folder, which needs nothing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.init_model import TokenizerFolderError, create_model
from engine.tiny_model import build_tokenizer
from rollway.cli import build_parser, main
from tests.realfiles import BY_NAME, Unavailable, tokenizer_dir


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's tokenizer (ChatML template, eos <|im_end|>, pad <|endoftext|>) with no generation_config.json."""
    out = tmp_path_factory.mktemp("chatml-tokenizer")
    build_tokenizer().save_pretrained(out)
    return out


def _real(name: str) -> Path:
    try:
        return tokenizer_dir(BY_NAME[name])
    except Unavailable as e:
        pytest.skip(str(e))


def _generation_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "generation_config.json").read_text())  # type: ignore[no-any-return]


def _runs(model_dir: Path) -> torch.Tensor:
    """Logits of the model on its own template's rendering of a short chat (checks that it loads and runs)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits  # type: ignore[no-any-return]


def test_qwen3_on_the_real_qwen3_tokenizer(tmp_path: Path) -> None:
    src = _real("Qwen3")
    out = create_model(tmp_path / "m", arch="qwen3", tokenizer_dir=src)
    tok = AutoTokenizer.from_pretrained(out)
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "qwen3" and config.architectures == ["Qwen3ForCausalLM"]
    assert config.vocab_size == len(tok) >= 151_669  # Qwen3's added tokens end at <think>/</think> (151667/8)
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (64, 2, 16)
    assert config.tie_word_embeddings
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert (im_end, endoftext) == (151645, 151643)
    assert config.eos_token_id == im_end
    assert _generation_config(out)["eos_token_id"] == [im_end, endoftext]  # from the folder's generation_config
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):  # copied verbatim
        assert (out / name).read_bytes() == (src / name).read_bytes()
    assert tok.chat_template == AutoTokenizer.from_pretrained(src).chat_template
    weights = load_file(out / "model.safetensors")
    assert weights["model.embed_tokens.weight"].shape == (config.vocab_size, 64)
    assert "model.layers.0.self_attn.q_norm.weight" in weights  # Qwen3's own per-head norm
    assert _runs(out).shape[-1] == config.vocab_size


def test_llama_on_the_real_llama32_tokenizer(tmp_path: Path) -> None:
    src = _real("Llama 3.2")
    out = create_model(tmp_path / "m", arch="llama", tokenizer_dir=src, size="small", seed=3)
    tok = AutoTokenizer.from_pretrained(out)
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "llama" and config.architectures == ["LlamaForCausalLM"]
    # Llama 3's 128,256 ids, and the <|endoftext|> the GGUF vocabulary carries after them
    assert config.vocab_size == len(tok) == len(AutoTokenizer.from_pretrained(src)) >= 128_256
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (256, 4, 64)
    assert config.bos_token_id == 128000  # <|begin_of_text|>
    assert config.eos_token_id == tok.convert_tokens_to_ids("<|eot_id|>") == 128009
    assert config.rope_parameters["rope_theta"] == 500_000.0
    # <|end_of_text|>, <|eom_id|>, <|eot_id|>: the stop tokens of Llama 3.1 and 3.2
    assert _generation_config(out)["eos_token_id"] == [128001, 128008, 128009]
    assert _runs(out).shape[-1] == config.vocab_size


def test_stop_ids_from_the_template_when_the_folder_has_no_generation_config(chatml_dir: Path, tmp_path: Path) -> None:
    out = create_model(tmp_path / "m", arch="qwen2", tokenizer_dir=chatml_dir)
    tok = AutoTokenizer.from_pretrained(out)
    config = AutoConfig.from_pretrained(out)
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    # The eos token (<|im_end|>), then the end-of-turn tokens the template writes: <|im_end|> again, and
    # not <|endoftext|>, which the ChatML template never writes.
    assert _generation_config(out)["eos_token_id"] == [im_end]
    assert (config.eos_token_id, config.pad_token_id) == (im_end, endoftext)
    assert config.model_type == "qwen2" and config.vocab_size == len(tok)


def test_same_seed_same_weights(chatml_dir: Path, tmp_path: Path) -> None:
    a, b, c = (create_model(tmp_path / n, arch="llama", tokenizer_dir=chatml_dir, seed=s)
               for n, s in (("a", 0), ("b", 0), ("c", 1)))
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def _without_template(chatml_dir: Path, folder: Path) -> Path:
    tok = AutoTokenizer.from_pretrained(chatml_dir)
    tok.chat_template = None
    tok.save_pretrained(folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


def _broken_template(chatml_dir: Path, folder: Path) -> Path:
    tok = AutoTokenizer.from_pretrained(chatml_dir)
    tok.chat_template = "{{ raise_exception('this template refuses everything') }}"
    tok.save_pretrained(folder)
    return folder


def _no_eos(chatml_dir: Path, folder: Path) -> Path:
    tok = AutoTokenizer.from_pretrained(chatml_dir)
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"  # writes no end-of-turn token
    tok.eos_token = None
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize(("make", "said"), [
    (lambda src, d: d, "does not exist"),
    (lambda src, d: (d.mkdir(), (d / "config.json").write_text("{}"), d)[-1], "holds no tokenizer"),
    (lambda src, d: (d.mkdir(), (d / "tokenizer.json").write_text("not json"), d)[-1], "cannot load the tokenizer"),
    (_without_template, "has no chat template"),
    (_broken_template, "does not render a user message"),
    (_no_eos, "names no eos token"),
])
def test_an_unusable_tokenizer_folder_is_refused_before_anything_is_written(
        chatml_dir: Path, tmp_path: Path, make: Any, said: str) -> None:
    src = make(chatml_dir, tmp_path / "tokenizer")
    with pytest.raises(TokenizerFolderError, match=said):
        create_model(tmp_path / "out", arch="qwen3", tokenizer_dir=src)
    assert not (tmp_path / "out").exists()


def test_the_model_is_not_written_into_the_tokenizer_folder(chatml_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerFolderError, match="is the tokenizer folder"):
        create_model(chatml_dir, arch="qwen3", tokenizer_dir=chatml_dir)
    assert not (chatml_dir / "config.json").exists()


# --- the command line --------------------------------------------------------------------------------------


def test_cli_writes_the_architecture(chatml_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["init-model", "--out", str(tmp_path / "m"), "--arch", "llama", "--tokenizer", str(chatml_dir)]) == 0
    assert f"wrote {tmp_path / 'm'}" in capsys.readouterr().out
    assert AutoConfig.from_pretrained(tmp_path / "m").model_type == "llama"


@pytest.mark.parametrize(("argv", "said"), [
    (["--tokenizer", "x"], "--tokenizer DIR goes with --arch"),
    (["--size", "small"], "--size small goes with --arch"),
    (["--arch", "qwen3"], "--arch qwen3 needs --tokenizer DIR"),
    (["--arch", "qwen3", "--tokenizer", "x", "--size", "100m"], "the sizes are tiny and small"),
    (["--arch", "qwen3", "--tokenizer", "/nonexistent/tokenizer"], "tokenizer folder /nonexistent/tokenizer does not"),
])
def test_cli_refuses_what_it_cannot_do(tmp_path: Path, argv: list[str], said: str) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["init-model", "--out", str(tmp_path / "m"), *argv])
    assert str(exc.value).startswith("rollway init-model: ") and said in str(exc.value)
    assert not (tmp_path / "m").exists()


def test_cli_default_is_still_the_tiny_demo_model(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["init-model", "--out", "m"])
    assert (args.arch, args.tokenizer, args.size, args.seed) == (None, None, "tiny", 0)
    with pytest.raises(SystemExit) as exc:
        main(["init-model", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for words in ("--arch {qwen3,qwen2,llama}", "--tokenizer DIR", "generation_config.json", "no download"):
        assert words in text, words
