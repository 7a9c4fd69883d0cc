import os

import numpy as np
import pytest
import torch
from conftest import bf16

from actors.dump import DumpError, dump_path, read_dump
from actors.validate import check_capture
from pipeline.format.codec import to_planes


def bits(rng, rows, cols) -> np.ndarray:
    return rng.integers(0, 0x7F00, size=(rows, cols), dtype=np.uint16)


def test_read_dump_round_trip(make_dump, tmp_path):
    rng = np.random.default_rng(0)
    aux, last = bits(rng, 5, 12), bits(rng, 5, 4)
    path = make_dump("hh-1", [1, 2, 3, 4, 5], aux, last)
    assert path == dump_path(tmp_path, "hh-1")
    assert os.listdir(tmp_path) == ["hh-1.hhd"]  # the writer's temporary was renamed away
    cap = read_dump(path)
    assert cap.header.rid == "hh-1" and cap.header.num_tokens == 5 and cap.header.nonfinite == 0
    assert cap.aux.shape == (2, 12, 5) and cap.last.shape == (2, 4, 5)
    np.testing.assert_array_equal(cap.aux, to_planes(aux))  # the codec's layout, made by the hook
    got_aux, got_last = cap.bits()
    np.testing.assert_array_equal(got_aux, aux)
    np.testing.assert_array_equal(got_last, last)


@pytest.fixture
def dump_bytes(make_dump):
    rng = np.random.default_rng(1)
    return make_dump("hh-t", [7, 8, 9], bits(rng, 3, 6), bits(rng, 3, 2)).read_bytes()


def write(tmp_path, data: bytes):
    path = tmp_path / "cut.hhd"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("cut", [1, 2, 3 * 2 * 2])
def test_truncated_body_is_dump_error(tmp_path, dump_bytes, cut):
    with pytest.raises(DumpError, match="holds .* bytes, header says 48"):
        read_dump(write(tmp_path, dump_bytes[:-cut]))


def test_extra_body_is_dump_error(tmp_path, dump_bytes):
    with pytest.raises(DumpError):
        read_dump(write(tmp_path, dump_bytes + b"\0\0"))


def test_shorter_than_length_prefix_is_dump_error(tmp_path, dump_bytes):
    with pytest.raises(DumpError, match="truncated"):
        read_dump(write(tmp_path, dump_bytes[:5]))


def test_truncated_header_is_dump_error(tmp_path, dump_bytes):
    with pytest.raises(DumpError):
        read_dump(write(tmp_path, dump_bytes[:20]))


def test_hook_slices_packed_rows_per_request(publish, tmp_path):
    """A packed extend batch: one dump per hh- request, rows cut by extend_seq_lens_cpu, padding ignored."""
    torch.manual_seed(0)
    seq_lens = [3, 2, 4]
    total = sum(seq_lens)
    input_ids = torch.arange(100, 100 + total + 2)  # 2 padding rows, as CUDA graphs may add
    hidden = torch.randn(total + 2, 4, dtype=torch.bfloat16)
    aux = [torch.randn(total + 2, 4, dtype=torch.bfloat16) for _ in range(3)]
    publish(["hh-a", "other-b", "hh-c"], input_ids, hidden, aux, seq_lens, [0, 0, 0])
    assert sorted(os.listdir(tmp_path)) == ["hh-a.hhd", "hh-c.hhd"]

    as_bits = lambda t: t.view(torch.int16).numpy().view(np.uint16)  # noqa: E731
    packed = torch.cat(aux, dim=-1)
    for rid, start, n in (("hh-a", 0, 3), ("hh-c", 5, 4)):
        cap = read_dump(dump_path(tmp_path, rid))
        ids = input_ids[start : start + n].tolist()
        assert cap.header.num_tokens == n and cap.header.prefix_len == 0
        got_aux, got_last = cap.bits()
        np.testing.assert_array_equal(got_aux, as_bits(packed[start : start + n]))
        np.testing.assert_array_equal(got_last, as_bits(hidden[start : start + n]))
        assert check_capture(cap, ids, aux_width=12, hidden_size=4) is None


def test_hook_accepts_one_packed_aux_tensor_and_float32(publish, tmp_path):
    hidden = torch.randn(3, 4)
    aux = torch.randn(3, 8)
    publish(["hh-p"], torch.arange(3), hidden, aux, [3])
    cap = read_dump(dump_path(tmp_path, "hh-p"))
    got_aux, got_last = cap.bits()
    np.testing.assert_array_equal(got_aux, aux.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    assert cap.header.source_dtype == "torch.float32"


def test_hook_counts_nonfinite_values_per_request(publish, tmp_path):
    hidden = bf16(np.full((5, 4), 0x3F80, np.uint16))  # 1.0
    aux = [bf16(np.full((5, 4), 0x3F80, np.uint16))]
    hidden[1, 2] = float("nan")
    aux[0][3, 0] = float("inf")
    aux[0][4, 1] = float("-inf")
    publish(["hh-x", "hh-y"], torch.arange(5), hidden, aux, [2, 3])
    assert read_dump(dump_path(tmp_path, "hh-x")).header.nonfinite == 1
    assert read_dump(dump_path(tmp_path, "hh-y")).header.nonfinite == 2


def test_hook_ignores_batches_without_prefixed_rids(publish, tmp_path):
    t = torch.zeros(2, 4, dtype=torch.bfloat16)
    publish(["warmup"], torch.arange(2), t, [t], [2], None)
    assert os.listdir(tmp_path) == []


def test_prefill_chunks_are_assembled_per_request(publish, tmp_path):
    """A 7-token prompt prefilled as chunks 0..3 and 3..7, each batched with other work, dumps as one whole."""
    torch.manual_seed(1)
    ids = torch.arange(500, 507)
    hidden = torch.randn(7, 4, dtype=torch.bfloat16)
    aux = [torch.randn(7, 4, dtype=torch.bfloat16) for _ in range(2)]
    other = torch.randn(2, 4, dtype=torch.bfloat16)
    rid, whole = "hh-x-1.t7", "hh-x-2.t2"
    # chunk 1 of rid beside a whole short request; chunk 2 alone
    publish(
        [rid, whole],
        torch.cat([ids[:3], ids[:2]]),
        torch.cat([hidden[:3], other]),
        [torch.cat([a[:3], other]) for a in aux],
        [3, 2],
        [0, 0],
    )
    assert sorted(os.listdir(tmp_path)) == [f"{whole}.hhd"]  # the long one is not published half done
    publish([rid], ids[3:], hidden[3:], [a[3:] for a in aux], [4], [3])
    cap = read_dump(dump_path(tmp_path, rid))
    assert cap.header.num_tokens == 7 and cap.header.prefix_len == 0
    assert check_capture(cap, ids.tolist(), aux_width=8, hidden_size=4) is None
    got_aux, got_last = cap.bits()
    as_bits = lambda t: t.view(torch.int16).numpy().view(np.uint16)  # noqa: E731
    np.testing.assert_array_equal(got_aux, as_bits(torch.cat(aux, dim=-1)))
    np.testing.assert_array_equal(got_last, as_bits(hidden))


def test_a_chunk_out_of_order_gives_an_error_dump(publish, tmp_path):
    t = torch.zeros(4, 4, dtype=torch.bfloat16)
    publish(["hh-y-1.t8"], torch.arange(4), t, [t], [4], [0])
    publish(["hh-y-1.t8"], torch.arange(4), t, [t], [4], [5])  # rows 5..9: a gap and past the end
    cap = read_dump(dump_path(tmp_path, "hh-y-1.t8"))
    reason = check_capture(cap, list(range(8)), aux_width=4, hidden_size=4)
    assert reason.startswith("capture failed in the server: prefill chunk out of order")


@pytest.mark.parametrize("encoding", ["planes_zstd", "raw"])
def test_encoding_straight_from_the_file_equals_encoding_the_planes(make_dump, encoding):
    from pipeline.format.codec import Codec

    rng = np.random.default_rng(5)
    aux, last = bits(rng, 300, 48), bits(rng, 300, 16)
    codec = Codec(encoding)
    direct = read_dump(make_dump("hh-d", list(range(300)), aux, last)).encode(codec)
    via_planes = (codec.encode(to_planes(aux)), codec.encode(to_planes(last)))
    for got, want, b in zip(direct, via_planes, (aux, last)):
        assert got.tobytes() == want.tobytes()
        np.testing.assert_array_equal(codec.decode_bits(got.tobytes(), 300, b.shape[1]), b)


def _raw_header(path) -> dict:
    import json
    import struct

    data = path.read_bytes()
    (n,) = struct.unpack_from("<Q", data)
    return json.loads(data[8 : 8 + n])


def test_the_hook_writes_exactly_the_keys_the_client_reads(make_dump):
    """The publisher runs inside SGLang and imports nothing of the project, so it spells the header's keys
    out itself: they must be CaptureHeader's fields (all of them but the optional error)."""
    from dataclasses import fields

    from actors.dump import CaptureHeader

    rng = np.random.default_rng(3)
    path = make_dump("hh-k", [1, 2, 3], bits(rng, 3, 12), bits(rng, 3, 4))
    written = set(_raw_header(path))
    assert written == {f.name for f in fields(CaptureHeader)} - {"error"}
    assert read_dump(path).header.to_dict() == {**_raw_header(path), "error": None}


def test_a_header_with_a_key_the_client_does_not_know_is_refused(make_dump):
    rng = np.random.default_rng(4)
    path = make_dump("hh-u", [1, 2], bits(rng, 2, 12), bits(rng, 2, 4), surprise=1)
    with pytest.raises(DumpError, match=r"keys this client does not know: \['surprise'\]"):
        read_dump(path)


# --- fp8: the hook quantizes in the server; the dump carries the codec's fp8 body -----------------------------


@pytest.fixture
def publish_fp8(hook_modules, tmp_path):
    publisher = hook_modules.publisher.DumpPublisher(str(tmp_path), "hh-", layout="fp8")

    def run(rids, input_ids, hidden, aux, seq_lens, prefix_lens=None):
        publisher.capture(input_ids, hidden, aux, rids, seq_lens, prefix_lens)
        publisher.flush()

    return run


def _fp8_body(x: torch.Tensor, block: int) -> np.ndarray:
    """The codec's fp8 body of x [T, W], from the numpy reference (pipeline/format/codec.quantize)."""
    from pipeline.format.codec import quantize

    return quantize(x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16), block)


def test_the_hooks_fp8_dump_is_the_codecs_quantization_of_each_request(publish_fp8, tmp_path):
    torch.manual_seed(3)
    seq_lens = [3, 5]
    hidden = torch.randn(9, 4, dtype=torch.bfloat16) * 40  # a padding row after the requests
    aux = [torch.randn(9, 4, dtype=torch.bfloat16) * s for s in (0.01, 1.0, 300.0)]  # ranges far apart
    aux[1][4] = 0  # an all-zero block: scale 1, values 0
    publish_fp8(["hh-a", "hh-b"], torch.arange(9), hidden, aux, seq_lens, [0, 0])
    packed = torch.cat(aux, dim=-1)
    for rid, start, n in (("hh-a", 0, 3), ("hh-b", 3, 5)):
        cap = read_dump(dump_path(tmp_path, rid))
        assert cap.header.layout == "fp8" and cap.header.aux_shape == (n, 12)
        rows = slice(start, start + n)
        np.testing.assert_array_equal(cap.aux, _fp8_body(packed[rows], 4))
        np.testing.assert_array_equal(cap.last, _fp8_body(hidden[rows], 4))
        assert check_capture(cap, list(range(start, start + n)), 12, 4, layout="fp8") is None
        assert check_capture(cap, list(range(start, start + n)), 12, 4, layout="planes").startswith(
            "the capture's layout"
        )


def test_fp8_prefill_chunks_are_assembled_like_a_whole_request(publish_fp8, tmp_path):
    torch.manual_seed(4)
    ids = torch.arange(7)
    hidden = torch.randn(7, 4, dtype=torch.bfloat16)
    aux = [torch.randn(7, 4, dtype=torch.bfloat16) * 10 for _ in range(2)]
    publish_fp8(["hh-z-1.t7"], ids[:3], hidden[:3], [a[:3] for a in aux], [3], [0])
    publish_fp8(["hh-z-1.t7"], ids[3:], hidden[3:], [a[3:] for a in aux], [4], [3])
    cap = read_dump(dump_path(tmp_path, "hh-z-1.t7"))
    assert check_capture(cap, ids.tolist(), 8, 4, layout="fp8") is None
    np.testing.assert_array_equal(cap.aux, _fp8_body(torch.cat(aux, dim=-1), 4))
    np.testing.assert_array_equal(cap.last, _fp8_body(hidden, 4))


def test_an_fp8_dump_encodes_straight_from_the_file_and_decodes_within_fp8_error(publish_fp8, tmp_path):
    from pipeline.format.codec import Codec, bits_to_float

    torch.manual_seed(5)
    hidden = torch.randn(40, 16, dtype=torch.bfloat16) * 5
    aux = [torch.randn(40, 16, dtype=torch.bfloat16) * s for s in (0.1, 50.0)]
    publish_fp8(["hh-e"], torch.arange(40), hidden, aux, [40])
    codec = Codec("fp8", block=16)
    cap = read_dump(dump_path(tmp_path, "hh-e"))
    direct = cap.encode(codec)
    via_body = (codec.encode(_fp8_body(torch.cat(aux, -1), 16)), codec.encode(_fp8_body(hidden, 16)))
    for got, want, x in zip(direct, via_body, (torch.cat(aux, -1), hidden)):
        assert got.tobytes() == want.tobytes()
        back = torch.from_numpy(bits_to_float(codec.decode_bits(got.tobytes(), 40, x.shape[1])))
        cos = torch.nn.functional.cosine_similarity(back.view(40, -1, 16), x.float().view(40, -1, 16), dim=-1)
        assert cos.min() > 0.999
    with pytest.raises(DumpError, match="holds fp8"):
        read_dump(dump_path(tmp_path, "hh-e")) if False else cap.encode(Codec("planes_zstd"))
