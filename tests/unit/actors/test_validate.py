import hashlib

import numpy as np
import pytest

from actors.dump import read_dump
from actors.validate import check_capture, ids_sha256

IDS = [11, 12, 13, 14]
HIDDEN = 4
AUX_WIDTH = 3 * HIDDEN


def finite(rows, cols, seed=0) -> np.ndarray:
    # Exponent field below all-ones: every value is a finite bf16.
    return np.random.default_rng(seed).integers(0, 0x7F00, size=(rows, cols), dtype=np.uint16)


@pytest.fixture
def capture(make_dump):
    def build(ids=IDS, aux=None, last=None, **header):
        aux = finite(len(ids), AUX_WIDTH, 1) if aux is None else aux
        last = finite(len(ids), HIDDEN, 2) if last is None else last
        return read_dump(make_dump("hh-x", ids, aux, last, **header))

    return build


def test_correct_capture_passes(capture):
    assert check_capture(capture(), IDS, AUX_WIDTH, HIDDEN) is None


def test_ids_sha256_matches_the_hooks_hash():
    assert ids_sha256(IDS) == hashlib.sha256(np.asarray(IDS, dtype=np.int32).tobytes()).hexdigest()
    assert ids_sha256([1, 2]) != ids_sha256([2, 1])


def test_token_count_mismatch(capture):
    reason = check_capture(capture(), IDS + [15], AUX_WIDTH, HIDDEN)
    assert reason == "token count mismatch: sent 5 tokens, server captured 4"


def test_hash_mismatch_same_length(capture):
    reason = check_capture(capture(), [11, 12, 13, 99], AUX_WIDTH, HIDDEN)
    assert reason == "input ids seen by the server differ from those sent (hash mismatch)"


def test_wrong_aux_width(capture):
    cap = capture(aux=finite(len(IDS), AUX_WIDTH - HIDDEN))
    reason = check_capture(cap, IDS, AUX_WIDTH, HIDDEN)
    assert reason == f"aux_hidden_states shape (4, {AUX_WIDTH - HIDDEN}) != expected (4, {AUX_WIDTH})"


def test_wrong_last_shape(capture):
    cap = capture(last=finite(len(IDS), HIDDEN + 1))
    reason = check_capture(cap, IDS, AUX_WIDTH, HIDDEN)
    assert reason == "last_hidden_state shape (4, 5) != expected (4, 4)"


@pytest.mark.parametrize("pattern", [0x7FC0, 0x7F80, 0xFF80, 0xFFC1])
@pytest.mark.parametrize("block", ["aux", "last"])
def test_nonfinite_values_counted_by_the_hook(capture, pattern, block):
    arr = finite(len(IDS), AUX_WIDTH if block == "aux" else HIDDEN)
    arr[2, 1] = pattern
    arr[3, 0] = pattern
    reason = check_capture(capture(**{block: arr}), IDS, AUX_WIDTH, HIDDEN)
    assert reason == "2 non-finite hidden-state values"


def test_largest_finite_bf16_is_not_flagged(capture):
    # 0x7F7F / 0xFF7F are +/- the largest finite bf16; 0x0001 a subnormal.
    arr = finite(len(IDS), HIDDEN)
    arr[0, :] = [0x7F7F, 0xFF7F, 0x0001, 0x8000]
    assert check_capture(capture(last=arr), IDS, AUX_WIDTH, HIDDEN) is None


def test_a_dump_whose_header_lacks_a_key_is_refused_when_read(make_dump):
    """A hook older than this client (no non-finite count) never reaches validation as a capture."""
    import json
    import struct

    from actors.dump import DumpError

    path = make_dump("hh-x", IDS, finite(len(IDS), AUX_WIDTH, 1), finite(len(IDS), HIDDEN, 2))
    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    header = json.loads(data[8 : 8 + n])
    del header["nonfinite"]
    head = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + data[8 + n :])
    with pytest.raises(DumpError, match=r"lacks \['nonfinite'\]"):
        read_dump(path)


def test_prefix_reuse_is_rejected_first(capture):
    reason = check_capture(capture(prefix_len=3), IDS, AUX_WIDTH, HIDDEN)
    assert reason == "server reused 3 cached prefix tokens; the capture would be truncated"


def test_a_capture_of_another_final_layer_convention_is_refused(capture):
    """The output stores one convention; a capture labelled with the other is never stored under its name."""
    post = capture()  # the publisher's default label
    assert post.header.final_layer == "post_norm"
    assert check_capture(post, IDS, AUX_WIDTH, HIDDEN, "post_norm") is None
    assert check_capture(post, IDS, AUX_WIDTH, HIDDEN, "pre_norm") == (
        "the capture's final layer is post_norm, the output stores pre_norm"
    )
    pre = capture(final_layer="pre_norm")
    assert check_capture(pre, IDS, AUX_WIDTH, HIDDEN, "pre_norm") is None
    assert "stores post_norm" in check_capture(pre, IDS, AUX_WIDTH, HIDDEN, "post_norm")
