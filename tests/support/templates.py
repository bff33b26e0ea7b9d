"""Chat templates written for the tests, after real ones whose full text is not kept here."""

# Written for these tests after Gemma 4's template (its format_argument and its turns, tool parts only): a call
# in Gemma's notation, the results read from the calling message's tool_responses, the turn left open after them.
GEMMA4_TOOLS = (
    "{%- macro arg(v) -%}{%- if v is string -%}<|\"|>{{ v }}<|\"|>{%- elif v is boolean -%}"
    "{{ 'true' if v else 'false' }}{%- elif v is mapping -%}{{ '{' }}{%- for k, x in v | dictsort -%}"
    "{{ k }}:{{ arg(x) }}{{ ',' if not loop.last }}{%- endfor -%}{{ '}' }}{%- elif v is sequence -%}"
    "[{%- for x in v -%}{{ arg(x) }}{{ ',' if not loop.last }}{%- endfor -%}]{%- else -%}{{ v }}{%- endif -%}"
    "{%- endmacro -%}{{ bos_token }}{%- if tools %}<|turn>system\n{%- for t in tools %}<|tool>declaration:"
    "{{ t.function.name }}<tool|>{%- endfor %}<turn|>\n{%- endif %}{%- set ns = namespace(prev=None) %}"
    "{%- for m in messages %}{%- set ns.prev = None %}<|turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{%- if m.tool_calls %}{%- for c in m.tool_calls %}<|tool_call>call:{{ c.function.name }}"
    "{{ arg(c.function.arguments) }}<tool_call|>{%- endfor %}{%- endif %}{%- if m.tool_responses %}"
    "{%- for r in m.tool_responses %}<|tool_response>response:{{ r.name }}{%- if r.response is mapping %}"
    "{{ arg(r.response) }}{%- else %}{value:{{ arg(r.response) }}}{%- endif %}<tool_response|>{%- endfor %}"
    "{%- set ns.prev = 'tool_response' %}{%- endif %}{%- if m.content is string %}{{ m.content }}{%- endif %}"
    "{%- if not (m.tool_responses and not m.content) %}<turn|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt and ns.prev != 'tool_response' %}<|turn>model\n{%- endif %}"
)
