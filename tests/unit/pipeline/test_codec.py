import numpy as np
import pyarrow as pa
import pytest

from pipeline.format.codec import Codec, CodecError, from_planes, to_planes


def activation_like(rng, t, w) -> np.ndarray:
    """bf16 bits of values whose scale varies per channel, as hidden states do (a few outlier channels)."""
    scale = np.exp(rng.normal(0, 1, w)).astype(np.float32)
    scale[rng.choice(w, max(1, w // 100), replace=False)] *= 50
    x = (rng.standard_normal((t, w)).astype(np.float32) * scale).view(np.uint32)
    return ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even


def readme_decode(value: bytes, T: int, W: int, encoding: str) -> np.ndarray:
    """The decoder README.md gives, for readers without this project (kept identical to it)."""
    lo = np.frombuffer(value, np.uint8, W * T)
    hi = value[W * T :] if encoding == "raw" else pa.Codec("zstd").decompress(value[W * T :], W * T)
    hi = np.frombuffer(hi, np.uint8)
    return (hi.astype(np.uint16) << 8 | lo).reshape(W, T).T  # [T, W] bf16 bits


def test_planes_round_trip_and_layout():
    bits = np.array([[0x1234, 0xABCD, 0x00FF]], dtype=np.uint16)
    planes = to_planes(bits)
    assert planes.shape == (2, 3, 1)
    assert planes[0, :, 0].tolist() == [0x34, 0xCD, 0xFF] and planes[1, :, 0].tolist() == [0x12, 0xAB, 0x00]
    np.testing.assert_array_equal(from_planes(planes), bits)


@pytest.mark.parametrize("encoding", ["planes_zstd", "raw"])
@pytest.mark.parametrize("t,w", [(1, 1), (7, 48), (300, 2304)])
def test_encode_decode_is_bit_exact(encoding, t, w):
    rng = np.random.default_rng(t * w)
    bits = rng.integers(0, 1 << 16, size=(t, w), dtype=np.uint16)  # every pattern: NaN, inf, subnormal
    codec = Codec(encoding)
    value = codec.encode(to_planes(bits)).tobytes()
    np.testing.assert_array_equal(codec.decode_bits(value, t, w), bits)
    np.testing.assert_array_equal(readme_decode(value, t, w, encoding), bits)
    if encoding == "raw":
        assert len(value) == bits.nbytes


def test_high_plane_is_one_standard_zstd_frame():
    """Any zstd decoder reads it: the python-zstandard package too, from the frame's own content size."""
    zstandard = pytest.importorskip("zstandard")
    rng = np.random.default_rng(1)
    t, w = 64, 96
    planes = to_planes(activation_like(rng, t, w))
    value = Codec("planes_zstd").encode(planes).tobytes()
    hi = zstandard.ZstdDecompressor().decompress(value[t * w :])
    assert hi == planes[1].tobytes()


def test_activation_like_values_compress_to_about_seventy_percent():
    rng = np.random.default_rng(2)
    bits = activation_like(rng, 512, 2304)
    ratio = Codec("planes_zstd").encode(to_planes(bits)).nbytes / bits.nbytes
    assert 0.55 < ratio < 0.75, ratio  # the low plane (0.5) is stored, the high plane shrinks


@pytest.mark.parametrize("encoding", ["planes_zstd", "raw"])
def test_damaged_values_raise(encoding):
    bits = np.random.default_rng(3).integers(0, 1 << 16, size=(40, 64), dtype=np.uint16)
    codec = Codec(encoding)
    value = codec.encode(to_planes(bits)).tobytes()
    with pytest.raises(CodecError):
        codec.decode(value[:-3], 40, 64)
    with pytest.raises(CodecError):
        codec.decode(value, 41, 64)  # the wrong number of tokens


def test_unknown_encoding_is_refused():
    with pytest.raises(ValueError, match="unknown hidden-state encoding"):
        Codec("bss_zstd")


@pytest.mark.parametrize("encoding", ["planes_zstd", "raw"])
def test_no_tokens_encodes_and_decodes(encoding):
    """A masked final state with no trained token stores [0, H]."""
    codec = Codec(encoding)
    value = codec.encode(to_planes(np.zeros((0, 8), np.uint16))).tobytes()
    assert codec.decode_bits(value, 0, 8).shape == (0, 8)


@pytest.mark.parametrize("encoding", ["planes_zstd", "raw"])
def test_check_accepts_what_decodes_and_refuses_what_does_not(encoding):
    """verify's fast path (decompress only) agrees with a full decode."""
    bits = np.random.default_rng(4).integers(0, 1 << 16, size=(40, 64), dtype=np.uint16)
    codec = Codec(encoding)
    value = codec.encode(to_planes(bits)).tobytes()
    codec.check(value, 40, 64)
    for bad, t, w in ((value[:-3], 40, 64), (value, 41, 64), (value, 40, 63), (value + b"\0", 40, 64)):
        with pytest.raises(CodecError):
            codec.decode(bad, t, w)
        with pytest.raises(CodecError):
            codec.check(bad, t, w)
    empty = codec.encode(to_planes(np.zeros((0, 8), np.uint16))).tobytes()
    codec.check(empty, 0, 8)
