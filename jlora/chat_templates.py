"""Chat templates jlora ships, by name (`jlora serve --chat-template NAME`).

`smollm2-tools`: the default model's own template (the GGUF's, which ignores `tools`) plus the tool
format SmolLM2 was fine-tuned on (its function-calling data, as Ollama's SmolLM2 template renders
it): the tools as JSON lines inside `<tools>...</tools>` in the system turn, calls as a JSON list
`<tool_call>[{"name": ..., "arguments": {...}}]</tool_call>`, and results as a user turn holding
`<tool_response>...</tool_response>`. Without `tools` and tool messages it renders exactly what the
GGUF's template renders (tests/test_server_tools.py checks token equality).
"""

from __future__ import annotations

from typing import Any, Sequence

# OpenAI's message roles: a template renders any string as a role (SmolLM2's writes
# "<|im_start|>usr"), so a typo would silently become a turn the model never saw.
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def check_messages(messages: Sequence[Any]) -> None:
    """ValueError naming the first message that is not a dict with one of `ROLES` as its role."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role is {m.get('role')!r}; expected one of {', '.join(ROLES)}")

_SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

_TOOL_INSTRUCTIONS = (
    "You can call functions. Given the question and the functions below, answer with one or more function "
    "calls; if no function fits, or the question lacks a parameter a function needs, say so.\\n"
    "You have access to the following tools:\\n<tools>"
)
_TOOL_FORMAT = (
    "</tools>\\nAnswer with the calls only, in this format (an empty list when no call is needed):\\n"
    "<tool_call>[\\n{\"name\": \"func_name1\", \"arguments\": {\"argument1\": \"value1\"}}\\n]</tool_call>"
)

SMOLLM2_TOOLS = (
    "{%- set sys = messages[0]['role'] == 'system' -%}\n"
    "{%- if tools -%}\n"
    "{{- '<|im_start|>system\\n" + _TOOL_INSTRUCTIONS + "' -}}\n"
    "{%- for tool in tools -%}{{- '\\n' + ((tool['function'] if tool.get('function') else tool) | tojson) -}}{%- endfor -%}\n"
    "{{- '" + _TOOL_FORMAT.replace("'", "\\'") + "' -}}\n"
    "{%- if sys -%}{{- '\\n\\n' + messages[0]['content'] -}}{%- endif -%}\n"
    "{{- '<|im_end|>\\n' -}}\n"
    "{%- elif not sys -%}\n"
    "{{- '<|im_start|>system\\n" + _SMOLLM2_DEFAULT_SYSTEM + "<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "{%- if loop.first and sys and tools -%}\n"  # already inside the tool system turn
    "{%- elif message['role'] == 'tool' -%}\n"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' -}}\n"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}\n"
    "{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- if message['content'] -%}{{- message['content'] + '\\n' -}}{%- endif -%}\n"
    "{{- '<tool_call>[' -}}\n"
    "{%- for call in message['tool_calls'] -%}\n"
    "{%- set args = call['function']['arguments'] -%}\n"
    "{{- '{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' -}}\n"
    "{{- (args if args is string else (args | tojson)) + '}' -}}\n"
    "{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{{- ']</tool_call><|im_end|>\\n' -}}\n"
    "{%- else -%}\n"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}\n"
)

CHAT_TEMPLATES = {"smollm2-tools": SMOLLM2_TOOLS}
