"""A Llama 3.1 chat template for the tests: a second template family next to ChatML, whose bridge between
turns is empty and whose tool calls are JSON (the llama3_json parser). The gateway itself always renders
the served tokenizer's own template; nothing here ships.

`LLAMA31_TEMPLATE` follows the shape of Meta's Llama 3.1 template with custom tools: tools as JSON
schemas in the first user message (Meta's default `tools_in_user_message`), tool results as `ipython`
messages, assistant tool calls as `<|python_tag|>{"name": ..., "parameters": ...}<|eom_id|>` (several
joined by "; ", which the llama3_json parser reads back). Departures from Meta's, on purpose: no "Today
Date" line (it changes between calls and would break prefix stability of long sessions), no built-in
tools, and several calls per message instead of an exception. As in Meta's, turns end with `<|eot_id|>`
and are followed directly by the next header, so the bridge between turns is empty.

The ChatML/Qwen2.5 template with tools lives with the tiny model (`engine.tiny_model`), whose tokenizer
carries it.
"""

from __future__ import annotations

LLAMA31_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set system_message = (messages[0]['content'] or '') | trim %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n\\n' }}{%- endif %}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- if tools %}"
    "{%- if not messages or messages[0]['role'] != 'user' %}"
    "{{- raise_exception('with tools, the first message after the system message must be a user message') }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' }}"
    "{{- 'Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\\n\\n' }}"
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and '
    "its value}. Do not use variables.\\n\\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}"
    "{{- ((messages[0]['content'] or '') | trim) + '<|eot_id|>' }}"
    "{%- set messages = messages[1:] %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|python_tag|>' }}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if not loop.first %}{{- '; ' }}{%- endif %}"
    '{{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}' }}"
    "{%- endfor %}"
    "{{- '<|eom_id|>' }}"
    "{%- elif message.role == 'tool' or message.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + (message.content or '') + '<|eot_id|>' }}"
    "{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n'"
    " + ((message.content or '') | trim) + '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

LLAMA31_SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
"""The Llama 3.1 special tokens the template uses (for building a tokenizer that carries it)."""
