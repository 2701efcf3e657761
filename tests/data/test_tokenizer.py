"""The driver's tokenizer (chatlearn.data.tokenizer) gives transformers' ids and text, and is used only
where it can; the driver then imports neither transformers nor torch."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from chatlearn.data.dataset import load_tokenizer
from chatlearn.data.tokenizer import FastChatTokenizer, fast_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "assets", "tiny_qwen2")

CHATS = [
    [{"role": "user", "content": "What is 12 + 7?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2*3 = ? Answer in \\boxed{}."}],
    [{"role": "user", "content": "héllo wörld 漢字 <|im_end|> tabs\t and\n\nnewlines  "},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}],
    [{"role": "user", "content": ""}],
]
# a template in the style of Llama's: special tokens as variables, tojson, loop controls, raise_exception
BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
                "{% endif %}{% if loop.index > 8 %}{% break %}{% endif %}<|im_start|>{{ m['role'] }}\n"
                "{{ m['content'] | trim }}{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}"
                "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}{{ {'x': '<&>'} | tojson }}"
                "{% endif %}{% endif %}")


def _folder(tmp_path, name="tok", config: dict | None = None, template: str | None = None, jinja: bool = True):
    out = tmp_path / name
    out.mkdir()
    shutil.copy(os.path.join(TINY, "tokenizer.json"), out / "tokenizer.json")
    cfg = json.loads(open(os.path.join(TINY, "tokenizer_config.json")).read())
    cfg.update(config or {})
    if template is None:
        shutil.copy(os.path.join(TINY, "chat_template.jinja"), out / "chat_template.jinja")
    elif jinja:
        (out / "chat_template.jinja").write_text(template)
    else:
        cfg["chat_template"] = template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(out)


def _assert_same(path):
    from transformers import AutoTokenizer

    ours, ref = fast_tokenizer(path), AutoTokenizer.from_pretrained(path)
    assert isinstance(ours, FastChatTokenizer)
    assert len(ours) == len(ref)
    for chat in CHATS:
        for thinking in (False, True):
            for gen in (True, False):
                want = ref.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True,
                                               enable_thinking=thinking)
                want = list(want["input_ids"] if hasattr(want, "keys") else want)
                assert ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True,
                                                enable_thinking=thinking) == want
                assert ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False,
                                                enable_thinking=thinking) == ref.apply_chat_template(
                    chat, add_generation_prompt=gen, tokenize=False, enable_thinking=thinking)
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, len(ref), size=int(n)).tolist() for n in rng.integers(0, 40, size=30)]
    for skip in (True, False):
        assert ours.batch_decode(seqs, skip_special_tokens=skip) == ref.batch_decode(seqs, skip_special_tokens=skip)
        assert ours.decode(seqs[3], skip_special_tokens=skip) == ref.decode(seqs[3], skip_special_tokens=skip)


def test_the_bundled_tokenizer_gives_transformers_ids_and_text():
    _assert_same(TINY)


def test_a_template_in_the_config_with_special_token_variables_gives_transformers_ids(tmp_path):
    _assert_same(_folder(tmp_path, config={"bos_token": "<|endoftext|>"}, template=BOS_TEMPLATE, jinja=False))
    _assert_same(_folder(tmp_path, "named", config={"bos_token": {"__type": "AddedToken", "content": "<|endoftext|>",
                                                        "special": True}},
                         template=None))


@pytest.mark.parametrize("change", ["class", "no_class", "auto_map", "no_json", "missing_special",
                                    "named_templates", "more_templates", "odd_special"])
def test_folders_it_cannot_reproduce_go_to_transformers(tmp_path, change):
    config, template, jinja = {}, None, True
    if change == "class":
        config = {"tokenizer_class": "Qwen2Tokenizer"}  # a class that may rebuild the tokenizer in code
    elif change == "no_class":
        config = {"tokenizer_class": None}  # transformers picks a class by the model type
    elif change == "auto_map":
        config = {"auto_map": {"AutoTokenizer": ["tok.MyTokenizer", None]}}
    elif change == "missing_special":
        template = BOS_TEMPLATE  # uses bos_token, which the config does not define
    elif change == "odd_special":
        config = {"bos_token": {"content": "<s>"}}  # not a serialized AddedToken: transformers refuses it
    elif change == "named_templates":
        template, jinja = [{"name": "tool_use", "template": "x"}], False
    path = _folder(tmp_path, config=config, template=template, jinja=jinja)
    if change == "no_json":
        os.remove(os.path.join(path, "tokenizer.json"))
    if change == "more_templates":
        os.mkdir(os.path.join(path, "additional_chat_templates"))
    assert fast_tokenizer(path) is None


def test_load_tokenizer_uses_it_and_still_refuses_a_folder_without_a_template(tmp_path):
    from chatlearn.errors import UserError

    assert isinstance(load_tokenizer(TINY, trust_remote_code=False, key="models.policy.load"), FastChatTokenizer)
    path = _folder(tmp_path)
    os.remove(os.path.join(path, "chat_template.jinja"))
    with pytest.raises(UserError, match="has no chat template"):
        load_tokenizer(path, trust_remote_code=False, key="models.policy.load")


def test_the_driver_loads_prompts_without_torch_transformers_or_datasets(tmp_path):
    """What `chatlearn run` imports before it starts the workers, plus the tokenizer, a multi-turn rollout
    with tools (its environment, tools and chat template) and the prompts."""
    code = ("import sys\n"
            "import chatlearn.cli, chatlearn.runtime.driver.engine, chatlearn.runtime.driver.evaluate\n"
            "from chatlearn.config.load import load_config\n"
            "from chatlearn.data.dataset import load_prompts, load_tokenizer\n"
            "from chatlearn.runtime.driver.multiturn import MultiTurnLoop\n"
            f"tok = load_tokenizer({TINY!r}, trust_remote_code=False, key='k')\n"
            "cfg = load_config('template/grpo_fsdp.yaml', ['models.policy.multi_turn.environment=builtin:tools', "
            "\"models.policy.multi_turn.tools=[{name: calculator, path: 'builtin:calculator'}]\"])\n"
            "mt = MultiTurnLoop(cfg, tok)\n"
            f"s = load_prompts([{os.path.join(REPO, 'assets', 'arith', 'train.jsonl')!r}], tok, max_prompt_tokens=256,"
            " enable_thinking=False, prompt_key='prompt', ground_truth_key='reward_model.ground_truth', "
            "tools=mt.tool_schemas)\n"
            "print(len(s), sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "HF_DATASETS_CACHE": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    count, imported = out.stdout.split(" ", 1)
    assert int(count) > 100 and imported.strip() == "[]"
