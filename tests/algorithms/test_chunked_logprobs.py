"""chunked_logprobs_entropy: the same values and gradients as the full-logits path, and no
``[rows, V]`` tensor beyond one chunk, forward or backward."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from chatlearn.algorithms.grpo import (chunked_logprobs_entropy, entropy_from_logits,
                                       logprobs_from_logits)


def _inputs(m=37, h=16, v=53, seed=0, bias=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(m, h, generator=g, dtype=torch.float64).float().requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.3).requires_grad_()
    b = (torch.randn(v, generator=g) * 0.1).requires_grad_() if bias else None
    targets = torch.randint(0, v, (m,), generator=g)
    return hidden, weight, b, targets


def _full(hidden, weight, bias, targets, temperature):
    z = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    return logprobs_from_logits(z, targets), entropy_from_logits(z)


def _grads(outputs, tensors):
    logp, ent = outputs
    g = torch.Generator().manual_seed(7)
    loss = (logp * torch.randn(logp.shape, generator=g)).sum() + (ent * torch.randn(ent.shape, generator=g)).sum()
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk", [1, 5, 8, 37, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_unchunked_ones(chunk, temperature):
    hidden, weight, bias, targets = _inputs(bias=chunk == 5)
    full = _full(hidden, weight, bias, targets, temperature)
    chunked = chunked_logprobs_entropy(hidden, weight, targets, temperature, chunk, True, bias=bias)
    # Equal to 1e-6 (absolute, plus 1e-6 relative: the values are log-probs of magnitude ~1
    # to 5 in float32, whose spacing there is 1e-7 to 5e-7, and a one-row matmul rounds
    # differently from the blocked many-row one on some BLAS builds).
    for a, b in zip(chunked, full):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # The weight's gradient sums one float32 term per row, chunk by chunk and then over the
    # chunks: a different summation order than one matmul over all rows (values ~1 to 5).
    for a, b in zip(_grads(chunked, (hidden, weight, bias)), _grads(full, (hidden, weight, bias))):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_without_entropy_and_without_grad():
    hidden, weight, _, targets = _inputs()
    with torch.no_grad():
        logp, ent = chunked_logprobs_entropy(hidden, weight, targets, 0.9, 4, False)
        ref, _ = _full(hidden, weight, None, targets, 0.9)
    assert ent is None and not logp.requires_grad
    torch.testing.assert_close(logp, ref, rtol=0, atol=1e-6)


def test_zero_rows_stay_in_the_graph():
    """A dummy micro-step has no tokens; its (zero) backward must still reach the weights."""
    hidden, weight, _, targets = _inputs()
    logp, ent = chunked_logprobs_entropy(hidden[:0], weight, targets[:0], 1.0, 4, True)
    assert logp.shape == ent.shape == (0,) and logp.requires_grad
    (logp.sum() + ent.sum()).backward()
    assert weight.grad is not None and not weight.grad.any()


class LargestVocabTensor(TorchDispatchMode):
    """Records the largest number of rows of any tensor an op returns whose last dim is V,
    other than the ``[V, H]`` weight's own size (its transposed views and its gradient)."""

    def __init__(self, vocab, hidden):
        super().__init__()
        self.vocab, self.hidden, self.rows = vocab, hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if (isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[-1] == self.vocab
                    and t.numel() != self.vocab * self.hidden):
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_no_tensor_larger_than_one_chunk_of_vocab_rows():
    """Forward and backward of 512 tokens in chunks of 64: no op makes more than 64 x V
    other than the weight-sized V x H ones; the full-logits path makes 512 x V."""
    vocab, chunk = 4099, 64
    hidden, weight, _, targets = _inputs(m=512, h=32, v=vocab)
    with LargestVocabTensor(vocab, 32) as seen:
        out = chunked_logprobs_entropy(hidden, weight, targets, 0.8, chunk, True)
        _grads(out, (hidden, weight))
    assert 0 < seen.rows <= chunk
    with LargestVocabTensor(vocab, 32) as full:
        _grads(_full(hidden, weight, None, targets, 0.8), (hidden, weight))
    assert full.rows == 512  # the probe sees the [tokens, V] logits when they exist
