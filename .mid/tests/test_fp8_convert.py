"""convert_to_fp8 / set_precision / precision_state on a tiny model with dense and grouped (MoE) layers.

The model is built here (models/ is developed separately): it has the names and the `grouped_mm` swap
point the real models use (tok_embeddings, layers.N, gate, experts.grouped_mm, output).
"""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fp8
from fp8 import Float8Linear, Fp8GroupedMM

DIM, HID, E, VOCAB = 64, 32, 4, 96


class TinyExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, DIM, HID) / DIM**0.5)
        self.w3 = nn.Parameter(torch.randn(E, DIM, HID) / DIM**0.5)
        self.w2 = nn.Parameter(torch.randn(E, HID, DIM) / HID**0.5)  # [E, in, out] here; the models store [E, out, in]
        self.grouped_mm = torch._grouped_mm  # the swap point

    def forward(self, x_MD, offs_E):
        h_MH = F.silu(self.grouped_mm(x_MD, self.w1, offs_E)) * self.grouped_mm(x_MD, self.w3, offs_E)
        return self.grouped_mm(h_MH, self.w2, offs_E)


class TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        self.odd = nn.Linear(DIM, 20, bias=False)  # not a multiple of 16: stays high precision
        self.odd_back = nn.Linear(20, DIM, bias=False)
        self.gate = nn.Linear(DIM, E, bias=False)  # router: stays high precision
        self.experts = TinyExperts()

    def forward(self, x_BTD):
        b, t, d = x_BTD.shape
        x_BTD = x_BTD + self.wo(F.silu(self.wq(x_BTD))) + self.odd_back(self.odd(x_BTD))
        x_MD = x_BTD.reshape(-1, d)
        # Fixed, sorted "routing" (equal groups of 16 rows), weighted by the gate like a real MoE.
        offs_E = torch.arange(1, E + 1, dtype=torch.int32) * (x_MD.shape[0] // E)
        moe_MD = self.experts(x_MD, offs_E) * torch.sigmoid(self.gate(x_MD)).mean(-1, keepdim=True)
        return x_BTD + moe_MD.reshape(b, t, d)


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleDict({"0": TinyBlock(), "1": TinyBlock()})
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens_BT):
        h = self.tok_embeddings(tokens_BT)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(h)


def build(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return TinyModel().to(dtype)


def loss_of(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (2, 32), generator=g)
    logits = model(tokens)
    return F.cross_entropy(logits.float().flatten(0, 1), torch.roll(tokens, -1, 1).flatten())


def test_default_filter_converts_the_right_modules():
    model = fp8.convert_to_fp8(build(), "rowwise")
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == {f"layers.{i}.{n}" for i in "01" for n in ("wq", "wo")}
    for i in "01":
        assert isinstance(model.layers[i].experts.grouped_mm, Fp8GroupedMM)
        assert type(model.layers[i].gate) is nn.Linear
        assert type(model.layers[i].odd) is nn.Linear
    assert type(model.output) is nn.Linear and type(model.tok_embeddings) is nn.Embedding


def test_default_filter_skips_unaligned_experts():
    experts = TinyExperts()
    assert fp8.default_module_filter("layers.0.moe.experts", experts)
    experts.w2 = nn.Parameter(torch.randn(E, 24, DIM))
    assert not fp8.default_module_filter("layers.0.moe.experts", experts)


def test_custom_filter():
    model = fp8.convert_to_fp8(build(), "tensorwise", module_filter=lambda name, m: name.endswith("wq"))
    assert {n for n, m in model.named_modules() if isinstance(m, Float8Linear)} == {"layers.0.wq", "layers.1.wq"}
    assert model.layers["0"].experts.grouped_mm is torch._grouped_mm


def test_output_head_converts_only_when_asked_and_falls_back_with_the_model():
    """make_module_filter(output_head=True) adds the LM head (and nothing else the default keeps: embeddings,
    routers, unaligned linears); its fp8 logits stay close to the bf16 head's; set_precision("bf16") puts the head
    back to the exact bf16 computation; a precision state saved with the head in fp8 is refused by a model
    converted without it, naming the setting."""
    from fp8.convert import make_module_filter

    base = build()
    plain = {n for n, m in fp8.convert_to_fp8(copy.deepcopy(base), "tensorwise").named_modules()
             if isinstance(m, Float8Linear)}
    model = fp8.convert_to_fp8(copy.deepcopy(base), "tensorwise", module_filter=make_module_filter(output_head=True))
    with_head = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert with_head == plain | {"output"}
    assert type(model.tok_embeddings) is nn.Embedding
    assert all(type(model.layers[i].gate) is nn.Linear and type(model.layers[i].odd) is nn.Linear for i in "01")
    # The head alone in fp8: logits within fp8's error of the bf16 head's (SQNR in dB against float64).
    x = torch.randn(64, DIM, dtype=torch.bfloat16)
    ref = x.double() @ base.output.weight.double().t()
    sqnr = lambda y: (10 * torch.log10(ref.pow(2).sum() / (y.double() - ref).pow(2).sum())).item()
    assert 20 < sqnr(model.output(x)) < sqnr(base.output(x)) - 10
    fp8.set_precision(model, "bf16")
    assert torch.equal(loss_of(model), loss_of(base))
    fp8.set_precision(model, "fp8")
    state = fp8.precision_state(model)
    assert state["modules"]["output"] == "fp8"
    with pytest.raises(ValueError, match="fp8_output_head"):
        fp8.load_precision_state(fp8.convert_to_fp8(build(), "tensorwise"), state)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_output_head_numerics_with_a_large_vocabulary(recipe):
    """A 16384-token head with peaked logits and Zipf targets in FP8 (CPU: the emulated path, the same function as
    torch._scaled_mm's): loss within 0.5% of float64, logits and both gradients above 23 dB SQNR (measured ~28.5 /
    ~26.6 / ~26.6; bf16 gives ~55 / ~44 / ~44)."""
    from tests.numerics import head_loss_and_grads, lm_head_case, sqnr

    head, x, targets = lm_head_case("cpu")
    ref_head = nn.Linear(head.in_features, head.out_features, bias=False).double()
    ref_head.weight.data.copy_(head.weight.double())
    ref = head_loss_and_grads(ref_head, x, targets, torch.float64)
    got = head_loss_and_grads(Float8Linear.from_float(head, recipe), x, targets)
    assert abs(got[0].item() - ref[0].item()) / ref[0].item() < 5e-3
    for what, g, r in zip(("logits", "grad_x", "grad_w"), got[1:], ref[1:], strict=True):
        assert 23 < sqnr(g, r) < 40, (what, sqnr(g, r))


def test_parameters_and_state_dict_untouched():
    model = build()
    params_before = {n: p for n, p in model.named_parameters()}
    sd_before = {k: v.clone() for k, v in model.state_dict().items()}
    fp8.convert_to_fp8(model, "tensorwise")
    assert {n: p for n, p in model.named_parameters()}.keys() == params_before.keys()
    for n, p in model.named_parameters():
        assert p is params_before[n]
    sd_after = model.state_dict()
    assert sd_after.keys() == sd_before.keys()
    assert all(torch.equal(sd_after[k], v) for k, v in sd_before.items())


@pytest.mark.parametrize("recipe", list(fp8.RECIPES))
def test_bf16_mode_reproduces_bf16_model_exactly(recipe):
    base = build()
    model = fp8.convert_to_fp8(copy.deepcopy(base), recipe)
    fp8.set_precision(model, "bf16")
    l0, l1 = loss_of(base), loss_of(model)
    assert torch.equal(l0, l1)
    l0.backward()
    l1.backward()
    for (n, p0), p1 in zip(base.named_parameters(), model.parameters()):
        assert torch.equal(p0.grad, p1.grad), n


def test_fp8_mode_is_close_but_not_identical():
    base = build()
    model = fp8.convert_to_fp8(copy.deepcopy(base), "rowwise")
    l0, l8 = loss_of(base), loss_of(model)
    assert not torch.equal(l0, l8)
    assert abs(l8.item() - l0.item()) / l0.item() < 0.02


def test_set_precision_scope_and_state_roundtrip():
    model = fp8.convert_to_fp8(build(), "tensorwise")
    changed = fp8.set_precision(model, "bf16", scope=["layers.1"])
    assert changed == ["layers.1.wq", "layers.1.wo", "layers.1.experts"]
    assert model.layers["1"].experts.grouped_mm is torch._grouped_mm
    assert model.layers["0"].wq.fp8_enabled and not model.layers["1"].wq.fp8_enabled
    state = fp8.precision_state(model)
    assert state["recipe"] == "tensorwise"
    assert state["modules"]["layers.1.experts"] == "bf16" and state["modules"]["layers.0.wo"] == "fp8"
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    fresh = fp8.convert_to_fp8(build(), "tensorwise")
    fp8.load_precision_state(fresh, loaded)
    assert fp8.precision_state(fresh) == state
    assert torch.equal(loss_of(fresh), loss_of(model))
    fp8.set_precision(model, "fp8")
    assert set(fp8.precision_state(model)["modules"].values()) == {"fp8"}


def test_optimizer_state_untouched():
    model = fp8.convert_to_fp8(build(torch.float32), "rowwise")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss_of(model).backward()
    opt.step()
    before = copy.deepcopy(opt.state_dict())
    fp8.set_precision(model, "bf16")
    after = opt.state_dict()
    assert before["param_groups"] == after["param_groups"]
    for k, st in before["state"].items():
        assert all(torch.equal(v, after["state"][k][n]) for n, v in st.items())
    opt.zero_grad()
    loss_of(model).backward()
    params_before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # still trains after the switch: every parameter with a gradient moves
    moved = [not torch.equal(p0, p) for p0, p in zip(params_before, model.parameters(), strict=True) if p.grad is not None]
    assert moved and all(moved)


def test_fp8_health_aggregates_on_device():
    model = fp8.convert_to_fp8(build(torch.float32), "tensorwise")
    assert fp8.fp8_health(model)["amax_max"].item() == 0.0  # nothing ran yet: no garbage from buffers
    # Each layer's input, to recompute its statistics from the definition (fp8.health.health_stats_ref).
    inputs = {}
    for name, module in model.named_modules():
        if isinstance(module, Float8Linear):
            module.register_forward_hook(lambda m, args, out, name=name: inputs.__setitem__(name, args[0].detach()))
    loss_of(model)
    h = fp8.fp8_health(model)
    assert set(h) == {"saturated_frac", "underflow_frac", "amax_max"}
    assert all(v.dim() == 0 and torch.isfinite(v) for v in h.values())
    from fp8.health import health_stats_ref
    from fp8.reference import quantize_tensorwise_ref

    # Each linear's statistics follow the definition on its own input...
    per_module = []
    for name, x in inputs.items():
        x_2d = x.reshape(-1, x.shape[-1])
        want = health_stats_ref(x_2d, *quantize_tensorwise_ref(x_2d, torch.float8_e4m3fn), torch.float8_e4m3fn)
        got = model.get_submodule(name).fp8_health_stats
        assert torch.allclose(got, want, rtol=1e-6, atol=0), (name, got.tolist(), want.tolist())
        per_module.append(got)
    assert len(per_module) == 4
    # ... and the model's figures are the mean (fractions) and max (amax) over every fp8 module, the grouped
    # experts' last statistics included.
    grouped = [m._fp8_grouped_op.last_stats for m in model.modules() if fp8.convert.is_fp8_grouped(m)]
    assert len(grouped) == 2 and all(g is not None for g in grouped)
    all_S3 = torch.stack(per_module + grouped)
    assert h["saturated_frac"].item() == pytest.approx(all_S3[:, 0].mean().item(), rel=1e-6, abs=0)
    assert h["underflow_frac"].item() == pytest.approx(all_S3[:, 1].mean().item(), rel=1e-6, abs=0)
    assert all_S3[:, 1].max() > 0  # the mean is over something nonzero
    assert h["amax_max"].item() == all_S3[:, 2].max().item()
    assert h["amax_max"].item() >= max(x.abs().max().item() for x in inputs.values())
    fp8.set_precision(model, "bf16")
    assert fp8.fp8_health(model)["amax_max"].item() == 0.0


def test_user_errors():
    with pytest.raises(ValueError, match="recipe"):
        fp8.convert_to_fp8(build(), "blockwise")
    model = fp8.convert_to_fp8(build(), "rowwise")
    with pytest.raises(ValueError, match="already"):
        fp8.convert_to_fp8(model, "rowwise")
    with pytest.raises(ValueError, match="precision"):
        fp8.set_precision(model, "fp16")
    with pytest.raises(ValueError, match="scope"):
        fp8.set_precision(model, "bf16", scope=["nope"])
    with pytest.raises(ValueError, match="convert_to_fp8"):
        fp8.set_precision(build(), "fp8")
    with pytest.raises(ValueError, match="does not convert"):
        fp8.load_precision_state(model, {"recipe": "rowwise", "modules": {"x.y": "fp8"}})
