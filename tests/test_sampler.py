"""Sampler (greedy, temperature, top-k, top-p, seeds) and SamplingParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from kvreuse.layers.sampler import filtered_probs
from kvreuse.sampling_params import SamplingParams

from .helpers import sample

VOCAB = 50


def rand_logits(rows: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * spread


def draw(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int | None = 0) -> list[int]:
    """n samples of one row, one generator shared by all n rows of a batched call."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return sample(logits_row.expand(n, -1).contiguous(), [params] * n, [gen] * n)


# ----------------------------------------------------------------------------- greedy


def test_greedy_rows_return_argmax():
    logits = rand_logits(8, 0)
    out = sample(logits, [SamplingParams()] * 8, [None] * 8)
    assert out == logits.argmax(dim=-1).tolist()
    assert all(isinstance(t, int) for t in out)


def test_greedy_ignores_generator_and_top_settings():
    logits = rand_logits(4, 1)
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.3, seed=s) for s in range(4)]
    gens = [torch.Generator().manual_seed(s) for s in range(4)]
    state = [g.get_state() for g in gens]
    assert sample(logits, params, gens) == logits.argmax(dim=-1).tolist()
    # A greedy row does not consume randomness from its generator.
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, state, strict=True))


def test_top_k_one_equals_greedy():
    logits = rand_logits(6, 2, spread=0.1)  # nearly flat: sampling would almost never hit the argmax
    params = SamplingParams(temperature=1.5, top_k=1)
    assert params.greedy
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    assert sample(logits, [params] * 6, gens) == logits.argmax(dim=-1).tolist()
    for row in logits:
        probs = filtered_probs(row, params)
        assert probs.nonzero().flatten().tolist() == [int(row.argmax())]


def test_mixed_batch_greedy_and_sampled_rows():
    logits = rand_logits(4, 3)
    k = 3
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=k), SamplingParams(),
              SamplingParams(temperature=1.0, top_k=k)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        out = sample(logits, params, [None, gen, None, gen])
        assert out[0] == int(logits[0].argmax()) and out[2] == int(logits[2].argmax())
        assert out[1] in logits[1].topk(k).indices.tolist()
        assert out[3] in logits[3].topk(k).indices.tolist()


def test_mismatched_lengths_raise():
    with pytest.raises(ValueError):
        sample(rand_logits(2, 0), [SamplingParams()], [None, None])


# ----------------------------------------------------------------------------- top-k / top-p


@pytest.mark.parametrize("k", [2, 5, 17])
def test_top_k_never_samples_outside_top_k(k):
    logits = rand_logits(1, 4, spread=0.5)[0]  # flat-ish, so outside tokens would be drawn often
    top = set(logits.topk(k).indices.tolist())
    drawn = draw(logits, SamplingParams(temperature=1.0, top_k=k), 2000, seed=k)
    assert set(drawn) <= top
    assert set(drawn) == top  # and it really samples among all k
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=k))
    assert set(probs.nonzero().flatten().tolist()) == top
    # Renormalised over the top k: same relative weights as softmax over those k logits.
    idx = sorted(top)
    want = torch.softmax(logits[idx], dim=-1)
    torch.testing.assert_close(probs[idx] / probs.sum(), want)


def test_top_k_larger_than_vocab_is_no_filter():
    logits = rand_logits(1, 5)[0]
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=VOCAB * 10))
    torch.testing.assert_close(probs, torch.softmax(logits, dim=-1))


def test_tiny_top_p_only_draws_top_token():
    logits = rand_logits(1, 6, spread=0.3)[0]  # top token has a small share of the mass
    params = SamplingParams(temperature=1.0, top_p=1e-6)
    assert set(draw(logits, params, 500, seed=1)) == {int(logits.argmax())}
    assert filtered_probs(logits, params).nonzero().flatten().tolist() == [int(logits.argmax())]


@pytest.mark.parametrize("top_p,kept", [(0.3, 1), (0.55, 2), (0.75, 2), (0.85, 3), (0.93, 3), (0.97, 4)])
def test_top_p_keeps_smallest_prefix_reaching_mass(top_p, kept):
    # probabilities 0.5, 0.3, 0.15, 0.05 (shuffled in the vocab).
    probs_in = torch.tensor([0.15, 0.5, 0.05, 0.3])
    logits = probs_in.log()
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    order = [1, 3, 0, 2]  # tokens by descending probability
    assert probs.nonzero().flatten().sort().values.tolist() == sorted(order[:kept])
    # Kept tokens keep their probabilities (relative weights unchanged).
    torch.testing.assert_close(probs[order[:kept]], probs_in[order[:kept]])
    drawn = draw(logits, SamplingParams(temperature=1.0, top_p=top_p), 400, seed=2)
    assert set(drawn) <= set(order[:kept])


def test_top_k_and_top_p_combined():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    # top_k=3 keeps {0, 1, 2} -> renormalised 4/9, 3/9, 2/9; top_p=0.7 then keeps {0, 1} (7/9 >= 0.7).
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.7))
    assert probs.nonzero().flatten().tolist() == [0, 1]
    torch.testing.assert_close(probs[:2], torch.tensor([4 / 9, 3 / 9]))


# ----------------------------------------------------------------------------- temperature


def test_temperature_scales_logits():
    logits = rand_logits(1, 7)[0]
    for t in (0.25, 1.0, 3.0):
        probs = filtered_probs(logits, SamplingParams(temperature=t))
        torch.testing.assert_close(probs, torch.softmax(logits / t, dim=-1))
    # Higher temperature -> flatter distribution (higher entropy).
    entropy = lambda p: float(-(p * p.clamp_min(1e-30).log()).sum())
    ents = [entropy(filtered_probs(logits, SamplingParams(temperature=t))) for t in (0.25, 1.0, 3.0)]
    assert ents[0] < ents[1] < ents[2] < math.log(VOCAB)


def test_very_low_temperature_is_argmax():
    logits = rand_logits(3, 8, spread=0.5)
    params = SamplingParams(temperature=1e-4)
    assert not params.greedy
    for row in logits:
        assert set(draw(row, params, 200, seed=3)) == {int(row.argmax())}


def test_filtered_probs_does_not_modify_logits():
    logits = rand_logits(1, 9)[0]
    before = logits.clone()
    filtered_probs(logits, SamplingParams(temperature=0.7, top_k=5, top_p=0.5))
    assert torch.equal(logits, before)


# ----------------------------------------------------------------------------- seeds


def test_same_seed_same_samples_different_seed_differs():
    logits = rand_logits(1, 10, spread=0.2)[0]  # flat-ish: ~VOCAB equally likely outcomes
    params = SamplingParams(temperature=1.0, seed=123)
    a = draw(logits, params, 100, seed=123)
    b = draw(logits, params, 100, seed=123)
    c = draw(logits, params, 100, seed=124)
    assert a == b
    assert a != c
    assert len(set(a)) > 10  # it really samples


def test_seeded_row_reproducible_regardless_of_batch():
    # A seeded request draws the same tokens whether alone or batched with other (unseeded) requests.
    logits = rand_logits(3, 11, spread=0.2)
    p = SamplingParams(temperature=1.0)
    alone_gen = torch.Generator().manual_seed(5)
    alone = [sample(logits[1:2], [p], [alone_gen])[0] for _ in range(30)]
    batch_gen = torch.Generator().manual_seed(5)
    other = torch.Generator().manual_seed(99)
    batched = [sample(logits, [p, p, p], [other, batch_gen, None])[1] for _ in range(30)]
    assert alone == batched


def test_sampling_follows_distribution():
    # Two tokens with probabilities 0.8 / 0.2: empirical frequency over 4000 draws within ~5 sigma.
    logits = torch.full((VOCAB,), -float("inf"))
    logits[3], logits[17] = math.log(0.8), math.log(0.2)
    drawn = draw(logits, SamplingParams(temperature=1.0), 4000, seed=4)
    assert set(drawn) == {3, 17}
    freq = drawn.count(3) / len(drawn)
    assert abs(freq - 0.8) < 5 * math.sqrt(0.8 * 0.2 / 4000)


# ----------------------------------------------------------------------------- SamplingParams


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": [3]}, "stop"),
    ],
)
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**kwargs)


def test_sampling_params_accepts_valid_values():
    p = SamplingParams(max_tokens=1, temperature=0.0, top_k=0, top_p=1.0, stop="x")
    assert p.stop == ["x"]
    assert p.greedy
    p = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=7, stop=["a", "bc"])
    assert p.stop == ["a", "bc"] and not p.greedy
    assert SamplingParams().stop == [] and SamplingParams().stop is not SamplingParams().stop
