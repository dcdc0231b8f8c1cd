"""llama.engine.sampling's fast paths against the plain computations they replace: torch.argmax
for greedy decoding, Meta's reference (sort the whole vocabulary, cut at top-p,
``torch.multinomial``) for sampling.  What must match exactly does (token ids, the
kept set and its probabilities); what is random is checked against the exact
distribution with a binomial tolerance."""


import pytest
import torch

from llama.engine import sampling
from llama.engine.sampling import (
    GREEDY_BLOCK,
    SamplingParams,
    draw,
    greedy_tokens,
    sample_next_token,
    sample_top_p,
    top_p_candidates,
)


def reference_kept(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Meta's reference rule, (B, V) in vocabulary order: sort everything, keep a token
    while the mass before it is at most p."""
    probs_sorted, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(probs_sorted, dim=-1) - probs_sorted
    kept_sorted = probs_sorted.masked_fill(mass_before > p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, kept_sorted)


# ---------------------------------------------------------------------------------- greedy

@pytest.mark.parametrize("width", [
    40,  # under the blocked path's minimum: torch.argmax itself
    32000, 128256,  # Llama 2 and Llama 3: whole blocks
    32016, 202048,  # Code Llama and Llama 4: a partial last block
    4 * GREEDY_BLOCK + 1,
])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_greedy_tokens_is_torch_argmax_ties_included(width, rows, monkeypatch):
    monkeypatch.setattr(sampling, "GREEDY_BLOCKED_FROM", 0)  # the blocked search at every size
    g = torch.Generator().manual_seed(width + rows)
    # Small integers: many ties for the maximum, in the same block and across blocks.
    logits = torch.randint(-20, 4, (rows, width), generator=g).float()
    assert torch.equal(greedy_tokens(logits), torch.argmax(logits, dim=-1))
    # The maximum only in the partial last block, then tied with the first position.
    logits[:, -1] = 10.0
    assert torch.equal(greedy_tokens(logits), torch.argmax(logits, dim=-1))
    logits[:, 0] = 10.0
    assert torch.equal(greedy_tokens(logits), torch.argmax(logits, dim=-1))


@pytest.mark.parametrize("width", [128256, 32016])
def test_greedy_tokens_handles_nan_and_infinities_as_torch_does(width, monkeypatch):
    monkeypatch.setattr(sampling, "GREEDY_BLOCKED_FROM", 0)
    logits = torch.randn(4, width, generator=torch.Generator().manual_seed(1))
    logits[0] = float("-inf")  # all -inf: index 0
    logits[1, 77] = float("nan")  # NaN counts as the maximum
    logits[2, -1] = float("nan")  # ... in the last (partial) block too
    logits[2, 5] = float("inf")
    logits[3, 1000] = logits[3, width - 3] = float("inf")  # first +inf wins
    assert torch.equal(greedy_tokens(logits), torch.argmax(logits, dim=-1))


def test_greedy_tokens_on_a_non_contiguous_or_low_precision_input():
    base = torch.randn(6, 128256, generator=torch.Generator().manual_seed(2))
    for logits in (base[::2], base.t().contiguous().t(), base.bfloat16(), base[:, 3:]):
        assert torch.equal(greedy_tokens(logits), torch.argmax(logits, dim=-1))


# ---------------------------------------------------------------------------------- top-p

def peaked_probs(rows: int, vocab: int, spread: float, seed: int) -> torch.Tensor:
    """Softmax of Gaussian logits: spread 8 gives a nucleus of a few tokens, spread 0.1
    one of most of the vocabulary (what the candidate search must fall back on)."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, vocab, generator=g) * spread, dim=-1)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
@pytest.mark.parametrize("spread", [12.0, 8.0, 3.0, 1.0, 0.1])  # from a handful of tokens to the whole sort
@pytest.mark.parametrize("p", [0.5, 0.9, 0.99])
def test_top_p_keeps_exactly_the_reference_tokens_and_probabilities(spread, p):
    probs = peaked_probs(3, 50000, spread, seed=int(spread * 10))
    expected = reference_kept(probs, p)
    for row, expected_row in zip(probs, expected):
        kept, ids = top_p_candidates(row, p)
        mine = torch.zeros_like(row).scatter_(-1, ids, kept)
        assert torch.equal(mine > 0, expected_row > 0)
        torch.testing.assert_close(mine, expected_row, rtol=0, atol=0)


def test_top_p_candidates_widen_only_when_needed():
    """A peaked row sorts a few candidates; a row whose likely tokens hold less than p
    widens the look; a flat row sorts everything, as the reference does."""
    narrow = peaked_probs(1, 50000, 12.0, seed=3)[0]
    kept, ids = top_p_candidates(narrow, 0.9)
    assert ids.numel() < 100
    # The most likely token holds 0.9; 1250 tokens at 7e-5..9e-5 (under 1e-4 of it, all
    # different: no tie at the cut) hold 0.1 and the rest 1e-12 each: top-p 0.95 needs the second
    # ratio, not a whole sort.
    wide = torch.full((50000,), 1e-12)
    wide[0], wide[1:1251] = 0.9, torch.linspace(7e-5, 9e-5, 1250)
    wide = wide / wide.sum()
    kept, ids = top_p_candidates(wide, 0.95)
    expected = reference_kept(wide.unsqueeze(0), 0.95)[0]
    assert torch.equal(torch.zeros_like(wide).scatter_(-1, ids, kept), expected)
    assert ids.numel() == 1251
    flat = torch.full((50000,), 1 / 50000)
    kept, ids = top_p_candidates(flat, 0.9)
    assert ids.numel() == 50000
    assert int((kept > 0).sum()) == int(reference_kept(flat.unsqueeze(0), 0.9).gt(0).sum())
    with pytest.raises(ValueError, match="one row"):
        top_p_candidates(flat.unsqueeze(0), 0.9)


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_sampled_tokens_follow_the_nucleus_distribution():
    probs = peaked_probs(1, 1000, 2.0, seed=4)
    expected = reference_kept(probs, 0.8)[0]
    expected = expected / expected.sum()
    g = torch.Generator().manual_seed(0)
    n = 6000
    counts = torch.bincount(sample_top_p(probs.expand(n, -1), 0.8, g), minlength=1000).double()
    assert counts[expected == 0].sum() == 0  # nothing outside the nucleus
    inside = expected > 0
    mean = n * expected[inside].double()
    sigma = (mean * (1 - expected[inside].double())).sqrt()
    assert ((counts[inside] - mean).abs() <= 5 * sigma + 1).all()


# ---------------------------------------------------------------------------------- drawing

def test_draw_matches_the_weights_and_never_draws_a_zero():
    weights = torch.tensor([[0.0, 1.0, 2.0, 0.0, 7.0, 0.0]])
    g = torch.Generator().manual_seed(5)
    n = 30000
    counts = torch.bincount(draw(weights.expand(n, -1), g), minlength=6).double()
    assert counts[0] == counts[3] == counts[5] == 0
    expected = n * weights[0].double() / 10
    sigma = (expected * (1 - weights[0].double() / 10)).sqrt()
    assert ((counts - expected).abs() <= 5 * sigma + 1).all()


def test_draw_is_seeded_and_refuses_rows_without_weight():
    weights = torch.rand(4, 1000, generator=torch.Generator().manual_seed(6))
    a = draw(weights, torch.Generator().manual_seed(9))
    b = draw(weights, torch.Generator().manual_seed(9))
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="all zero"):
        draw(torch.zeros(1, 10))
    with pytest.raises(ValueError, match="all zero"):
        draw(torch.full((1, 10), float("nan")))


# ---------------------------------------------------------------------------------- top-k

@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_top_k_candidates_are_the_k_most_likely_renormalised():
    logits = torch.randn(1, 3000, generator=torch.Generator().manual_seed(7))
    params = SamplingParams(temperature=1.0, top_p=1.0, top_k=5)
    top5 = torch.topk(logits[0], 5).indices
    expected = torch.softmax(logits[0, top5], dim=-1)
    g = torch.Generator().manual_seed(1)
    n = 6000
    draws = torch.cat([sample_next_token(logits, params, g) for _ in range(n)])
    counts = torch.bincount(draws, minlength=3000).double()
    assert counts.sum() == counts[top5].sum()
    mean = n * expected.double()
    assert ((counts[top5] - mean).abs() <= 5 * (mean * (1 - expected.double())).sqrt() + 1).all()


def test_top_k_then_top_p_cuts_the_renormalised_top_k():
    # Top 3 of these logits renormalise to about (0.665, 0.245, 0.090): top_p 0.8 keeps two.
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.5, 0.4, 0.3]])
    params = SamplingParams(temperature=1.0, top_p=0.8, top_k=3)
    g = torch.Generator().manual_seed(2)
    assert {int(sample_next_token(logits, params, g)) for _ in range(400)} == {0, 1}


@pytest.mark.slow  # over ~1 s: the quick subset stays under 2 min (-n 2)
def test_a_batch_mixing_narrow_and_flat_rows_samples_each_from_its_own_nucleus():
    """Rows whose nucleus needs a whole sort are sorted together; every row must still
    draw from its own nucleus, in row order."""
    narrow = peaked_probs(1, 3000, 12.0, seed=8)
    flat = peaked_probs(1, 3000, 0.1, seed=9)
    probs = torch.cat([flat, narrow, flat.flip(-1)])
    allowed = reference_kept(probs, 0.9) > 0
    g = torch.Generator().manual_seed(3)
    seen = torch.zeros_like(allowed)
    for _ in range(200):
        tokens = sample_top_p(probs, 0.9, g)
        assert allowed[torch.arange(3), tokens].all()
        seen[torch.arange(3), tokens] = True
    assert int(seen[0].sum()) > 150 and int(seen[2].sum()) > 150  # spread over the flat rows' nuclei
    assert int(allowed[1].sum()) < 20


# -------------------------------------------------------------------- rounding-stable draws

@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, top_p=0.95),  # nucleus by candidates
                                    SamplingParams(temperature=1.0, top_p=0.999),  # nucleus by a whole sort
                                    SamplingParams(temperature=1.0, top_p=0.99, top_k=50)],
                         ids=["top-p", "top-p-whole-sort", "top-k"])
def test_a_seeded_draw_does_not_move_when_near_equal_logits_swap_places(params):
    """Logits that differ by float rounding (a prompt prefilled in one pass or after a cached
    prefix, another kernel) reorder near-equal probabilities.  The running sum is taken in
    vocabulary order, so the same seed draws the same token unless its uniform number falls
    within that rounding of a boundary (here: never, over 300 seeds).  Drawn in the order of
    the sorted probabilities, each swap moved every later token: most seeds changed token."""
    vocab = 2000
    # 30 equally likely tokens (two thirds of the mass) that the noise reorders, and a tail of
    # distinct logits where each nucleus ends (so the noise does not change the kept set).
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(12)) * 0.5 - 3
    tied = torch.randperm(vocab, generator=torch.Generator().manual_seed(13))[:30]
    logits[0, tied] = 2.0
    noise = torch.zeros_like(logits)
    noise[0, tied] = torch.randn(30, generator=torch.Generator().manual_seed(14)) * 1e-6
    perturbed = logits + noise
    order_a = torch.argsort(logits[0], descending=True)
    order_b = torch.argsort(perturbed[0], descending=True)
    assert (order_a[:50] != order_b[:50]).any()  # the rounding does reorder the likely tokens
    moved = sum(int(sample_next_token(logits, params, torch.Generator().manual_seed(s))) !=
                int(sample_next_token(perturbed, params, torch.Generator().manual_seed(s))) for s in range(300))
    assert moved == 0


class _Row:
    """What Sampler.sample reads of a request."""

    def __init__(self, i: int, processor=None) -> None:
        self.id, self.processor, self.matcher, self.generated = i, processor, None, []
        self.sampling, self.generator = SamplingParams(temperature=0), torch.Generator()

    def tokens_so_far(self) -> list[int]:
        return []


def test_the_compiled_steps_summary_stands_for_the_logits_only_where_nothing_changes_them():
    """Sampler.sample given a RowSummary (the compiled CPU step's greedy tokens and row sums of its
    logits, llama.engine.runner): where no grammar or processor changes a row, the greedy tokens
    are the summary's (it is what the sampler reads, not a second argmax: here a summary that
    disagrees with the logits shows it); where a processor changes one, every row's token is the
    argmax of the logits as they are then; and a row whose logits (and so their sum) hold NaN
    fails alone, as without a summary."""
    from llama.engine.sampler import Sampler
    from llama.engine.sampling import RowSummary

    vocab = 600
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    truth = logits.argmax(-1).tolist()
    other = ((logits.argmax(-1) + 7) % vocab)  # not the argmax of either row
    summary = RowSummary(other.clone(), logits.sum(-1))
    sampler = Sampler(vocab, torch.Generator(), torch.device("cpu"), first_rank=True, multi_rank=False)

    tokens, errors, _ = sampler.sample([_Row(0), _Row(1)], logits.clone(), summary=summary)
    assert tokens == other.tolist() and not errors
    tokens, errors, _ = sampler.sample([_Row(0), _Row(1)], logits.clone())
    assert tokens == truth and not errors

    def prefer_five(ids, row_logits):
        row_logits[..., 5] = row_logits.max() + 1
        return row_logits

    tokens, errors, _ = sampler.sample([_Row(0), _Row(1, processor=prefer_five)], logits.clone(), summary=summary)
    assert tokens == [truth[0], 5] and not errors

    broken = logits.clone()
    broken[1, 3] = float("nan")
    tokens, errors, _ = sampler.sample([_Row(0), _Row(1)], broken.clone(),
                                       summary=RowSummary(broken.argmax(-1), broken.sum(-1)))
    assert tokens[0] == truth[0] and set(errors) == {1}
