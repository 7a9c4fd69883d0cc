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


# --- fp8 ---------------------------------------------------------------------------------------------------


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    import torch

    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).bfloat16().view(torch.int16).numpy().view(np.uint16)


def test_fp8_quantization_matches_torchs_cast_and_dequantization_torchs_product():
    """The numpy reference (what readers and tests use) gives torch's bytes, and dequantizes to torch's bf16."""
    import torch

    from pipeline.format.codec import dequantize, quantize

    rng = np.random.default_rng(7)
    t, h, k = 50, 32, 3
    x = rng.standard_normal((t, k * h)).astype(np.float32) * np.repeat([0.003, 1.0, 800.0], h)
    x[5, 3] = 1e4  # one massive activation in a block
    x[6, h : 2 * h] = 0  # an all-zero block
    bits = _bf16_bits(x)
    blocks = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().view(t, k, h)
    amax = blocks.abs().amax(-1)
    scale = (amax / 448).bfloat16().float()
    scale = torch.where(
        scale < amax / 448, (amax / 448).bfloat16().view(torch.int16).add(1).view(torch.bfloat16).float(), scale
    )
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    fit = amax[amax > 0] / scale[amax > 0]
    assert bool(((fit <= 448) & (fit > 448 / (1 + 2**-7))).all())  # within 448, one bf16 step from it
    q = (blocks / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    want = np.concatenate(
        [
            scale.t().contiguous().numpy().view(np.uint8).ravel(),
            q.view(torch.uint8).view(t, k * h).t().contiguous().numpy().ravel(),
        ]
    )
    body = quantize(bits, h)
    np.testing.assert_array_equal(body, want)
    back = (q.float() * scale[..., None]).view(t, k * h).bfloat16().view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(dequantize(body, t, k * h, h), back)


def test_fp8_round_trip_keeps_every_tokens_direction_and_norm_per_layer():
    from pipeline.format.codec import bits_to_float

    rng = np.random.default_rng(8)
    t, h, k = 64, 64, 4
    x = rng.standard_normal((t, k * h)).astype(np.float32) * np.repeat([0.01, 1.0, 30.0, 2000.0], h)
    bits = _bf16_bits(x)
    codec = Codec("fp8", block=h)
    value = codec.encode(codec.body_from_bits(bits))
    y = bits_to_float(codec.decode_bits(value.tobytes(), t, k * h)).reshape(t, k, h)
    ref = bits_to_float(bits).reshape(t, k, h)
    cos = (y * ref).sum(-1) / (np.linalg.norm(y, axis=-1) * np.linalg.norm(ref, axis=-1))
    assert cos.min() > 0.999  # each layer scaled apart: the small layer keeps its precision
    rel = np.abs(np.linalg.norm(y, axis=-1) / np.linalg.norm(ref, axis=-1) - 1)
    assert rel.max() < 0.02  # 64 channels a block here; the real measurement: bench/results/fp8_default_model.json
    assert value.size < 0.55 * 2 * t * k * h  # ~half of bf16, whatever zstd adds


def test_fp8_values_are_head_then_one_zstd_frame_and_damage_is_refused():
    rng = np.random.default_rng(9)
    t, h = 20, 8
    codec = Codec("fp8", block=h)
    value = codec.encode(codec.body_from_bits(_bf16_bits(rng.standard_normal((t, 2 * h)))))
    head, tail = codec.split(t, 2 * h)
    assert (head, tail) == (0, 4 * 2 * t + 2 * h * t)  # one frame: scales, then values
    body = pa.Codec("zstd").decompress(value.tobytes(), decompressed_size=tail)  # any zstd decoder
    scales = np.frombuffer(body, np.float32, 2 * t)
    assert (scales.view(np.uint32) & 0xFFFF == 0).all()  # bf16 values: their low two bytes are zero
    codec.check(value.tobytes(), t, 2 * h)
    with pytest.raises(CodecError):
        codec.check(value.tobytes()[:-3], t, 2 * h)
    with pytest.raises(CodecError):
        codec.check(value.tobytes(), t + 1, 2 * h)
    with pytest.raises(ValueError, match="hidden size"):
        Codec("fp8")


def test_fp8_keeps_only_the_masked_tokens_of_each_part():
    rng = np.random.default_rng(10)
    t, h = 9, 4
    bits = _bf16_bits(rng.standard_normal((t, h)) * 3)
    keep = np.array([0, 1, 1, 0, 0, 1, 0, 1, 1], bool)
    codec = Codec("fp8", block=h)
    got = codec.select_tokens(codec.body_from_bits(bits), t, h, keep)
    np.testing.assert_array_equal(got, codec.body_from_bits(bits[keep]))
    planes = Codec("planes_zstd")
    np.testing.assert_array_equal(
        planes.select_tokens(planes.body_from_bits(bits), t, h, keep), planes.body_from_bits(bits[keep]).reshape(-1)
    )


def test_the_readmes_fp8_decoder_gives_the_readers_bf16():
    """The few lines README.md gives for an fp8 value, without this project, against the codec's reader."""
    import torch

    rng = np.random.default_rng(12)
    T, H, B = 33, 16, 3
    W = B * H
    codec = Codec("fp8", block=H)
    bits = _bf16_bits(rng.standard_normal((T, W)) * np.repeat([0.02, 3.0, 90.0], H))
    value = codec.encode(codec.body_from_bits(bits)).tobytes()
    body = pa.Codec("zstd").decompress(value, 4 * B * T + W * T)
    s = np.frombuffer(body, np.float32, B * T).reshape(B, T)
    q = np.frombuffer(body, np.uint8, W * T, offset=4 * B * T).reshape(W, T)
    x = torch.from_numpy(q.T.copy()).view(torch.float8_e4m3fn).float().view(T, B, H)
    states = (x * torch.from_numpy(s.T.copy())[..., None]).view(T, W).bfloat16()
    np.testing.assert_array_equal(states.view(torch.int16).numpy().view(np.uint16), codec.decode_bits(value, T, W))
