"""`harvest export` (pipeline/tools/export/) on real shards: each trainer's files hold what that trainer reads
(keys, dtypes, shapes, which side of the final norm), a killed export rerun completes with nothing twice,
the verify step catches a damaged file, and exports a trainer cannot use are refused with the reason."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from pipeline.format.storage import Store
from pipeline.tools.export import ExportError
from pipeline.tools.export import export as export_in
from pipeline.tools.export.run import LAYOUTS, verify_vocab
from tests_support import make_output

H = 16  # make_output's hidden size


def export(*args, **kwargs):
    """One shard at a time (one test below runs them on the thread pool)."""
    return export_in(*args, **{"workers": 1, **kwargs})


def _load_torch(path, weights_only=True):
    import torch

    return torch.load(io.BytesIO(path.read_bytes()), weights_only=weights_only)


def _bits(t):
    import torch

    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


@pytest.fixture
def source(tmp_path):
    samples, norm = make_output(tmp_path / "out")
    return tmp_path / "out", samples, norm


def test_specforge_files_hold_its_keys_post_norm_and_three_aux_layers(source, tmp_path):
    import torch

    out, samples, norm = source
    report = export(str(out), "specforge", str(tmp_path / "sf"))
    assert report.ok and report.written == report.samples == len(samples), report.text()
    record = json.loads((tmp_path / "sf" / "export.json").read_text())
    files = sorted((tmp_path / "sf").glob("*.ckpt"))
    assert len(files) == len(samples) and record["final_layer"] == "post_norm"
    for f, sid in zip(files, record["sample_ids"]):
        ids, mask, aux, last = samples[sid]
        d = _load_torch(f, weights_only=False)
        assert set(d) == {"input_ids", "loss_mask", "aux_hidden_state", "hidden_state"}
        t = len(ids)
        assert d["input_ids"].dtype == d["loss_mask"].dtype == torch.int64 and d["input_ids"].tolist() == ids
        assert d["aux_hidden_state"].dtype == torch.bfloat16 and d["aux_hidden_state"].shape == (1, t, 3 * H)
        assert d["hidden_state"].shape == (1, t, H)
        np.testing.assert_array_equal(_bits(d["aux_hidden_state"][0]), aux)
        np.testing.assert_array_equal(_bits(d["hidden_state"][0]), norm.apply_bits(last))  # after the norm


def test_speculators_files_stack_aux_then_the_pre_norm_final_layer(source, tmp_path):
    import datasets
    import torch
    from safetensors.torch import load_file

    out, samples, _ = source
    report = export(str(out), "speculators", str(tmp_path / "sp"))
    assert report.ok, report.text()
    record = json.loads((tmp_path / "sp" / "export.json").read_text())
    assert record["final_layer"] == "pre_norm"
    assert record["target_layer_ids (HF hidden_states indices of the aux layers)"] == [2, 4, 6]
    rows = datasets.load_from_disk(str(tmp_path / "sp"))  # as speculators' ArrowDataset opens it
    assert rows.format["type"] == "torch" and len(rows) == len(samples)
    assert _load_torch(tmp_path / "sp" / "token_freq.pt") == _masked_token_counts(samples)
    for i, sid in enumerate(record["sample_ids"]):
        ids, mask, aux, last = samples[sid]
        d = load_file(str(tmp_path / "sp" / "hidden_states" / f"hs_{i}.safetensors"))
        t = len(ids)
        assert d["hidden_states"].dtype == torch.bfloat16 and d["hidden_states"].shape == (t, 4, H)
        row = rows[i]
        assert row["input_ids"].dtype == row["loss_mask"].dtype == torch.int64
        assert torch.equal(d["token_ids"], row["input_ids"])  # else speculators drops the row
        assert d["token_ids"].tolist() == ids and int(row["seq_len"]) == t and row["loss_mask"].tolist() == mask
        np.testing.assert_array_equal(_bits(d["hidden_states"][:, :-1].reshape(t, -1)), aux)
        np.testing.assert_array_equal(_bits(d["hidden_states"][:, -1]), last)  # before the norm, as stored


def _masked_token_counts(samples):
    from collections import Counter

    c = Counter()
    for ids, mask, _, _ in samples.values():
        c.update(i for i, m in zip(ids, mask) if m)
    return dict(sorted(c.items()))


def test_modelopt_files_hold_its_keys(source, tmp_path):
    import torch

    out, samples, norm = source
    assert export(str(out), "modelopt", str(tmp_path / "mo")).ok
    record = json.loads((tmp_path / "mo" / "export.json").read_text())
    for f, sid in zip(sorted((tmp_path / "mo").glob("*.pt")), record["sample_ids"]):
        ids, mask, aux, last = samples[sid]
        d = _load_torch(f)  # weights_only, as Model-Optimizer loads them
        assert d["conversation_id"] == sid and d["hidden_states_prenorm"] is False
        assert d["loss_mask"].dtype == torch.int64 and d["loss_mask"].tolist() == mask
        np.testing.assert_array_equal(_bits(d["aux_hidden_states"]), aux)
        np.testing.assert_array_equal(_bits(d["hidden_states"]), norm.apply_bits(last))


def test_a_killed_export_rerun_completes_with_nothing_twice(source, tmp_path):
    out, samples, _ = source
    dest = tmp_path / "sf"
    first = export(str(out), "specforge", str(dest), workers=2)  # shards on the thread pool
    files = sorted(dest.glob("*.ckpt"))
    for f in files[::2]:  # as if killed before these were written
        f.unlink()
    (dest / ".tmp-deadbeef-000000001.ckpt").write_bytes(b"partial")  # and mid-write of one
    again = export(str(out), "specforge", str(dest))
    assert again.ok and again.written == len(files[::2]) and again.skipped == first.samples - again.written
    assert sorted(p.name for p in dest.iterdir()) == sorted([f.name for f in files] + ["export.json", "specforge.yaml"])


def test_verify_catches_a_damaged_file(source, tmp_path):
    out, _, _ = source
    dest = tmp_path / "sp"
    assert export(str(out), "speculators", str(dest)).ok
    victim = dest / "hidden_states" / "hs_1.safetensors"
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0x40  # one bit of the last token's ids
    victim.write_bytes(bytes(data))
    report = export(str(out), "speculators", str(dest))  # present files are kept, then all re-read
    assert not report.ok and any("hs_1.safetensors" in p for p in report.problems), report.text()


def test_exports_a_trainer_cannot_use_are_refused(tmp_path):
    make_output(tmp_path / "post", final="post_norm")
    with pytest.raises(
        ExportError, match="speculators trains on the final layer before the norm.*final_layer=pre_norm"
    ):
        export(str(tmp_path / "post"), "speculators", str(tmp_path / "x"))
    assert export(str(tmp_path / "post"), "specforge", str(tmp_path / "sf-post")).ok  # post-norm is what it reads
    make_output(tmp_path / "two", aux_layers=(1, 3))
    with pytest.raises(ExportError, match="exactly 3 aux layers"):
        export(str(tmp_path / "two"), "specforge", str(tmp_path / "y"))
    make_output(tmp_path / "masked", rows="masked")
    with pytest.raises(ExportError, match="trained positions only"):
        export(str(tmp_path / "masked"), "modelopt", str(tmp_path / "z"))
    make_output(tmp_path / "running", status="running")
    with pytest.raises(ExportError, match="not complete"):
        export(str(tmp_path / "running"), "modelopt", str(tmp_path / "w"))
    with pytest.raises(ExportError, match="one of"):
        export(str(tmp_path / "post"), "eagle", str(tmp_path / "v"))
    # A destination holding another output's export is not mixed into.
    make_output(tmp_path / "other", seed=9)
    assert export(str(tmp_path / "other"), "modelopt", str(tmp_path / "mo")).ok
    make_output(tmp_path / "third", seed=10, shards=2)
    with pytest.raises(ExportError, match="another output"):
        export(str(tmp_path / "third"), "modelopt", str(tmp_path / "mo"))


def test_draft_vocab_is_speculators_own_selection_in_each_trainers_files(source, tmp_path):
    """--draft-vocab N: the mapping equals the one speculators' own code builds from the same token counts,
    written under the names each trainer looks for, and read back by the verify step."""
    import torch
    from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

    out, samples, _ = source
    n, v = 12, 1000  # fewer than the distinct trained tokens: a real selection among ties
    freq = _masked_token_counts(samples)
    assert len(freq) > n
    want_d2t, want_t2d = build_vocab_mappings_from_distribution(freq, n, v)
    assert export(str(out), "speculators", str(tmp_path / "sp"), draft_vocab=n, target_vocab=v).ok
    np.testing.assert_array_equal(np.load(tmp_path / "sp" / f"d2t-{n}.npy"), want_d2t.numpy())
    np.testing.assert_array_equal(np.load(tmp_path / "sp" / f"t2d-{n}.npy"), want_t2d.numpy())
    assert export(str(out), "specforge", str(tmp_path / "sf"), draft_vocab=n, target_vocab=v).ok
    mapping = _load_torch(tmp_path / "sf" / f"vocab_mapping-{n}.pt")
    assert torch.equal(mapping["d2t"], want_d2t) and torch.equal(mapping["t2d"], want_t2d)
    report = export(str(out), "modelopt", str(tmp_path / "mo"), draft_vocab=n, target_vocab=v)
    assert report.ok and torch.equal(_load_torch(tmp_path / "mo" / f"d2t-{n}.pth"), want_d2t)
    assert json.loads((tmp_path / "mo" / "export.json").read_text())["draft_vocab"] == n
    # Each trainer's own file walk finds the samples and nothing else beside them.
    assert sorted(p.name for p in (tmp_path / "mo").rglob("*.pt")) == [f"{i:09d}.pt" for i in range(len(samples))]
    sf = sorted(p.name for p in (tmp_path / "sf").rglob("*") if p.name.endswith((".ckpt", ".ckpt.gz")))
    assert sf == [f"{i:09d}.ckpt" for i in range(len(samples))]
    assert sorted(p.name for p in (tmp_path / "sp" / "hidden_states").iterdir()) == sorted(
        f"hs_{i}.safetensors" for i in range(len(samples))
    )
    # The verify step reads the mapping back: a damaged one fails the export.
    np.save(tmp_path / "sp" / f"t2d-{n}.npy", np.roll(want_t2d.numpy(), 1))
    layout = LAYOUTS["speculators"]((1, 3, 5), H)
    problems = verify_vocab(Store(str(tmp_path / "sp")), layout, want_d2t.numpy(), want_t2d.numpy())
    assert problems == [
        "d2t and t2d name different tokens",
        "the draft vocabulary read back differs from the one selected",
    ]


def test_draft_vocab_refusals(source, tmp_path):
    out, samples, _ = source
    with pytest.raises(ExportError, match="--target-vocab"):  # this manifest names no model to read it from
        export(str(out), "speculators", str(tmp_path / "a"), draft_vocab=8)
    with pytest.raises(ExportError, match="larger than the target's vocabulary"):
        export(str(out), "speculators", str(tmp_path / "b"), draft_vocab=2000, target_vocab=1000)
    with pytest.raises(ExportError, match="outside the target's vocabulary"):
        export(str(out), "speculators", str(tmp_path / "c"), draft_vocab=8, target_vocab=10)


def test_draft_vocab_selection_ties_fill_and_order():
    from pipeline.tools.draft_vocab import check_vocab, select_vocab

    d2t, t2d = select_vocab({7: 5, 3: 5, 9: 1, 4: 9}, 3, 12)  # 4 first, then the tie 3 and 7 by id
    assert (d2t + np.arange(3)).tolist() == [3, 4, 7] and np.flatnonzero(t2d).tolist() == [3, 4, 7]
    d2t, t2d = select_vocab({9: 2}, 4, 12)  # too few trained tokens: the lowest unused ids fill
    assert (d2t + np.arange(4)).tolist() == [0, 1, 2, 9] and t2d.sum() == 4
    assert check_vocab(d2t, t2d, 4, 12) == []
    assert check_vocab(d2t, np.roll(t2d, 1), 4, 12) == ["d2t and t2d name different tokens"]
