"""The token ids a multi-turn rollout appends after a model turn, rendered once by the chat template.

A trajectory is never re-tokenized: the model's tokens are kept as generated, and what comes
between two model turns (the end of the model's turn as the template writes it, the observation
messages, the header of the next assistant turn) is rendered from the chat template once and
appended. The template is asked for that text by difference: with a probe conversation ``P`` =
[user, assistant] ending in a model turn,

    render(P + observations, add_generation_prompt=True) = render(P) + appended text

so the appended text is exactly what the template puts after an assistant turn, whatever the
template (ChatML, Qwen2.5's ``<tool_response>`` wrapping of tool messages, Llama 3, ...). The
template's end of an assistant turn (``<|im_end|>\\n`` for ChatML) is what follows the assistant's
content in ``render(P)``; the part of it the model generated itself (its end-of-turn token) is not
appended again. A template that renders the probe differently once observations follow it (so
that no text can be appended) is refused when the rollout starts, naming the template.
"""
from __future__ import annotations

from chatlearn.errors import UserError

PROBE_USER = "chatlearn-probe-question"
PROBE_ASSISTANT = "chatlearn-probe-answer"


class TurnTemplate:
    """``tokenizer``'s chat template as a multi-turn rollout uses it: :meth:`prompt_ids` of a
    conversation, and :meth:`observation_ids` to append after a model turn. ``tools`` (JSON schemas)
    and ``template_kwargs`` (``enable_thinking``) are passed to every rendering, as for the prompts;
    ``roles``: the roles of the observations to come, probed when it is built."""

    def __init__(self, tokenizer, *, tools: list | None = None, roles: tuple = ("user",),
                 key: str = "models.policy.load", **template_kwargs):
        self.tokenizer, self.tools, self.kwargs, self.key = tokenizer, tools or None, template_kwargs, key
        self.probe = [{"role": "user", "content": PROBE_USER}, {"role": "assistant", "content": PROBE_ASSISTANT}]
        self.probe_text = self.render(self.probe, add_generation_prompt=False, what="a user and an assistant message")
        at = self.probe_text.rfind(PROBE_ASSISTANT)
        if at < 0:
            raise UserError(f"the chat template of {getattr(tokenizer, 'name_or_path', '?')!r} does not write an "
                            "assistant message's content (probed with a user and an assistant message), so a "
                            "multi-turn rollout cannot tell where a model turn ends. Use a chat template that renders "
                            "assistant messages.", key=key)
        self.turn_end = self.probe_text[at + len(PROBE_ASSISTANT):]  # e.g. "<|im_end|>\n"
        for role in roles:  # the roles observations will have: a template that cannot append them is refused now
            self.observation_ids([{"role": role, "content": "probe"}], ended_with=None)

    def render(self, messages: list[dict], *, add_generation_prompt: bool, what: str) -> str:
        """The template's text of ``messages``; a template that fails on them is a UserError naming
        ``what`` they were."""
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, tools=self.tools,
                                                      **self.kwargs)
        except Exception as err:  # noqa: BLE001 - the template is jinja code: say what it refused
            raise UserError(f"the chat template of {getattr(self.tokenizer, 'name_or_path', '?')!r} fails on {what}: "
                            f"{type(err).__name__}: {err}. Give the conversation roles the template accepts "
                            "(models.policy.multi_turn.observation_role, or the environment's messages).",
                            key=self.key) from None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The ids of a conversation the model starts from (with the generation prompt)."""
        return self.encode(self.render(messages, add_generation_prompt=True,
                                       what=f"the conversation {[m['role'] for m in messages]} an environment's reset "
                                            "returned"))

    def observation_ids(self, messages: list[dict], ended_with: int | None) -> list[int]:
        """The ids to append after a model turn whose last token is ``ended_with`` (None: the turn
        ended without the template's end-of-turn text): the rest of the template's end of the
        assistant turn, ``messages`` as the template renders them after it, and the next
        assistant turn's header."""
        full = self.render(self.probe + list(messages), add_generation_prompt=True,
                           what=f"{[m['role'] for m in messages]} messages after an assistant turn")
        if not full.startswith(self.probe_text):
            raise UserError(
                f"the chat template of {getattr(self.tokenizer, 'name_or_path', '?')!r} renders a conversation "
                f"differently once {[m['role'] for m in messages]} messages follow an assistant turn (the text before "
                "them changes), so observations cannot be appended to a trajectory without re-tokenizing it. Use a "
                "template that appends later messages (most do), or a different models.policy.multi_turn."
                "observation_role.", key=self.key)
        closing = self.turn_end
        if ended_with is not None:
            generated = self.tokenizer.decode([int(ended_with)], skip_special_tokens=False)
            if generated and closing.startswith(generated):
                closing = closing[len(generated):]
        return self.encode(closing + full[len(self.probe_text):])
