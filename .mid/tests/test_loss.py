import math

import torch

from models.loss import lm_loss


def test_lm_loss_is_fp32_cross_entropy_and_compiled_matches_eager():
    torch.manual_seed(0)
    logits = (torch.randn(2, 16, 50) * 4).to(torch.bfloat16)
    targets = torch.randint(0, 50, (2, 16))
    # float64 reference from the definition: mean over tokens of logsumexp - logit of the target
    ref = (torch.logsumexp(logits.double(), -1) - logits.double().gather(-1, targets[..., None])[..., 0]).mean()
    grads = {}
    for compiled in (False, True):
        x = logits.clone().requires_grad_(True)
        loss = lm_loss(x, targets, compiled=compiled)
        assert loss.dtype == torch.float32
        assert math.isclose(loss.item(), ref.item(), rel_tol=1e-6)
        loss.backward()
        assert x.grad.dtype == torch.bfloat16
        grads[compiled] = x.grad.float()
    want = (torch.softmax(logits.double(), -1) - torch.nn.functional.one_hot(targets, 50)) / targets.numel()
    for g in grads.values():
        torch.testing.assert_close(g.double(), want, rtol=1e-2, atol=1e-5)
    torch.testing.assert_close(grads[True], grads[False], rtol=1e-2, atol=1e-6)
