"""What a multi-turn rollout appends after a model turn (chatlearn.data.turns.TurnTemplate), for the
chat template families in use: the trajectory's text is the template's rendering of the whole
conversation, without re-tokenizing anything."""
from __future__ import annotations

import json

import pytest

from chatlearn.data.turns import TurnTemplate
from chatlearn.errors import UserError

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Qwen2.5's structure: a default system message (the tools listed in it), consecutive tool results
# wrapped in <tool_response> inside one user turn
QWEN25_LIKE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{{- messages[0].content if messages[0].role == 'system' else 'You are a helpful assistant.' }}"
    "{{- '\\n\\n# Tools\\n<tools>' }}{%- for t in tools %}{{- '\\n' }}{{- t | tojson }}{%- endfor %}"
    "{{- '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0].role != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif m.role == 'system' and loop.first %}"
    "{%- if not tools %}{{- '<|im_start|>system\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

# Qwen3's structure: the reasoning of assistant turns before the last user query is dropped when the
# conversation is rendered again (which is why re-tokenizing a history changes it)
QWEN3_LIKE = (
    "{%- set ns = namespace(last=messages|length - 1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}"
    "{%- set content = m.content.split('</think>')[-1].lstrip('\\n') if '</think>' in m.content else m.content %}"
    "{%- if loop.index0 > ns.last %}{%- set content = m.content %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")

# renders the number of messages at the top: nothing can be appended to a rendered conversation
RECOUNTING = ("<|im_start|>system\n{{ messages|length }} messages<|im_end|>\n" + CHATML)

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}, "required": ["expression"]}}}]


@pytest.fixture(params=["transformers", "driver"])
def tokenizer_for(request, tmp_path):
    """A tokenizer of the tiny test vocabulary with the given chat template: transformers' own, or the
    driver's (chatlearn.data.dataset.load_tokenizer of a folder)."""
    from tiny_model import make_tokenizer

    from chatlearn.data.dataset import load_tokenizer

    def make(template: str):
        tok = make_tokenizer()
        tok.chat_template = template
        if request.param == "transformers":
            return tok
        folder = tmp_path / f"tok{abs(hash(template))}"
        tok.save_pretrained(folder)
        return load_tokenizer(str(folder), trust_remote_code=False, key="models.policy.load")

    return make


def conversation_ids(turns: TurnTemplate, tok, prompt: list, steps: list) -> list:
    """The ids a rollout builds: the prompt, then per step the model's text (+ eos) and the observation."""
    eos = tok.encode("<|im_end|>", add_special_tokens=False)[0]
    ids = turns.prompt_ids(prompt)
    for model_text, observation in steps:
        ids += tok.encode(model_text, add_special_tokens=False) + [eos]
        if observation:
            ids += turns.observation_ids(observation, ended_with=eos)
    return ids


@pytest.mark.parametrize("template, tools", [(CHATML, None), (QWEN25_LIKE, None), (QWEN25_LIKE, TOOLS)])
def test_the_trajectory_reads_as_the_template_renders_the_whole_conversation(tokenizer_for, template, tools):
    tok = tokenizer_for(template)
    turns = TurnTemplate(tok, tools=tools, roles=("user", "tool"))
    prompt = [{"role": "user", "content": "What is 347 * 58?"}]
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "347 * 58"}}\n</tool_call>'
    steps = [(call, [{"role": "tool", "content": "20126"}]),
             (call + call, [{"role": "tool", "content": "20126"}, {"role": "tool", "content": "20126"}]),
             ("Done", [{"role": "user", "content": "Are you sure?"}]),
             ("\\boxed{20126}", None)]
    ids = conversation_ids(turns, tok, prompt, steps)
    messages = list(prompt)
    for model_text, observation in steps:
        messages += [{"role": "assistant", "content": model_text}] + (observation or [])
    whole = tok.apply_chat_template(messages, tokenize=False, tools=tools)
    assert tok.decode(ids) + "\n" == whole  # the template closes the last turn with "\n" after <|im_end|>


def test_what_is_appended_after_a_model_turn(tokenizer_for):
    tok = tokenizer_for(QWEN25_LIKE)
    turns = TurnTemplate(tok, roles=("tool",))
    eos = tok.encode("<|im_end|>", add_special_tokens=False)[0]
    assert turns.turn_end == "<|im_end|>\n"
    two = [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    expected = "\n<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response>" \
               "<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(turns.observation_ids(two, ended_with=eos)) == expected
    # a turn that did not end with the template's end-of-turn token gets it appended
    assert tok.decode(turns.observation_ids(two, ended_with=None)) == "<|im_end|>" + expected
    other = tok.encode("<|endoftext|>", add_special_tokens=False)[0]
    assert tok.decode(turns.observation_ids(two, ended_with=other)) == "<|im_end|>" + expected


def test_the_model_turns_are_kept_as_generated_where_a_rerendering_would_change_them(tokenizer_for):
    """Qwen3-style templates drop the reasoning of earlier turns when a history is rendered again;
    the trajectory keeps the tokens the model generated, reasoning included."""
    tok = tokenizer_for(QWEN3_LIKE)
    turns = TurnTemplate(tok, roles=("tool",), enable_thinking=False)
    prompt = [{"role": "user", "content": "Q"}]
    steps = [("<think>\nplan\n</think>\n\ncall", [{"role": "tool", "content": "42"}]), ("\\boxed{42}", None)]
    text = tok.decode(conversation_ids(turns, tok, prompt, steps))
    assert "<think>\nplan\n</think>\n\ncall<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" \
           "<|im_start|>assistant\n<think>\n\n</think>\n\n\\boxed{42}<|im_end|>" in text
    rerendered = tok.apply_chat_template(prompt + [{"role": "assistant", "content": steps[0][0]},
                                                   {"role": "tool", "content": "42"},
                                                   {"role": "user", "content": "next"}], tokenize=False)
    assert "plan" not in rerendered  # what re-tokenizing the history would have trained on


def test_a_template_that_changes_the_text_before_new_messages_is_refused_at_start(tokenizer_for):
    with pytest.raises(UserError, match="renders a conversation differently once \\['user'\\] messages follow"):
        TurnTemplate(tokenizer_for(RECOUNTING), roles=("user",))


def test_a_template_that_fails_on_a_role_is_refused_naming_it(tokenizer_for):
    strict = ("{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
              "{{ raise_exception('roles must be user or assistant') }}{% endif %}" + CHATML[len("{% for m in messages %}"):])
    turns = TurnTemplate(tokenizer_for(strict), roles=("user",))
    with pytest.raises(UserError, match="fails on \\['tool'\\] messages after an assistant turn: .*roles must be"):
        turns.observation_ids([{"role": "tool", "content": "x"}], ended_with=None)
    with pytest.raises(UserError, match="observation_role"):
        TurnTemplate(tokenizer_for(strict), roles=("tool",))


def test_tools_reach_the_prompt(tokenizer_for):
    tok = tokenizer_for(QWEN25_LIKE)
    text = tok.decode(TurnTemplate(tok, tools=TOOLS).prompt_ids([{"role": "user", "content": "Q"}]))
    assert json.dumps(TOOLS[0]["function"]["name"]) in text and "# Tools" in text
