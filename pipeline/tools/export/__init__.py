"""`harvest export OUT --to specforge|speculators|modelopt DEST`: an output in the layout a draft trainer reads.

One file per sample, named by the sample's place in the output (shards in name order, rows in order), so a
rerun writes the same names: files already in DEST are complete (each is written whole, then renamed) and
are skipped, and a killed export rerun completes with nothing written twice. Shards are exported in
parallel; every file written is read back through the trainer's layout and compared with the source
sample bit for bit before the export reports success.

What each trainer reads (from their own code):
  specforge    `{i:09d}.ckpt` torch files: input_ids, loss_mask int64 [T], aux_hidden_state bf16 [1, T, 3H],
               hidden_state bf16 [1, T, H] after the final norm; exactly three aux layers.
  modelopt     `{i:09d}.pt` torch files: input_ids, loss_mask int64 [T], aux_hidden_states [T, K*H],
               hidden_states [T, H] after the norm (hidden_states_prenorm False), conversation_id.
  speculators  `hidden_states/hs_{i}.safetensors`: hidden_states bf16 [T, K+1, H] (the aux layers, then
               the final layer *before* the norm), token_ids int64 [T]; in DEST itself an HF `datasets`
               save_to_disk folder (input_ids, loss_mask, seq_len of row i) and `token_freq.pt`.
Layer ids: our aux layer i is HF hidden_states[i+1]; SpecForge and Model-Optimizer name the same layers by
output id (= ours), speculators by HF index (ours + 1, the final layer as N). `export.json` in DEST says
which ids the trainer's draft config must name.

`draft_vocab=N` also writes the draft vocabulary (pipeline/tools/draft_vocab.py) where each trainer looks for
it: speculators `d2t-N.npy` and `t2d-N.npy` (its CLI's default names for `--draft-vocab-size N`), SpecForge
`vocab_mapping-N.pt` ({d2t, t2d}, for `model.vocab_mapping_path`), Model-Optimizer `d2t-N.pth`.

One module per trainer layout (specforge.py, modelopt.py, speculators.py) on what they share (layout.py);
run.py exports and verifies.
"""

from __future__ import annotations

from pipeline.tools.export.layout import ExportError
from pipeline.tools.export.run import EXPORT_RECORD, TRAINERS, ExportReport, export, masked_token_counts

__all__ = ["EXPORT_RECORD", "TRAINERS", "ExportError", "ExportReport", "export", "masked_token_counts"]
