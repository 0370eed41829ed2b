"""A chat template that renders as Gemma 4's own (`chat_template.jinja` of the google/gemma-4-*
instruction-tuned checkpoints) for the conversations the tests send: a system (or developer)
message, the tools, users' and the model's text, the model's tool calls and the tool results
that follow them, and the reasoning of a call made after the last user message.

What it writes, as Gemma 4's template does:

- `<|turn>system\\n` (with `<|think|>\\n` first when `enable_thinking`), the system text, and one
  `<|tool>declaration:NAME{description:…,parameters:{properties:{…},required:[…],type:…}}<tool|>`
  per tool: keys sorted, each property's `description`, `enum`, `items` and nested
  `properties` in Gemma 4's notation, its type upper-cased;
- a turn per message (`<|turn>user\\n…<turn|>\\n`, the assistant's role `model`), the model's
  text without any `<|channel>…<channel|>` in it;
- a call as `<|tool_call>call:NAME{key:value,…}<tool_call|>` (keys sorted, strings between
  `<|"|>` markers), the tool results after it in the same turn as
  `<|tool_response>response:NAME{value:<|"|>…<|"|>}<tool_response|>` (the name found by the
  result's `tool_call_id`), and the model's next message in that same turn;
- the generation prompt `<|turn>model\\n<|channel>thought\\n<channel|>` (an empty, closed
  thought: no thinking), `<|turn>model\\n` alone with `enable_thinking`, and nothing after a
  tool result, where the model goes on in its turn.

Images, audio and a message's content parts are left out (the tests send none).
`tests/tokenizer/test_gemma4_template.py` holds prompts the published template renders, to
compare (it rendered the same for every conversation those tests and these send).
"""

# ruff: noqa: E501

from __future__ import annotations

GEMMA4 = r"""{%- macro value(v) -%}
    {%- if v is string -%}{{ '<|"|>' + v + '<|"|>' }}
    {%- elif v is boolean -%}{{ 'true' if v else 'false' }}
    {%- elif v is mapping -%}{{ '{' }}{%- for k, x in v | dictsort -%}{{ ',' if not loop.first }}{{ k }}:{{ value(x) }}{%- endfor -%}{{ '}' }}
    {%- elif v is sequence -%}{{ '[' }}{%- for x in v -%}{{ ',' if not loop.first }}{{ value(x) }}{%- endfor -%}{{ ']' }}
    {%- else -%}{{ v }}
    {%- endif -%}
{%- endmacro -%}
{%- macro quoted_list(items) -%}
    [{%- for x in items -%}{{ ',' if not loop.first }}<|"|>{{ x }}<|"|>{%- endfor -%}]
{%- endmacro -%}
{%- macro properties(props, only_others=false) -%}
    {%- for key, p in props | dictsort if not (only_others and key in ['description', 'type', 'properties', 'required', 'nullable']) -%}
        {{ ',' if not loop.first }}{{ key }}:{
        {%- set parts = [] -%}
        {%- if p['description'] -%}{%- set parts = parts + ['description:<|"|>' + p['description'] + '<|"|>'] -%}{%- endif -%}
        {%- set kind = p['type'] | upper -%}
        {%- if kind == 'STRING' and p['enum'] -%}{%- set parts = parts + ['enum:' + value(p['enum'])] -%}{%- endif -%}
        {%- if kind == 'ARRAY' and p['items'] is mapping and p['items'] -%}
            {%- set parts = parts + ['items:{' + items_of(p['items']) + '}'] -%}
        {%- endif -%}
        {%- if p['nullable'] -%}{%- set parts = parts + ['nullable:true'] -%}{%- endif -%}
        {%- if kind == 'OBJECT' -%}
            {%- set inner = properties(p['properties']) if p['properties'] is mapping else properties(p, true) -%}
            {%- set parts = parts + ['properties:{' + inner + '}'] -%}
            {%- if p['required'] -%}{%- set parts = parts + ['required:' + quoted_list(p['required'])] -%}{%- endif -%}
        {%- endif -%}
        {{ (parts + ['type:<|"|>' + kind + '<|"|>']) | join(',') }}}
    {%- endfor -%}
{%- endmacro -%}
{%- macro items_of(item) -%}
    {%- for key, x in item | dictsort if x is not none -%}
        {{ ',' if not loop.first }}
        {%- if key == 'properties' -%}properties:{ {{- properties(x) -}} }
        {%- elif key == 'required' -%}required:{{ quoted_list(x) }}
        {%- elif key == 'type' -%}type:{{ value(x | upper if x is string else x | map('upper') | list) }}
        {%- else -%}{{ key }}:{{ value(x) }}
        {%- endif -%}
    {%- endfor -%}
{%- endmacro -%}
{%- macro declaration(f) -%}
    declaration:{{ f['name'] }}{description:<|"|>{{ f['description'] }}<|"|>
    {%- set params = f['parameters'] -%}
    {%- if params -%}
        ,parameters:{
        {%- if params['properties'] -%}properties:{ {{- properties(params['properties']) -}} },{%- endif -%}
        {%- if params['required'] -%}required:{{ quoted_list(params['required']) }},{%- endif -%}
        {%- if params['type'] -%}type:<|"|>{{ params['type'] | upper }}<|"|>}{%- endif -%}
    {%- endif -%}
    }
{%- endmacro -%}
{%- macro without_thinking(text) -%}
    {%- set kept = namespace(text='') -%}
    {%- for part in text.split('<channel|>') -%}{%- set kept.text = kept.text + part.split('<|channel>')[0] -%}{%- endfor -%}
    {{- kept.text | trim -}}
{%- endmacro -%}
{%- set state = namespace(last=None, last_user=-1) -%}
{%- set turns = messages -%}
{{- bos_token -}}
{%- if enable_thinking or tools or messages[0]['role'] in ['system', 'developer'] -%}
    {{- '<|turn>system\n' -}}
    {%- if enable_thinking -%}{{- '<|think|>\n' -}}{%- endif -%}
    {%- if messages[0]['role'] in ['system', 'developer'] -%}
        {{- messages[0]['content'] | trim -}}
        {%- set turns = messages[1:] -%}
    {%- endif -%}
    {%- for tool in tools or [] -%}{{- '<|tool>' + declaration(tool['function']) | trim + '<tool|>' -}}{%- endfor -%}
    {{- '<turn|>\n' -}}
{%- endif -%}
{%- for m in turns -%}{%- if m['role'] == 'user' -%}{%- set state.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for i in range(turns | length) if turns[i]['role'] != 'tool' -%}
    {%- set m = turns[i] -%}
    {%- set role = 'model' if m['role'] == 'assistant' else m['role'] -%}
    {%- set earlier = turns[:i] | rejectattr('role', 'equalto', 'tool') | list -%}
    {%- if not (role == 'model' and earlier and earlier[-1]['role'] == 'assistant') -%}{{- '<|turn>' + role + '\n' -}}{%- endif -%}
    {%- set state.last = None -%}
    {%- set answered = namespace(any=false) -%}
    {%- if m.get('tool_calls') -%}
        {%- set thought = m.get('reasoning') or m.get('reasoning_content') -%}
        {%- if thought and i > state.last_user -%}{{- '<|channel>thought\n' + thought + '\n<channel|>' -}}{%- endif -%}
        {%- for c in m['tool_calls'] -%}
            {{- '<|tool_call>call:' + c['function']['name'] + '{' -}}
            {%- if c['function']['arguments'] is mapping -%}
                {%- for k, x in c['function']['arguments'] | dictsort -%}{{ ',' if not loop.first }}{{ k }}:{{ value(x) }}{%- endfor -%}
            {%- else -%}{{- c['function']['arguments'] -}}
            {%- endif -%}
            {{- '}<tool_call|>' -}}
        {%- endfor -%}
        {%- set state.last = 'tool_call' -%}
        {%- set results = namespace(open=true) -%}
        {%- for r in turns[i + 1:] -%}
            {%- if r['role'] != 'tool' -%}{%- set results.open = false -%}{%- endif -%}
            {%- if results.open -%}
                {%- set name = namespace(value=r.get('name') or 'unknown') -%}
                {%- for c in m['tool_calls'] if c.get('id') == r.get('tool_call_id') -%}{%- set name.value = c['function']['name'] -%}{%- endfor -%}
                {%- set body = r['content'] if r['content'] is string or r['content'] is none else r['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') -%}
                {{- '<|tool_response>response:' + name.value + '{value:' + value(body) + '}<tool_response|>' -}}
                {%- set answered.any = true -%}
                {%- set state.last = 'tool_response' -%}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
    {%- set text = (without_thinking(m['content']) if role == 'model' else m['content'] | trim) if m['content'] is string else '' -%}
    {{- text -}}
    {%- if state.last == 'tool_call' -%}{{- '<|tool_response>' -}}
    {%- elif not (answered.any and not text | trim) -%}{{- '<turn|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt and state.last not in ['tool_call', 'tool_response'] -%}
    {{- '<|turn>model\n' -}}
    {%- if not enable_thinking -%}{{- '<|channel>thought\n<channel|>' -}}{%- endif -%}
{%- endif -%}
"""
