"""A tiny labkit GPT and its training loop, shared by the optimizer-placement tests (offload, step in backward).

Importable from the tests in this folder (pytest puts a test's folder on sys.path: there is no __init__.py).
"""

import torch

from labkit.run import train_step
from labkit.models.gpt import GPTConfig

CFG = GPTConfig(n_layer=2, n_embd=64, n_head=2, vocab_size=64, block_size=32)


def batches(n, seed=1):
    """n batches of 2 random sequences of 17 tokens (inputs and targets overlap by 16)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (2, 17), generator=g) for _ in range(n)]


def train(model, opt, data):
    for x in data:
        train_step(model, opt, x[:, :-1], x[:, 1:])


def same(a, b):
    """Every parameter of a and b bit-identical."""
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
