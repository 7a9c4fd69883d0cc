from pipeline.format.manifest import write_manifest
from pipeline.format.storage import Store
from pipeline.tools.inspect import summarize
from tests_support import make_output


def _manifest() -> dict:
    return {
        "status": "complete",
        "model": {"name": "m"},
        "engine": {"name": "sglang", "version": "x", "device": "cpu"},
        "aux_layers": [1],
        "hidden_size": 4,
        "dtype": "bfloat16",
        "totals": {
            "samples_ok": 5,
            "errors": 0,
            "filtered": 0,
            "tokens": 50,
            "bytes": 100,
            "shards": 1,
            "samples": 5,
            "input_rows": 3,
        },
        "conversations": {
            "turns": "auto",
            "conversations": 3,
            "full": 2,
            "each": 1,
            "tokens_full": 40,
            "tokens_each": 70,
            "tokens_chosen": 50,
            "unrendered": {"reasoning_content": 2},
        },
    }


def test_summary_names_the_turns_policy_and_unrendered_fields(tmp_path):
    write_manifest(Store(str(tmp_path)), _manifest())
    text = summarize(str(tmp_path))
    assert "(of 5 samples from 3 input rows)" in text
    assert (
        "conversations (extract.turns=auto): 3, 2 rendered whole, 1 one sample per assistant turn; tokens 50 (full 40, each 70)"
        in text
    )
    assert "not rendered by the chat template (samples): {'reasoning_content': 2}" in text


def test_summary_describes_the_final_norm_without_printing_its_weight(tmp_path):
    """Shards written by the real writer with a pre-norm final layer carry the norm's weight in their metadata;
    the summary gives its variant, eps, sha256 and size, never the weight itself."""
    _, norm = make_output(tmp_path, H=16)
    write_manifest(Store(str(tmp_path)), _manifest())
    stored = norm.to_json()
    text = summarize(str(tmp_path))
    assert "schema (3 shards, first shards/part-" in text
    assert (
        f"  final norm: variant rms, eps 1e-05, weight float32 sha256 {stored['weight_sha256']}, 64 bytes (16 values)"
        in text.splitlines()
    )
    assert stored["weight_float32_base64"] not in text
    assert "weight_float32_base64" not in text and "base64" not in text


def test_a_final_norm_whose_weight_does_not_match_its_sha256_is_said_to_be_unreadable():
    import numpy as np

    from pipeline.format.final_norm import FinalNorm
    from pipeline.tools.inspect import describe_final_norm

    stored = FinalNorm("rms", 1e-5, np.ones(4, np.float32)).to_json()
    stored["weight_sha256"] = "0" * 64
    assert describe_final_norm(stored).startswith("cannot be read (FinalNormError: ")
