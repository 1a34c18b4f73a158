"""The model eval and generate load: made on their device in the dtype asked for, the checkpoint's weights read into
it (rounded once to bf16 for ``--dtype bf16``), and on a GPU every tensor of a decoding loop on it (the
``gpu``-marked test runs there: the CPU ones check the same loading)."""

from __future__ import annotations

import pytest
import torch
from support.models import llama_style, run_config

from megatransformer import checkpoint as ckpt
from megatransformer.inference import load_for_inference
from megatransformer.model import build_model, stream
from megatransformer.model.beam import beam_search

CFG = llama_style(n_layers=2, d_model=64, d_ff=128, vocab_size=96, position="sinusoidal")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A weights checkpoint of a random model (a sinusoidal position table: a buffer the checkpoint lacks) and the
    model."""
    torch.manual_seed(0)
    model = build_model(CFG).eval()
    path = ckpt.write_weights_checkpoint(
        tmp_path_factory.mktemp("inference") / "w", run_config(model=CFG.model_dump()), model.state_dict()
    )
    return path, model


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_model_is_made_in_the_dtype_asked_for_with_the_checkpoints_weights(saved, dtype):
    path, reference = saved
    loaded = load_for_inference(path, "cpu", dtype=dtype)
    want = torch.float32 if dtype == "fp32" else torch.bfloat16
    assert {t.dtype for t in loaded.model.state_dict().values()} == {want}
    for name, tensor in reference.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor.to(want)), name
    assert loaded.device == torch.device("cpu")
    assert torch.get_default_dtype() == torch.float32  # (restored)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; the CPU tests above check the same loading")
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_on_a_gpu_the_model_its_decoding_and_its_beams_stay_on_it(saved, dtype):
    """generate's sampling (a CUDA generator) and eval --bleu's beams run on the GPU, and the model's logits there
    are the CPU model's (to TF32's or bf16's precision)."""
    path, reference = saved
    loaded = load_for_inference(path, "cuda:0", dtype=dtype)
    assert {t.device.type for t in loaded.model.state_dict().values()} == {"cuda"}
    prompt = torch.tensor([[5, 17, 42, 8]], device=loaded.device)
    generator = torch.Generator(device=loaded.device).manual_seed(0)
    sampled = list(stream(loaded.model, prompt, 6, temperature=1.0, top_k=20, generator=generator))
    assert len(sampled) == 6 and all(token.device == loaded.device for token in sampled)
    with torch.no_grad():
        ours = loaded.model(prompt).float().cpu()
        theirs = reference(prompt.cpu())
    tolerance = 1e-2 if dtype == "fp32" else 5e-2
    torch.testing.assert_close(ours, theirs, rtol=tolerance, atol=tolerance)
    beams = beam_search(loaded.model, prompt, 4, 3, eos_id=1, alpha=0.6, form="gnmt")
    assert len(beams) == 1 and len(beams[0].tokens) >= 1
