from pipeline.format.manifest import write_manifest
from pipeline.format.storage import Store
from pipeline.tools.inspect import summarize


def test_summary_names_the_turns_policy_and_unrendered_fields(tmp_path):
    manifest = {
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
    write_manifest(Store(str(tmp_path)), manifest)
    text = summarize(str(tmp_path))
    assert "(of 5 samples from 3 input rows)" in text
    assert (
        "conversations (extract.turns=auto): 3, 2 rendered whole, 1 one sample per assistant turn; tokens 50 (full 40, each 70)"
        in text
    )
    assert "not rendered by the chat template (samples): {'reasoning_content': 2}" in text
