"""A small random model of a real architecture (Qwen3, Qwen2, Llama) on a tokenizer folder the user has.

`create_model(out, arch=..., tokenizer_dir=...)` writes an ordinary Hugging Face folder: the architecture's
own config class (transformers' Qwen3Config, Qwen2Config, LlamaConfig) at a small size, random weights, the
tokenizer files and chat template copied verbatim from `tokenizer_dir`, and a generation_config.json whose
eos ids are the model's stop tokens. The vocabulary is the tokenizer's (`len(tokenizer)` rows), so the
gateway, the engine and the trainer meet the real vocabulary and template of the family (for Qwen3, a
151k-row embedding) with a model small enough for a CPU. Nothing is downloaded: `tokenizer_dir` is a local
folder (a model's folder from the hub works: only its tokenizer files are read).

`rollway init-model --out DIR --arch qwen3 --tokenizer TOKENIZER_DIR` calls it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from jinja2 import TemplateError
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    PreTrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from rollway_common.paths import TOKENIZER_FILES

ARCHS: dict[str, type[PreTrainedConfig]] = {"qwen3": Qwen3Config, "qwen2": Qwen2Config, "llama": LlamaConfig}

SIZES: dict[str, dict[str, int]] = {
    # With a 151,936-row vocabulary the tied embedding is most of the model: 9.7M of tiny's ~9.9M
    # parameters (39 MB in float32), 38.9M of small's ~42M.
    "tiny": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2},
    "small": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
              "num_key_value_heads": 2},
}

ROPE_THETA = {"qwen3": 1_000_000.0, "qwen2": 1_000_000.0, "llama": 500_000.0}  # the released models' values
CONTEXT_LENGTH = 32768

END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")
"""Stop tokens of the ChatML and Llama 3 families: a stop id of a folder with no generation_config.json when
the chat template writes it."""


class TokenizerFolderError(ValueError):
    """The tokenizer folder is missing or unusable; the message says what to do."""


def create_model(out_dir: str | Path, *, arch: str, tokenizer_dir: str | Path, size: str = "tiny",
                 seed: int = 0) -> Path:
    """Write a small random `arch` model on the tokenizer in `tokenizer_dir` to `out_dir`; return the folder.

    Raises TokenizerFolderError before anything is written when the folder holds no usable tokenizer with a
    chat template and a stop token.
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}: use one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}: use one of {', '.join(SIZES)}")
    src, out = Path(tokenizer_dir), Path(out_dir)
    tokenizer = load_tokenizer(src)
    if out.resolve() == src.resolve():
        raise TokenizerFolderError(f"--out {out} is the tokenizer folder: write the model to another folder")
    stops = stop_ids(src, tokenizer)
    config = model_config(arch, size, vocab_size=vocab_size(tokenizer), bos_id=tokenizer.bos_token_id,
                          eos_id=tokenizer.eos_token_id if tokenizer.eos_token_id is not None else stops[0],
                          pad_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float().eval()
    model.generation_config = GenerationConfig(eos_token_id=stops, bos_token_id=tokenizer.bos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out


def load_tokenizer(src: Path) -> Any:
    """The tokenizer of a local folder, checked for what the gateway needs: loadable, with a chat template
    that renders a user message."""
    if not src.is_dir():
        raise TokenizerFolderError(f"tokenizer folder {src} does not exist (give a local folder holding "
                                   f"tokenizer.json or tokenizer.model, and the chat template)")
    if not any((src / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise TokenizerFolderError(f"{src} holds no tokenizer (no tokenizer.json, tokenizer.model or vocab.json): "
                                   f"give the folder of a Hugging Face model or tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(src), local_files_only=True)
    except Exception as e:  # the `tokenizers` library reports a malformed tokenizer.json as a plain Exception
        raise TokenizerFolderError(f"transformers cannot load the tokenizer in {src}: {e}") from e
    if not tokenizer.chat_template:
        raise TokenizerFolderError(f"the tokenizer in {src} has no chat template (the gateway renders every prompt "
                                   f"with it): add chat_template.jinja, or use the tokenizer of an instruct model")
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    except (TemplateError, ValueError, TypeError, KeyError) as e:
        raise TokenizerFolderError(f"the chat template in {src} does not render a user message: {e}") from e
    return tokenizer


def stop_ids(src: Path, tokenizer: Any) -> list[int]:
    """The model's stop tokens: generation_config.json's eos ids when the folder has one (a model's folder
    does), else the eos token and the end-of-turn tokens the chat template writes."""
    file = src / "generation_config.json"
    if file.is_file():
        eos = json.loads(file.read_text()).get("eos_token_id")
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        if ids:
            return [int(i) for i in ids]
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    vocab = tokenizer.get_vocab()
    template = tokenizer.chat_template
    text = template if isinstance(template, str) else " ".join(template.values())  # or named templates
    ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and t in text]
    if not ids:
        raise TokenizerFolderError(f"the tokenizer in {src} names no eos token and the folder has no "
                                   f"generation_config.json: the engine would not know when a reply ends; set "
                                   f"eos_token in tokenizer_config.json")
    return list(dict.fromkeys(ids))


def vocab_size(tokenizer: Any) -> int:
    """Rows of the embedding: every id the tokenizer can produce (len(tokenizer), or past its largest id)."""
    return max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)


def model_config(arch: str, size: str, *, vocab_size: int, bos_id: int | None, eos_id: int,
                 pad_id: int | None) -> PreTrainedConfig:
    dims = SIZES[size]
    kwargs: dict[str, Any] = {
        **dims,
        "vocab_size": vocab_size,
        "max_position_embeddings": CONTEXT_LENGTH,
        "rope_parameters": {"rope_type": "default", "rope_theta": ROPE_THETA[arch]},
        # Tied as in the small releases of both families (Qwen3-0.6B to 4B, Llama 3.2 1B and 3B): with a
        # 150k vocabulary an untied head would double the model.
        "tie_word_embeddings": True,
        # Above the usual 0.02, as for the tiny demo model: at 0.02 a random small model only repeats its
        # last input token under greedy decoding.
        "initializer_range": 0.05,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "float32",
    }
    if arch != "qwen2":  # Qwen2 derives it; Qwen3's default (128) is that of its large models
        kwargs["head_dim"] = dims["hidden_size"] // dims["num_attention_heads"]
    return ARCHS[arch](**kwargs)
