import pytest

from patches.sglang import UnsupportedSGLangVersion, installed_sglang_version, server_pythonpath


def test_unsupported_version_names_the_supported_one():
    with pytest.raises(UnsupportedSGLangVersion) as exc:
        server_pythonpath(cpu=True, version="0.5.22")
    message = str(exc.value)
    assert "0.5.22" in message and "0.5.23" in message


@pytest.mark.parametrize("cpu, names", [(True, ["sitedir", "cpu_standin"]), (False, ["sitedir"])])
def test_pinned_version_dirs_exist(cpu, names):
    dirs = server_pythonpath(cpu=cpu, version="0.5.23")
    assert [d.name for d in dirs] == names
    assert all(d.is_dir() for d in dirs)
    assert (dirs[0] / "sitecustomize.py").is_file() and (dirs[0] / "hidden_harvest_hook.py").is_file()


def test_installed_version_is_the_pinned_one(hook_modules):
    # The hook refuses any other version at patch time; the environment must match it.
    assert installed_sglang_version() == hook_modules.hook.PINNED_SGLANG_VERSION == "0.5.23"


def test_the_hook_refuses_another_sglang_version_inside_the_server(hook_modules, monkeypatch):
    monkeypatch.setattr(hook_modules.hook.importlib.metadata, "version", lambda name: "0.5.24")
    with pytest.raises(RuntimeError, match="pinned to sglang==0.5.23, found 0.5.24"):
        hook_modules.hook._check_version()


def test_fault_spec_is_parsed_and_unknown_faults_refused(hook_modules, tmp_path):
    faults = hook_modules.faults.Faults("nan:0.5, missing:1", None, str(tmp_path))
    assert faults.rates == {"nan": 0.5, "missing": 1.0}
    with pytest.raises(ValueError, match="unknown fault 'typo'"):
        hook_modules.faults.Faults("typo:0.1", None, str(tmp_path))


def test_the_final_norm_wrapper_keeps_a_copy_of_the_norms_input_for_extend_batches(hook_modules):
    """The pre-norm hook point (hidden_harvest_hook._patch_final_norm) on a stand-in with final_norm's contract:
    the capture callback gets the updated residual, i.e. the final norm's input."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    hook = hook_modules.hook

    def final_norm(hidden_states, forward_batch, layernorm, capture=None, **kwargs):
        residual = hidden_states + 1  # stands for the fused kernel's add
        if capture is not None:
            capture(residual)
        out = layernorm(residual)
        residual.zero_()  # borrowed storage: reused once final_norm returns
        return out

    module = SimpleNamespace(final_norm=final_norm)
    hook._patch_final_norm(module)
    wrapped = module.final_norm
    hook._patch_final_norm(module)  # a second import does not wrap twice
    assert module.final_norm is wrapped

    def batch(extend: bool):
        fb = object.__new__(ForwardBatch)
        fb.forward_mode = SimpleNamespace(is_extend=lambda: extend)
        return fb

    x, theirs = torch.randn(3, 4), []
    fb = batch(True)
    out = module.final_norm(x, fb, lambda r: 2 * r, capture=theirs.append)
    kept = getattr(fb, hook._PRE_NORM_ATTR)
    assert torch.equal(kept, x + 1) and torch.equal(out, 2 * (x + 1))  # a copy, taken before the storage was reused
    assert len(theirs) == 1  # the model's own callback still runs
    decode = batch(False)
    module.final_norm(x, decode, lambda r: r)
    assert not hasattr(decode, hook._PRE_NORM_ATTR)


def test_a_batch_without_its_pre_norm_state_gets_error_dumps_never_the_post_norm_one(hook_modules, tmp_path):
    import json
    import struct

    import torch

    publisher = hook_modules.publisher.DumpPublisher(str(tmp_path), "hh-")
    h = torch.zeros(5, 4, dtype=torch.bfloat16)
    publisher.capture(
        torch.arange(5),
        h,
        [h],
        ["hh-a", "hh-b", "other"],
        [2, 2, 1],
        None,
        final_layer="pre_norm",
        error="no pre-norm state",
    )
    publisher.flush()
    for rid in ("hh-a", "hh-b"):
        data = (tmp_path / f"{rid}.hhd").read_bytes()
        (n,) = struct.unpack_from("<Q", data)
        header = json.loads(data[8 : 8 + n])
        assert header["error"] == "no pre-norm state" and header["num_tokens"] == 0 and len(data) == 8 + n
        assert header["final_layer"] == "pre_norm"
    assert not (tmp_path / "other.hhd").exists()


def test_gemma3s_residual_stream_is_kept_where_its_own_capture_keeps_the_layer_delta(hook_modules, monkeypatch):
    """SGLang's Gemma-3 layer returns (delta, residual), the stream after it being their sum, and its own aux
    capture appends the delta. The hook's wrapper (on a stand-in with that contract) keeps delta + residual of
    the captured layers and of the last layer (the final norm's input), for extend batches only."""
    from types import SimpleNamespace

    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    hook = hook_modules.hook
    monkeypatch.setattr(hook, "AUX_LAYERS", [0, 2])
    monkeypatch.setattr(hook, "FINAL_LAYER", "pre_norm")

    class Gemma3DecoderLayer:
        def __init__(self, k):
            self.k = k

        def forward(self, hidden_states, forward_batch, residual=None):
            residual = hidden_states if residual is None else hidden_states + residual  # the deferred add
            return residual * 0 + self.k, residual  # the delta this layer adds

    class Gemma3TextModel:
        def __init__(self):
            self.layers = [Gemma3DecoderLayer(k) for k in (1.0, 2.0, 3.0, 4.0)]

        def forward(self, x, forward_batch):
            h, r = x, None
            for layer in self.layers:
                h, r = layer.forward(hidden_states=h, forward_batch=forward_batch, residual=r)
            return h + r

    module = SimpleNamespace(Gemma3DecoderLayer=Gemma3DecoderLayer, Gemma3TextModel=Gemma3TextModel)
    hook._patch_gemma3(module)
    hook._patch_gemma3(module)  # a second import does not wrap twice

    def batch(extend: bool):
        fb = object.__new__(ForwardBatch)
        fb.forward_mode = SimpleNamespace(is_extend=lambda: extend)
        return fb

    x, fb = torch.zeros(3, 2), batch(True)
    out = Gemma3TextModel().forward(x, fb)
    streams = getattr(fb, hook._AUX_ATTR)
    assert sorted(streams) == [0, 2]
    assert torch.equal(streams[0], x + 1) and torch.equal(streams[2], x + 6)  # embeddings + 1, then + 2 + 3
    assert torch.equal(getattr(fb, hook._PRE_NORM_ATTR), out) and torch.equal(out, x + 10)
    decode = batch(False)
    Gemma3TextModel().forward(x, decode)
    assert not hasattr(decode, hook._AUX_ATTR) and not hasattr(decode, hook._PRE_NORM_ATTR)
