"""model.compile=true: every transformer block is compiled (inductor, static shapes) and computes what eager does.

CPU inductor; the FP8 layers run their emulated path inside the compiled graphs. Slow (first inductor compile).
"""

import pytest
import torch
import torch.nn.functional as F

from models.loss import model_lm_loss
from orchestration.training.model_setup import build_training_model
from orchestration.validation import load_job_config


def _loss_and_grads(precision: str, compile_blocks: bool, fp8_output_head: bool = False, fused_loss: bool = False,
                    recipe: str = "tensorwise"):
    """fused_loss: the loss computed inside the FP8 head (the worker's path where the head fuses it), else from the
    logits (the unfused head and loss)."""
    job = load_job_config({
        "model": {"name": "debug_dense", "compile": compile_blocks, "overrides": {"n_layers": 2}},
        "precision": {"name": precision, "recipe": recipe, "compute_dtype": "float32",
                      "fp8_output_head": fp8_output_head},
        "cluster": {"min_workers": 1, "max_workers": 1},
        "train": {"global_batch_size": 2, "micro_batch_size": 2},
    })
    torch.manual_seed(0)
    model = build_training_model(job, world_size=1, device=torch.device("cpu")).model
    compiled = [getattr(b, "_compiled_call_impl", None) is not None
                for b in [*model.layers.values(), *([model.output] if fp8_output_head else [])]]
    tokens = torch.randint(0, model.args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    if fused_loss:  # the worker's path: the loss inside the FP8 head (fp8/head.py)
        loss = model_lm_loss(model, tokens[:, :-1], tokens[:, 1:], compiled=compile_blocks)
    else:
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return compiled, loss.detach(), grads


@pytest.mark.slow
def test_compiled_blocks_compute_what_eager_does():
    compiled_flags, loss_c, grads_c = _loss_and_grads("bf16", compile_blocks=True)
    eager_flags, loss_e, grads_e = _loss_and_grads("bf16", compile_blocks=False)
    assert all(compiled_flags) and len(compiled_flags) == 2 and not any(eager_flags)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        torch.testing.assert_close(grads_c[name], grads_e[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.slow
def test_compiled_fp8_blocks_train():
    compiled_flags, loss_c, grads_c = _loss_and_grads("fp8", compile_blocks=True)
    _, loss_e, grads_e = _loss_and_grads("fp8", compile_blocks=False)
    assert all(compiled_flags)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    assert grads_c.keys() == grads_e.keys()
    # Fused casts may put a value one fp8 step away from eager's, so gradients are compared by direction
    # (measured: equal losses, every cosine >= 0.9999998).
    for name in grads_e:
        cos = F.cosine_similarity(grads_c[name].flatten(), grads_e[name].flatten(), dim=0)
        assert cos > 0.99999, name


@pytest.mark.slow
def test_compiled_fp8_output_head_matches_eager():
    """precision.fp8_output_head=true with a head that does not fuse the loss (the rowwise recipe): the FP8 head is
    compiled with the blocks and computes what eager does."""
    compiled_flags, loss_c, grads_c = _loss_and_grads("fp8", compile_blocks=True, fp8_output_head=True,
                                                      recipe="rowwise")
    _, loss_e, grads_e = _loss_and_grads("fp8", compile_blocks=False, fp8_output_head=True, recipe="rowwise")
    _, loss_hp_head, _ = _loss_and_grads("fp8", compile_blocks=False, recipe="rowwise")
    assert all(compiled_flags) and len(compiled_flags) == 3
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    assert not torch.equal(loss_e, loss_hp_head)  # the head really ran in fp8
    assert grads_c.keys() == grads_e.keys()
    for name in grads_e:
        cos = F.cosine_similarity(grads_c[name].flatten(), grads_e[name].flatten(), dim=0)
        assert cos > 0.99999, name


@pytest.mark.slow
def test_fused_fp8_head_with_compiled_blocks_matches_eager_and_the_unfused_head():
    """An FP8 head under the tensorwise recipe fuses the loss: it runs its own kernels (not compiled), the blocks
    compile, and loss and gradients match eager and the unfused head's (its logits, then the loss)."""
    compiled_flags, loss_c, grads_c = _loss_and_grads("fp8", True, fp8_output_head=True, fused_loss=True)
    _, loss_e, grads_e = _loss_and_grads("fp8", False, fp8_output_head=True, fused_loss=True)
    _, loss_u, grads_u = _loss_and_grads("fp8", False, fp8_output_head=True, fused_loss=False)
    assert compiled_flags == [True, True, False]  # blocks compiled, the fused head not
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_e, loss_u, rtol=1e-5, atol=1e-5)
    assert grads_c.keys() == grads_e.keys() == grads_u.keys()
    for name in grads_e:
        for other in (grads_c, grads_u):
            cos = F.cosine_similarity(other[name].flatten(), grads_e[name].flatten(), dim=0)
            assert cos > 0.9999, name
