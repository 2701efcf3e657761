"""The driver's tokenizer: what the driver asks of a model folder's tokenizer (prompts through the chat
template into token ids, token ids back into text for the rewards and the logs), without importing
transformers and torch where that gives the same ids.

``load_tokenizer(path)`` returns a :class:`FastChatTokenizer` when transformers itself would use the
folder's ``tokenizer.json`` as it is: the folder has one, its ``tokenizer_config.json`` names no class
of its own (``tokenizer_class`` is ``TokenizersBackend`` or ``PreTrainedTokenizerFast``: the classes
that do not rebuild the tokenizer from its vocabulary) and no custom code (``auto_map``), every
special token the chat template refers to is in the config, and no WordPiece-style clean-up of spaces
is asked for. The chat template is rendered as transformers renders it (a sandboxed jinja2
environment with ``trim_blocks``, ``lstrip_blocks``, the loop controls, ``raise_exception``,
``strftime_now`` and a ``tojson`` that does not escape HTML; transformers 5.x
``utils/chat_template_utils.py``), with the special tokens as template variables, and the text is
encoded without special tokens added (``apply_chat_template(tokenize=True)`` does the same). Any other
folder loads through ``transformers.AutoTokenizer``. Importing transformers costs the driver about
250 MB and 3 s; the tokenizer alone, a few MB.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache

# the tokenizer_config.json classes that load tokenizer.json unchanged (transformers 5.x:
# PreTrainedTokenizerFast is TokenizersBackend); any other class, or none named (transformers then
# picks one by the model type), may rebuild the tokenizer in code
VERBATIM_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
CHAT_TEMPLATE_FILE = "chat_template.jinja"


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value):
    """A special token of tokenizer_config.json: a string, or a serialized AddedToken (a dict with
    ``"__type": "AddedToken"`` and ``content``); None when unset; False for anything else."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("__type") == "AddedToken" and isinstance(value.get("content"), str):
        return value["content"]
    return False


def _chat_template(path: str, config: dict):
    """The folder's default chat template as transformers picks it: ``chat_template.jinja`` first, else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or named templates: the one named
    ``default``); None without one. Named templates in ``additional_chat_templates/`` are not read, so
    a folder with them is left to transformers (returns ``False``)."""
    if os.path.isdir(os.path.join(path, "additional_chat_templates")):
        return False
    file = os.path.join(path, CHAT_TEMPLATE_FILE)
    if os.path.exists(file):
        with open(file, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default", False)
    return template


@lru_cache(maxsize=1)
def _environment():
    """transformers' jinja2 environment for chat templates (see the module docstring)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class Generation(jinja2.ext.Extension):  # transformers' {% generation %} block, rendered as its body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@lru_cache(maxsize=8)
def compile_chat_template(template: str):
    """The jinja2 template of ``template``, in transformers' environment."""
    return _environment().from_string(template)


def _template_variables(template: str) -> set[str]:
    import jinja2
    from jinja2 import meta

    try:
        return set(meta.find_undeclared_variables(_environment().parse(template)))
    except jinja2.TemplateSyntaxError:
        return set()  # a broken template fails when it is rendered, with the row it failed on


class FastChatTokenizer:
    """A model folder's ``tokenizer.json`` (the ``tokenizers`` library) and chat template: the part of
    a transformers tokenizer the driver uses, giving the same ids and text (see the module docstring)."""

    def __init__(self, path: str, backend, config: dict, chat_template: str | None):
        self.name_or_path = path
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.special_tokens_map = {k: t for k in SPECIAL_TOKENS if isinstance(t := _token_text(config.get(k)), str)}
        for key, token in self.special_tokens_map.items():
            setattr(self, key, token)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = False, tools: list | None = None,
                    **kwargs) -> str:
        """The chat template's text of ``messages`` (template variables: the special tokens, then ``kwargs``;
        ``tools``: JSON schemas of the tools, as transformers passes them)."""
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template")
        return compile_chat_template(self.chat_template).render(
            messages=messages, tools=tools or None, documents=None, add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens_map, **kwargs})

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = False,
                            tokenize: bool = True, **kwargs):
        """As transformers' ``apply_chat_template`` for one conversation: the ids of the rendered text,
        encoded without special tokens added (or the text with ``tokenize=False``)."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.encode(text) if tokenize else text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        return self.backend_tokenizer.decode_batch([list(s) for s in sequences],
                                                   skip_special_tokens=skip_special_tokens)


def fast_tokenizer(path: str) -> FastChatTokenizer | None:
    """The :class:`FastChatTokenizer` of the folder ``path``, or None where transformers could load it
    otherwise (the conditions are in the module docstring)."""
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        return None
    try:
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
    except (OSError, ValueError):
        return None  # transformers names what is wrong with the file
    if config.get("tokenizer_class") not in VERBATIM_CLASSES or "auto_map" in config:
        return None
    if any(_token_text(config.get(k)) is False for k in SPECIAL_TOKENS):
        return None  # transformers says what is wrong with the entry
    template = _chat_template(path, config)
    if template is False or (template is not None and not isinstance(template, str)):
        return None
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(file)
    except Exception:  # noqa: BLE001 - a file tokenizers cannot read: transformers says why
        return None
    if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return None  # transformers cleans the decoded text of WordPiece-style tokenizers
    tok = FastChatTokenizer(path, backend, config, template)
    if template and (_template_variables(template) & set(SPECIAL_TOKENS)) - set(tok.special_tokens_map):
        return None  # a special token the template uses is defined by a tokenizer class in code
    return tok
