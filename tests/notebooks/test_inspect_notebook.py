"""Run notebooks/inspect_shards.ipynb headless against a finished output; no cell may error, and the executed
notebook holds its figures.

The `harvest_output` fixture (path of a finished run's output) comes from the end-to-end conftest.
Standalone: `python tests/notebooks/test_inspect_notebook.py OUTPUT_DIR`.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import tempfile
from itertools import islice
from pathlib import Path

import nbformat

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO_ROOT / "notebooks" / "inspect_shards.ipynb"


def _kernel_manager(tmp: str):
    """A kernel manager whose `python3` spec runs this interpreter (the project's venv), not whatever
    `python` is first on PATH or which kernelspecs happen to be installed."""
    from jupyter_client import KernelManager
    from jupyter_client.kernelspec import KernelSpecManager

    spec_dir = Path(tmp) / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (hidden-harvest)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    ksm = KernelSpecManager(kernel_dirs=[str(spec_dir.parent)], ensure_native_kernel=False)
    return KernelManager(kernel_name="python3", kernel_spec_manager=ksm)


def execute_notebook(output_dir, bf16_output=None) -> nbformat.NotebookNode:
    """Execute the notebook with HARVEST_OUTPUT=output_dir (and HARVEST_BF16_OUTPUT=bf16_output: the bf16
    output an fp8 one is drawn against); raises if any cell errors."""
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    old = os.environ.get("HARVEST_OUTPUT")
    os.environ["HARVEST_OUTPUT"] = str(output_dir) if "://" in str(output_dir) else str(Path(output_dir).resolve())
    if bf16_output is not None:
        os.environ["HARVEST_BF16_OUTPUT"] = str(Path(bf16_output).resolve())
    try:
        with tempfile.TemporaryDirectory() as tmp:
            km = _kernel_manager(tmp)
            client = NotebookClient(
                nb,
                km=km,
                kernel_name="python3",
                timeout=300,
                resources={"metadata": {"path": str(REPO_ROOT)}},
            )
            try:
                client.execute()  # raises CellExecutionError on the first failing cell
            finally:
                # nbclient only shuts down kernels it created itself; this one was passed in.
                if km.has_kernel:
                    km.shutdown_kernel(now=True)
    finally:
        os.environ.pop("HARVEST_BF16_OUTPUT", None)
        if old is None:
            os.environ.pop("HARVEST_OUTPUT", None)
        else:
            os.environ["HARVEST_OUTPUT"] = old
    return nb


def _outputs_text(nb: nbformat.NotebookNode) -> str:
    parts = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                parts.append(out.get("text", ""))
            elif "data" in out:
                parts.append(out["data"].get("text/plain", ""))
    return "\n".join(parts)


def check_executed(nb: nbformat.NotebookNode, output_dir, figures: int = 4) -> None:
    from pipeline.format.shards import open_shards

    errors = [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"notebook produced errors: {[e.get('ename') for e in errors]}"
    text = _outputs_text(nb)
    first_id = next(islice(open_shards(str(output_dir), as_torch=False), 1))["sample_id"]
    for expected in ['"aux_layers"', "sample_id", "loss_mask", "cosine ", "final", first_id]:
        assert expected in text, f"{expected!r} missing from the notebook's output"
    # The figures are in the executed notebook as images: lengths + coverage, norms, cosines, one sample's tokens.
    images = [
        base64.b64decode(o["data"]["image/png"])
        for c in nb.cells
        for o in c.get("outputs", [])
        if "image/png" in o.get("data", {})
    ]
    assert len(images) == figures, f"{len(images)} figures in the executed notebook"
    for png in images:
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000  # a drawn figure, not an empty canvas


def test_inspect_notebook_runs(harvest_output):
    nb = execute_notebook(harvest_output)
    check_executed(nb, harvest_output)
    assert "no fp8 figure" in _outputs_text(nb)


def test_inspect_notebook_draws_an_fp8_output_against_its_bf16_twin(harvest_run_fp8, harvest_output):
    out = harvest_run_fp8[0]
    nb = execute_notebook(out, bf16_output=harvest_output)
    check_executed(nb, out, figures=5)  # the four, and fp8's per-token cosine to bf16
    text = _outputs_text(nb)
    assert "cosine to bf16 min" in text and '"encoding": "fp8"' in text


if __name__ == "__main__":
    import time

    sys.path.insert(0, str(REPO_ROOT))
    t0 = time.perf_counter()
    executed = execute_notebook(sys.argv[1])
    elapsed = time.perf_counter() - t0
    check_executed(executed, sys.argv[1])
    print(_outputs_text(executed))
    print(f"notebook executed OK in {elapsed:.1f}s")
