"""The training tasks: corpora, batches, data shards, models, the T5 span corruption."""

import math

import pytest
import torch

from flexdemo import DeMo
from flexdemo.app.tasks import (
    GPT,
    ShardSampler,
    data_generator,
    evaluate,
    get_batch,
    gpt_config,
    load_corpus,
)


def test_corpus_is_deterministic_and_split():
    train, val = load_corpus(max_bytes=200_000)
    train2, val2 = load_corpus(max_bytes=200_000)
    assert train.numel() == 200_000 and val.numel() == 20_000
    assert torch.equal(train, train2) and torch.equal(val, val2)
    assert b"def " in bytes(train[:50_000].tolist())


def test_batches_differ_per_rank_and_shift_by_one():
    train, _ = load_corpus(max_bytes=100_000)
    x0, y0 = get_batch(train, 4, 32, data_generator(0, rank=0))
    x1, _ = get_batch(train, 4, 32, data_generator(0, rank=1))
    assert x0.shape == (4, 32) and x0.dtype == torch.int64
    assert torch.equal(x0[:, 1:], y0[:, :-1]) and not torch.equal(x0, x1)


def test_tiny_gpt_learns_with_demo():
    torch.manual_seed(0)
    train, val = load_corpus(max_bytes=200_000)
    model = GPT(gpt_config("tiny"))
    first = evaluate(model, val, batches=2)
    assert abs(first - math.log(256)) < 0.5
    opt = DeMo(model.parameters(), lr=3e-3)
    gen = data_generator(0, rank=0)
    for _ in range(40):
        x, y = get_batch(train, 8, model.cfg.seq_len, gen)
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    assert evaluate(model, val, batches=2) < first - 0.5


def test_shard_sampler_gives_disjoint_shards_and_resumes():
    samplers = [ShardSampler(103, rank, 4, seed=1) for rank in range(4)]
    seen = [torch.cat([s.next(5) for _ in range(5)]) for s in samplers]
    assert all(len(set(x.tolist())) == 25 for x in seen)  # one epoch: no repeats
    assert not set(seen[0].tolist()) & set(seen[1].tolist())
    assert all(int(i) % 4 == r for r, x in enumerate(seen) for i in x)
    a = ShardSampler(103, 1, 4, seed=1)
    first = [a.next(5) for _ in range(7)]  # crosses into the second epoch
    state = a.state_dict()
    rest = [a.next(5) for _ in range(3)]
    b = ShardSampler(103, 1, 4, seed=1)
    b.load_state_dict(state)
    assert state["epoch"] == 1 and all(torch.equal(x, y) for x, y in
                                       zip(rest, [b.next(5) for _ in range(3)]))
    assert torch.equal(first[0], seen[1][:5])
    with pytest.raises(ValueError, match="exceeds this rank's"):
        ShardSampler(10, 0, 4).next(5)


def test_shard_sampler_streams_order_the_same_items_apart():
    """Elastic replica groups are numbered alike (rank 0 of 1): each stream draws its own
    order of the same items; stream 0 is the plain sampler."""
    plain, zero = ShardSampler(50, 0, 1, seed=3), ShardSampler(50, 0, 1, seed=3, stream=0)
    a, b = ShardSampler(50, 0, 1, seed=3, stream=11), ShardSampler(50, 0, 1, seed=3, stream=12)
    assert torch.equal(plain.next(50), zero.next(50))
    xa, xb = a.next(50), b.next(50)
    assert not torch.equal(xa, xb) and sorted(xa.tolist()) == sorted(xb.tolist())


def test_t5_span_corruption_examples():
    from flexdemo.app.tasks.t5 import EOS, SENTINEL0, corrupt, noise_mask, span_counts

    gen = torch.Generator().manual_seed(3)
    mask = noise_mask(100, 0.15, 3.0, gen)
    noise, spans = span_counts(100, 0.15, 3.0)
    assert int(mask.sum()) == noise and not mask[0]
    tokens = torch.arange(10, 110)
    x, y = corrupt(tokens, mask)
    assert len(x) == 100 - noise + spans + 1 and len(y) == noise + spans + 1
    assert x[-1] == EOS and y[-1] == EOS and y[0] == SENTINEL0
    # putting the targets back where the sentinels are restores the text
    fill, restored = {}, []
    for t in y[:-1].tolist():
        if t >= SENTINEL0:
            key = t
            fill[key] = []
        else:
            fill[key].append(t)
    for t in x[:-1].tolist():
        restored += fill[t] if t >= SENTINEL0 else [t]
    assert restored == tokens.tolist()


def test_missing_transformers_is_a_clear_error(monkeypatch):
    import flexdemo.app.tasks.t5 as t5

    monkeypatch.setattr(t5, "have_transformers", lambda: False)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'flexdemo\[t5\]'"):
        t5.T5Task()
