"""The tiny demo model: a byte-level BPE tokenizer trained here and a small random Qwen2 causal LM.

`create_tiny_model(out)` writes an ordinary Hugging Face folder (config.json, model.safetensors,
generation_config.json, tokenizer files with a tool-capable ChatML template) that loads with
`AutoModelForCausalLM` / `AutoTokenizer`. Everything is derived from `seed`, so the same seed gives the
same bytes. `rollway init-model --out DIR` calls it; `python -m engine.tiny_model DIR` does too.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
DEFAULT_SPECIAL_TOKENS = [
    PAD_TOKEN,
    "<|im_start|>",
    EOS_TOKEN,
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

# Qwen2.5's ChatML template with tools, with two tolerances: `content` may be null, and tool-call
# `arguments` may arrive as a JSON string (rendered verbatim) as well as a dict (rendered with tojson).
# `reasoning_content` is accepted and not rendered. One change, as in Qwen3's template: a chat without tools
# and without a system message gets no default system block. For the demo's prompts ("37+48=") that is 14
# prompt tokens instead of 30, i.e. about half the compute of every SFT step, RL step and prefill.
CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] or '' }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    '{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}'
    '{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}'
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + (messages[0]['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    '{%- if (message.role == "user") or (message.role == "system" and not loop.first)'
    ' or (message.role == "assistant" and not message.tool_calls) %}'
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>' + '\\n' }}"
    '{%- elif message.role == "assistant" %}'
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    '{%- elif message.role == "tool" %}'
    '{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}'
    "{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content or '' }}{{- '\\n</tool_response>' }}"
    '{%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}'
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_WORDS = (
    "the a an of to and in is it that for on with as was at by be this from or have not are but what all "
    "were when we there can one your which their said if do will each about how up out them then she many "
    "some so these would other into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little very after words called "
    "just where most know get through back much before go good new write our used me man too any day same "
    "right look think also around another came come work three word must because does part even place well "
    "such here take why things help put years different away again off went old number great tell men say "
    "small every found still between name should home big give air line set own under read last never us "
    "left end along while might next sound below saw something thought both few those always looked show "
    "large often together asked house world going want school important until form food keep children feet "
    "land side without boy once animals life enough took sometimes four head above kind began almost live "
    "page got earth need far hand high year mother light parts country father let night following picture "
    "being study second eyes soon times story boys since white days ever paper hard near sentence better "
    "best across during today others however sure means knew try told young miles sun ways thing whole "
    "weather tool call answer result function search query city file list value error true false none"
).split()
_NAMES = ["get_weather", "search", "calculator", "read_file", "write_file", "lookup", "run_code", "add"]
_KEYS = ["city", "query", "expression", "path", "content", "limit", "unit", "a", "b", "text", "id"]
_CODE = [
    "def {f}({a}, {b}):\n    return {a} + {b}\n",
    "for {a} in range({n}):\n    print({a})\n",
    "if {a} > {n}:\n    {b} = {a} - {n}\nelse:\n    {b} = 0\n",
    'import json\ndata = json.loads({a})\nprint(data["{b}"])\n',
    "class {F}:\n    def __init__(self, {a}):\n        self.{a} = {a}\n",
    "const {a} = await fetch(`/api/{b}?n={n}`);\n",
]


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 14))]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice([".", ".", "?", "!"])


def _arguments(rng: random.Random) -> dict[str, object]:
    out: dict[str, object] = {}
    for key in rng.sample(_KEYS, rng.randint(1, 3)):
        out[key] = rng.randint(0, 999) if rng.random() < 0.4 else " ".join(rng.sample(_WORDS, 2))
    return out


def _corpus(seed: int, n_lines: int = 12000) -> Iterator[str]:
    rng = random.Random(seed)
    for _ in range(n_lines):
        kind = rng.randrange(5)
        if kind == 0:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            yield f"{a}+{b}={a + b}" if rng.random() < 0.7 else f"What is {a} + {b}? The answer is {a + b}."
        elif kind == 1:
            yield " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
        elif kind == 2:
            call = {"name": rng.choice(_NAMES), "arguments": _arguments(rng)}
            yield f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
        elif kind == 3:
            x, y = rng.sample(["x", "y", "value", "item", "count", "total", "name", "result"], 2)
            f = rng.choice(_NAMES)
            yield rng.choice(_CODE).format(f=f, F=f.title().replace("_", ""), a=x, b=y, n=rng.randint(1, 99))
        else:
            role = rng.choice(["system", "user", "assistant", "tool"])
            yield f"<|im_start|>{role}\n{_sentence(rng)}<|im_end|>\n"


def build_tokenizer(
    *,
    seed: int = 0,
    vocab_size: int = 2048,
    extra_special_tokens: list[str] | None = None,
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer in-process on generated text; one token per digit.

    The special tokens are the ChatML/Qwen2.5 set plus `extra_special_tokens` (e.g. Llama-3.1's header
    tokens); `chat_template` replaces the default ChatML-with-tools template. eos is `<|im_end|>` and pad
    `<|endoftext|>`; a caller building another template family sets `tokenizer.eos_token` itself.
    """
    specials = list(DEFAULT_SPECIAL_TOKENS)
    specials += [t for t in extra_special_tokens or [] if t not in specials]
    tok = Tokenizer(models.BPE())
    # Exactly Qwen2's pipeline (transformers' Qwen2Tokenizer rebuilds it when AutoTokenizer loads a
    # qwen2 folder, so anything else would tokenize differently after a save/load). Its `\p{N}`
    # alternative already isolates every digit, as Digits(individual_digits=True) would.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[t for t in specials if t not in (EOS_TOKEN, PAD_TOKEN)],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template if chat_template is not None else CHATML_TOOLS_TEMPLATE
    return fast


def _config(size: str, vocab_size: int, pad_id: int, eos_id: int) -> Qwen2Config:
    sizes: dict[str, dict[str, Any]] = {
        "tiny": {  # ~3.4M parameters
            "hidden_size": 256,
            "intermediate_size": 704,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        "100m": {  # ~104M parameters, for benchmarks
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "num_key_value_heads": 4,
        },
    }
    if size not in sizes:
        raise ValueError(f"unknown size {size!r}: use one of {', '.join(sizes)}")
    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        # Above the usual 0.02: at 0.02 a random tiny model only repeats its last input token under greedy
        # decoding, which makes outputs (and the tests that compare them) degenerate.
        "initializer_range": 0.05,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
        **sizes[size],
    }
    return Qwen2Config(**kwargs)


def create_tiny_model(out_dir: str | Path, *, seed: int = 0, size: str = "tiny") -> Path:
    """Write a tiny random Qwen2ForCausalLM with its tokenizer to `out_dir`; return the folder.

    `seed` picks the weights; the tokenizer is the same for every seed, so any two tiny models of a size
    can stand in for each other's checkpoints (e.g. in `/update_weights_from_disk`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos_id, pad_id = (int(tokenizer.get_vocab()[t]) for t in (EOS_TOKEN, PAD_TOKEN))
    config = _config(size, len(tokenizer), pad_id, eos_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, bos_token_id=None
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the tiny demo model (HF format).")
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", choices=["tiny", "100m"], default="tiny")
    args = parser.parse_args(argv)
    print(create_tiny_model(args.out, seed=args.seed, size=args.size))


if __name__ == "__main__":
    main()
