"""Chat templates that make the demands real checkpoints' tool-calling templates make, for the
tiny checkpoints of each family the engine serves (written for these tests; each states what
its family's published templates require of the messages they are given):

- ``LLAMA3``: Llama 3.1-style JSON calls: tools listed as JSON in the first turn; an assistant
  turn with ``tool_calls`` is written as ``{"name": ..., "parameters": <arguments | tojson>}``
  (so ``arguments`` must be an object), one call per turn only (Meta's template raises
  otherwise); tool results go in an ``ipython`` turn; every other turn concatenates
  ``message['content']`` (a missing content fails).
- ``HERMES``: Qwen2.5 / Hermes style: ``<tools>`` in the system turn, each call written as a
  ``<tool_call>`` block from ``tool_call.function`` with ``arguments | tojson``, text turns by
  concatenation, tool results as ``<tool_response>`` inside a user turn.
- ``MISTRAL``: Mistral v0.3 style: ``[AVAILABLE_TOOLS]``, ``[TOOL_CALLS]`` with each call's
  ``id``, ``[TOOL_RESULTS]`` with the ``tool_call_id``; both ids must be exactly 9 letters or
  digits (Mistral's templates ``raise_exception`` otherwise), alternating user / assistant.
"""

from __future__ import annotations

LLAMA3 = """{{- bos_token }}
{%- for message in messages %}
{%- if loop.first and tools %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\nCall a function as JSON.\\n' }}
{%- for t in tools %}{{- t | tojson + '\\n' }}{%- endfor %}
{{- '<|eot_id|>' }}
{%- endif %}
{%- if message['role'] == 'assistant' and message['tool_calls'] is defined %}
{%- if message['tool_calls'] | length != 1 %}
{{- raise_exception('This model only supports single tool-calls at once!') }}
{%- endif %}
{%- set call = message['tool_calls'][0]['function'] %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{{- '{"name": "' + call['name'] + '", "parameters": ' + call['arguments'] | tojson + '}' }}
{{- '<|eot_id|>' }}
{%- elif message['role'] in ['tool', 'ipython'] %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
{{- message['content'] | trim + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

HERMES = """{%- if tools %}
{{- '<|im_start|>system\\n<tools>\\n' }}
{%- for t in tools %}{{- t | tojson + '\\n' }}{%- endfor %}
{{- '</tools><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- set fn = tool_call.function %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + fn.arguments | tojson }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

MISTRAL = """{{- bos_token }}
{%- for message in messages %}
{%- if message['role'] == 'user' %}
{%- if tools and loop.last %}
{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}
{%- endif %}
{{- '[INST] ' + message['content'] + '[/INST]' }}
{%- elif message['role'] == 'system' %}
{{- '[INST] ' + message['content'] + '[/INST]' }}
{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined %}
{{- '[TOOL_CALLS] [' }}
{%- for tool_call in message['tool_calls'] %}
{%- if tool_call['id'] is not string or tool_call['id'] | length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
{%- endif %}
{{- '{"name": "' + tool_call['function']['name'] + '", "arguments": ' }}
{{- tool_call['function']['arguments'] | tojson + ', "id": "' + tool_call['id'] + '"}' }}
{%- if not loop.last %}{{- ', ' }}{%- endif %}
{%- endfor %}
{{- ']' + eos_token }}
{%- elif message['role'] == 'tool' %}
{%- if message['tool_call_id'] is not string or message['tool_call_id'] | length != 9 %}
{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
{%- endif %}
{{- '[TOOL_RESULTS] {"content": ' + message['content'] | tojson + ', "call_id": "' }}
{{- message['tool_call_id'] + '"}[/TOOL_RESULTS]' }}
{%- else %}
{{- message['content'] + eos_token }}
{%- endif %}
{%- endfor %}
"""

# family (tiny checkpoint arch) -> (template, the --tool-call-parser of that family)
FAMILIES = {"llama": (LLAMA3, "llama3_json"), "qwen2": (HERMES, "hermes"),
            "mistral": (MISTRAL, "mistral")}
