"""The tiny model and its tokenizer: HF-loadable, deterministic, digit-per-token, tool-capable template."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.tiny_model import build_tokenizer, create_tiny_model

LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
LLAMA_TEMPLATE = (
    "{{- '<|begin_of_text|>' }}{%- for m in messages %}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def test_digits_are_single_tokens_and_specials_are_atomic() -> None:
    tok = build_tokenizer()
    assert tok.tokenize("37+48=85") == ["3", "7", "+", "4", "8", "=", "8", "5"]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[-1] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.pad_token == "<|endoftext|>"
    for special in [
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
        "<think>",
        "</think>",
    ]:
        assert len(tok.encode(special)) == 1
    text = 'Hello, world!\n{"name": "add", "arguments": {"a": 12}}'
    assert tok.decode(tok.encode(text)) == text


def test_chat_template_renders_tools_calls_and_responses() -> None:
    tok = build_tokenizer()
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "easy",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert (
        '<tools>\n{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}\n</tools>'
        in text
    )
    assert text.endswith(
        "<|im_start|>user\n2+3?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert "easy" not in text
    plain = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert plain == "<|im_start|>user\nhi<|im_end|>\n"  # no tools, no system message: no system block
    system = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                                     tokenize=False)
    assert system == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_extra_special_tokens_and_custom_template() -> None:
    tok = build_tokenizer(extra_special_tokens=LLAMA_SPECIALS, chat_template=LLAMA_TEMPLATE)
    for special in LLAMA_SPECIALS:
        assert tok.convert_ids_to_tokens(tok.encode(special)) == [special]
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_model_dir_loads_with_auto_classes_and_is_deterministic(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = create_tiny_model(tmp_path / "again", seed=0)
    for name in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < n_params < 10_000_000
    assert model.config.model_type == "qwen2" and model.config.max_position_embeddings >= 4096
    assert model.generation_config.eos_token_id == [tok.eos_token_id, tok.pad_token_id]
    sample = 'Hi 123 <tool_call>\n{"a": 1}\n</tool_call><|im_end|>'
    assert tok.encode(sample) == build_tokenizer().encode(sample)  # same tokenization after a save/load
    assert tok.chat_template == build_tokenizer().chat_template
