"""GPU-only: host staging buffers page-locked by cudaHostRegister (skipped without CUDA; run on the H200 by the
device tool). The CPU tests (tests/test_host_memory.py) replace the CUDA runtime's calls; these make them."""

from __future__ import annotations

import pytest
import torch

from orchestration.checkpoint.host_memory import HostStaging, tensor_specs
from orchestration.checkpoint.manager import CheckpointManager
from orchestration.checkpoint.state import model_and_optimizer_state

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_registered_buffers_are_pinned_take_device_copies_and_are_released():
    st = HostStaging()
    src = torch.randn(1 << 20, 8, device="cuda")
    st.ensure([("/w", src.shape, src.dtype, True), ("/small", torch.Size([3]), torch.float32, True)])
    buf = st.buffer("/w", src)
    assert buf.is_pinned() and st.buffers["/small"].is_pinned() and st.fallbacks == 0
    torch.cuda.synchronize()
    buf.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(buf, src.cpu())
    assert st.buffer("/w", src).data_ptr() == buf.data_ptr()
    st.release()
    assert not buf.is_pinned()  # unregistered: plain pageable memory again


def test_background_save_of_a_gpu_model_from_prepared_buffers_loads_bit_identical(tmp_path):
    def build(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 8)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(torch.randn(4, 64, device="cuda")).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return model, opt

    model, opt = build(0)
    mgr = CheckpointManager(tmp_path / "ck")
    assert mgr.prepare_staging(model, opt) > 0
    mgr._staging.wait_prepared()
    # every GPU tensor's buffer is page-locked (AdamW's step counters live on the CPU: plain buffers)
    on_gpu = [p for p, _, _, cuda in tensor_specs(model_and_optimizer_state(model, opt)) if cuda]
    assert on_gpu and all(mgr._staging.buffers[p].is_pinned() for p in on_gpu)
    assert mgr._staging.fallbacks == 0
    ptrs = {p: b.data_ptr() for p, b in mgr._staging.buffers.items()}
    want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    want_m = [opt.state[p]["exp_avg"].cpu().clone() for p in model.parameters()]
    mgr.save(1, model, opt, background=True)
    with torch.no_grad():  # training goes on while the thread writes: the checkpoint keeps step 1's values
        for p in model.parameters():
            p.add_(1.0)
    step, _, timing = mgr.wait()
    assert step == 1 and "stage_alloc_s" not in timing  # the prepared buffers were used: nothing allocated
    assert {p: b.data_ptr() for p, b in mgr._staging.buffers.items()} == ptrs
    fresh, fresh_opt = build(1)
    mgr.load(mgr.latest(), fresh, fresh_opt)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v.cpu(), want[k]), k
    for p, m in zip(fresh.parameters(), want_m):
        assert torch.equal(fresh_opt.state[p]["exp_avg"].cpu(), m)
