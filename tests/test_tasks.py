import math

import torch

from flexdemo import DeMo
from flexdemo.app.tasks import GPT, data_generator, evaluate, get_batch, gpt_config, load_corpus


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
