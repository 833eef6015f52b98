"""ssmshard.eval.perplexity against NLLs computed here by hand, in float64, token by token."""

import math

import pytest
import torch

from ssmshard.eval import perplexity, windows

V = 11


def bigram_logits_fn(table):
    """A model-free ``ids -> logits``: the logits at position t are ``table[ids[t]]``."""
    return lambda ids: table[ids]  # (b, T) -> (b, T, V)


def hand_nll(table, stream, window):
    """Summed NLL per full window, one prediction at a time, in float64."""
    log_probs = torch.log_softmax(table.double(), dim=-1)
    sums = []
    for start in range(0, (stream.numel() // window) * window, window):
        chunk = stream[start:start + window].tolist()
        sums.append(sum(-log_probs[prev, nxt].item() for prev, nxt in zip(chunk, chunk[1:])))
    return sums


@pytest.mark.parametrize("window, batch_size, length", [(8, 3, 61), (2, 1, 9), (16, 16, 16)])
def test_perplexity_matches_a_hand_computed_bigram_nll(fresh_seed, window, batch_size, length):
    gen = torch.Generator().manual_seed(fresh_seed)
    table = torch.randn(V, V, generator=gen) * 3
    stream = torch.randint(0, V, (length,), generator=gen)
    result = perplexity(bigram_logits_fn(table), stream, window=window, batch_size=batch_size)
    expected = hand_nll(table, stream, window)
    assert result.windows == len(expected) == length // window
    assert result.predictions == len(expected) * (window - 1)
    assert result.tokens_dropped == length % window
    # Each token's NLL is a float32 cross-entropy: log-sum-exp minus one logit, so its error is a
    # few float32 rounding steps of the logits' size whatever the NLL's own size (a confident
    # prediction's NLL of 0.05 is 1e-6 off at logits of 10, 2e-5 of itself). Hence an absolute
    # floor besides 1e-5 relative.
    atol = (window - 1) * 8 * torch.finfo(torch.float32).eps * float(table.abs().max())
    assert torch.allclose(result.window_nll, torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=atol)
    assert result.nll_sum == pytest.approx(sum(expected), rel=1e-5, abs=atol * len(expected))
    assert result.perplexity == pytest.approx(math.exp(sum(expected) / result.predictions), rel=1e-5,
                                              abs=atol * len(expected) / result.predictions * result.perplexity)
    assert set(result.as_dict()) == {"perplexity", "mean_nll", "nll_sum", "predictions", "windows", "window",
                                     "tokens_dropped"}


def test_uniform_logits_give_the_vocabulary_size_and_max_windows_limits_the_count():
    stream = torch.arange(100) % V
    result = perplexity(lambda ids: torch.zeros(*ids.shape, V), stream, window=10, max_windows=3)
    assert result.perplexity == pytest.approx(V, rel=1e-6)  # float32 log_softmax
    assert result.windows == 3


def test_windows_are_contiguous_in_stream_order():
    stream = torch.arange(23)
    assert torch.equal(windows(stream, 5), torch.arange(20).view(4, 5))


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="1-D integer"):
        windows(torch.zeros(4, 4, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="at least 2"):
        windows(torch.arange(10), 1)
    with pytest.raises(ValueError, match="fewer than one window"):
        windows(torch.arange(3), 4)
    with pytest.raises(ValueError, match=r"expected \(batch, window, vocabulary\)"):
        perplexity(lambda ids: torch.zeros(ids.shape[0], V), torch.arange(8), window=4)
    with pytest.raises(TypeError, match="model\\(ids\\).logits"):
        perplexity(lambda ids: {"logits": None}, torch.arange(8), window=4)
