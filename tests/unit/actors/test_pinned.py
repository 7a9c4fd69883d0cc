"""PinnedSlabs lends each slab to one batch at a time and takes it back when the batch's last view is gone."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from actors.hf.pinned import PinnedSlabs


def _pageable(nbytes: int):
    # Pinned memory needs a GPU; the lending is the same over ordinary memory.
    return torch.zeros(nbytes, dtype=torch.uint8)


def test_a_slab_is_lent_once_and_comes_back_with_its_last_view():
    slabs = PinnedSlabs(64, limit=1, alloc=_pageable).reserve(1)
    tensor, array = slabs.take(40)
    assert array.shape == (40,) and tensor.numel() == 40
    tensor.fill_(7)  # the copy writes through the tensor, the captures read through the array
    assert (array == 7).all()
    body = array[8:24]
    counts = array[32:40].view(np.int32)
    del tensor, array
    gc.collect()
    assert slabs.take(8) is None and slabs.misses == 1  # views still alive: the slab is still lent
    del body
    gc.collect()
    assert slabs.take(8) is None  # the counts' view holds it too
    del counts
    gc.collect()
    again = slabs.take(64)
    assert again is not None and slabs.allocated == 1


def test_slabs_grow_to_the_limit_then_miss():
    made = []

    def alloc(n):
        made.append(n)
        return _pageable(n)

    slabs = PinnedSlabs(32, limit=2, alloc=alloc)
    first, second = slabs.take(32), slabs.take(16)
    assert first is not None and second is not None and made == [32, 32]
    assert slabs.take(1) is None and slabs.misses == 1 and len(made) == 2
    del first
    gc.collect()
    assert slabs.take(32) is not None and len(made) == 2  # reused, not allocated


def test_a_request_larger_than_a_slab_misses():
    slabs = PinnedSlabs(16, limit=4, alloc=_pageable)
    assert slabs.take(17) is None and slabs.misses == 1 and slabs.allocated == 0


def test_reserve_allocates_up_to_the_limit_only():
    slabs = PinnedSlabs(8, limit=2, alloc=_pageable).reserve(5)
    assert slabs.allocated == 2


@pytest.mark.parametrize("bad", [(0, 1), (8, 0)])
def test_sizes_must_be_positive(bad):
    with pytest.raises(ValueError):
        PinnedSlabs(*bad, alloc=_pageable)
