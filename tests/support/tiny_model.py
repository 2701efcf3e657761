"""A tiny random Qwen2 model folder, built offline, for tests.

``make_tiny_model(path, seed)`` writes a complete Hugging Face model folder (config,
generation config, safetensors weights, tokenizer with a ChatML chat template) that
transformers and vLLM load without network access. Different seeds give different
weights with the same shapes and the same tokenizer, which is what weight-sync tests need.
"""
from __future__ import annotations

import os

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = [
    "What is 12 + 30? The answer is \\boxed{42}.",
    "Compute 7 + 8. The sum of 7 and 8 is \\boxed{15}.",
    "The quick brown fox jumps over the lazy dog.",
    "user assistant system: please answer the question step by step.",
    "0 1 2 3 4 5 6 7 8 9 + - * / = ( ) { } [ ]",
]


def make_tokenizer():
    """A byte-level BPE tokenizer (about 300 tokens) trained offline on a small corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )


def make_tiny_model(path: str, seed: int = 0, vocab_size: int = 320,
                    init_std: float = 0.05, eos_boost: float = 1.0) -> str:
    """Write a random-init fp32 Qwen2 model (hidden 128, head_dim 32, 2 layers) to ``path``.

    ``vocab_size`` is the embedding size (at least the tokenizer's, rounded up as real
    checkpoints do); ``init_std`` the embedding init scale (it sets how peaked the
    next-token distribution is); ``eos_boost`` how likely <|im_end|> is. Returns ``path``.
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    os.makedirs(path, exist_ok=True)
    tokenizer = make_tokenizer()
    assert len(tokenizer) <= vocab_size, (len(tokenizer), vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=128,
        num_attention_heads=4,  # head_dim 32: the smallest the vLLM CPU attention takes
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=256,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    # The default init (std 0.02) gives a nearly uniform next-token distribution; std 0.05
    # gives an entropy of about 4 nats. A component shared by every embedding row (which
    # shifts all tied logits alike) plus a little more of it on <|im_end|> makes EOS likely
    # enough that about half of 24-token samples end with it.
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, init_std)
        emb[:, 0] += 0.2
        emb[eos_id, 0] += eos_boost
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
