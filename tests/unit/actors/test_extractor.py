import random

import pytest

from actors.extractor import _split_exact
from pipeline.shards import ids_digest as batch_digest
from pipeline.shards import shard_name


@pytest.mark.parametrize(
    "total, weights, expected",
    [
        (10_000, [100, 300, 600], [1000, 3000, 6000]),
        (1000, [1, 1, 1], [334, 333, 333]),
        (7, [5], [7]),
        (0, [3, 4], [0, 0]),
        (5, [0, 0], [5, 0]),
        (123, [], []),
    ],
)
def test_split_exact_examples(total, weights, expected):
    assert _split_exact(total, weights) == expected


@pytest.mark.parametrize("seed", range(20))
def test_split_exact_sums_exactly_and_is_proportional(seed):
    rng = random.Random(seed)
    weights = [rng.randint(1, 5000) for _ in range(rng.randint(1, 64))]
    total = rng.randint(0, 10**9)
    shares = _split_exact(total, weights)
    assert sum(shares) == total
    assert all(s >= 0 for s in shares)
    for s, w in zip(shares, weights):
        # Off from the exact proportion by less than one byte per sample (the remainder goes to one share).
        assert abs(s - total * w / sum(weights)) < len(weights)


def test_batch_digest_is_order_independent_and_content_sensitive():
    d = batch_digest(["b", "a", "c"])
    assert d == batch_digest(["c", "b", "a"])
    assert len(d) == 20 and int(d, 16) >= 0
    assert d != batch_digest(["a", "b"])
    assert d != batch_digest(["a", "b", "c", "c2"])
    # Error files and shards of the same batch share the digest scheme.
    assert shard_name(["a", "b", "c"]) == f"shards/part-{d}.parquet"
