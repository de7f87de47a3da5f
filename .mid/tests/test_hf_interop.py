"""Hugging Face import and export with real files: tiny models made here (transformers' LlamaForCausalLM saved with
save_pretrained; a DeepSeek-MoE directory in the deepseek-moe-16b layout written with safetensors, since transformers
has no DeepSeek-MoE v1 class), our forward against transformers' (Llama) and against an independent reference of
the published DeepSeek-MoE forward, round trips through our checkpoints, sharded imports on 3 gloo ranks, and the
refusals of bad checkpoint directories before anything starts."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file

from models.deepseek_moe import DeepSeekMoE
from models.llama3 import Llama3
from orchestration.checkpoint.manager import CheckpointManager
from orchestration.config import ConfigError, JobConfig, to_dict
from orchestration.export import export_run
from orchestration.export import main as export_main
from orchestration.interop.config_check import resolve_from_hf
from orchestration.interop.import_hf import import_weights
from orchestration.interop.layout import args_from_hf_config, args_of
from orchestration.validation import load_job_config
from tests.conftest import REPO
from tests.spawned import free_port, rank_process_group

RUN_CONFIG = "config.yaml"


@pytest.fixture(autouse=True)
def exact_matmuls():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def make_llama_dir(path: Path, shard_size: str | None = "60KB", tie: bool = False) -> Path:
    """A random LlamaForCausalLM with GQA and the llama3 RoPE scaling, weights large enough (std 0.2) that attention
    is far from uniform, so a wrong q/k layout shows in the logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=128, rope_theta=500000.0, rms_norm_eps=1e-5,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
        initializer_range=0.2, tie_word_embeddings=tie, architectures=["LlamaForCausalLM"],
        bos_token_id=7, eos_token_id=9)  # not transformers' defaults (1, 2): an export that drops them shows
    model = LlamaForCausalLM(config)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, **kwargs)
    return path


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return make_llama_dir(tmp_path_factory.mktemp("hf") / "llama")


# ---------------------------------------------------------------------------------------------------------------
# DeepSeek-MoE: the published layout, written by hand at a tiny size

DS_SIZES = {"D": 64, "V": 256, "I_dense": 96, "I_moe": 32, "E": 4, "L": 3, "H": 4, "shared": 2, "top_k": 2}


def deepseek_config(s=DS_SIZES) -> dict:
    return {"architectures": ["DeepseekForCausalLM"], "model_type": "deepseek", "hidden_size": s["D"],
            "vocab_size": s["V"], "intermediate_size": s["I_dense"], "moe_intermediate_size": s["I_moe"],
            "n_routed_experts": s["E"], "n_shared_experts": s["shared"], "num_experts_per_tok": s["top_k"],
            "num_hidden_layers": s["L"], "num_attention_heads": s["H"], "num_key_value_heads": s["H"],
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "norm_topk_prob": False, "scoring_func": "softmax",
            "aux_loss_alpha": 0.001, "seq_aux": True, "rms_norm_eps": 1e-6, "rope_theta": 10000,
            "rope_scaling": None, "max_position_embeddings": 128, "hidden_act": "silu", "attention_bias": False,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def deepseek_tensors(s=DS_SIZES, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Random weights under deepseek-moe-16b-base's tensor names (tests/test_hf_layout.py checks the names at full
    size); norms around 1, projections std 0.2."""
    g = torch.Generator().manual_seed(1)
    D, I_d, I_m = s["D"], s["I_dense"], s["I_moe"]

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.2).to(dtype)

    def norm():
        return (1 + 0.1 * torch.randn(D, generator=g)).to(dtype)

    out = {"model.embed_tokens.weight": w(s["V"], D), "model.norm.weight": norm(), "lm_head.weight": w(s["V"], D)}
    for layer in range(s["L"]):
        p = f"model.layers.{layer}."
        out |= {f"{p}self_attn.{x}_proj.weight": w(D, D) for x in "qkvo"}
        out |= {f"{p}input_layernorm.weight": norm(), f"{p}post_attention_layernorm.weight": norm()}
        if layer == 0:
            out |= {f"{p}mlp.gate_proj.weight": w(I_d, D), f"{p}mlp.up_proj.weight": w(I_d, D),
                    f"{p}mlp.down_proj.weight": w(D, I_d)}
            continue
        out[f"{p}mlp.gate.weight"] = w(s["E"], D)
        for e in range(s["E"]):
            out |= {f"{p}mlp.experts.{e}.gate_proj.weight": w(I_m, D), f"{p}mlp.experts.{e}.up_proj.weight": w(I_m, D),
                    f"{p}mlp.experts.{e}.down_proj.weight": w(D, I_m)}
        I_s = I_m * s["shared"]
        out |= {f"{p}mlp.shared_experts.gate_proj.weight": w(I_s, D), f"{p}mlp.shared_experts.up_proj.weight":
                w(I_s, D), f"{p}mlp.shared_experts.down_proj.weight": w(D, I_s)}
    return out


def write_deepseek_dir(path: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    """Two shards split by layer, with their index, as the published checkpoint is laid out."""
    path.mkdir(parents=True)
    first = {k: v for k, v in tensors.items() if k.startswith(("model.embed", "model.layers.0."))}
    rest = {k: v for k, v in tensors.items() if k not in first}
    files = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": rest}
    for name, part in files.items():
        save_file(part, str(path / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {k: name for name, part in files.items() for k in part}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory) -> Path:
    return write_deepseek_dir(tmp_path_factory.mktemp("hf") / "deepseek", deepseek_tensors(), deepseek_config())


def our_model(root: Path):
    family, fields = args_from_hf_config(json.loads((root / "config.json").read_text()))
    args = args_of(family, fields)
    model = (Llama3 if family == "llama3" else DeepSeekMoE)(args)
    model.init_weights(seed=123)
    return model, family, args


# ---------------------------------------------------------------------------------------------------------------
# Reference forward of DeepSeek-MoE in the published (Hugging Face) layout, written from its description: rotate-half
# RoPE on whole heads, softmax router over the experts, top-k weights not renormalised (norm_topk_prob false), the
# shared experts added, the first layer dense. Plain loops, no code of ours.


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _swiglu(x, t, p):
    return F.linear(F.silu(F.linear(x, t[p + "gate_proj.weight"])) * F.linear(x, t[p + "up_proj.weight"]),
                    t[p + "down_proj.weight"])


def reference_deepseek_logits(t: dict[str, torch.Tensor], c: dict, tokens: torch.Tensor) -> torch.Tensor:
    t = {k: v.float() for k, v in t.items()}
    B, T = tokens.shape
    D, H = c["hidden_size"], c["num_attention_heads"]
    C = D // H
    inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, C, 2, dtype=torch.float64) / C))
    angles = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
    cos, sin = torch.cat([angles.cos()] * 2, -1).float(), torch.cat([angles.sin()] * 2, -1).float()

    def rotate(x):  # [B, H, T, C]
        x1, x2 = x[..., : C // 2], x[..., C // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    h = t["model.embed_tokens.weight"][tokens]
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        x = _rms(h, t[p + "input_layernorm.weight"], c["rms_norm_eps"])
        q, k, v = (F.linear(x, t[f"{p}self_attn.{n}_proj.weight"]).view(B, T, H, C).transpose(1, 2) for n in "qkv")
        att = (rotate(q) @ rotate(k).transpose(-1, -2)) / math.sqrt(C)
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        h = h + F.linear((att @ v).transpose(1, 2).reshape(B, T, D), t[p + "self_attn.o_proj.weight"])
        x = _rms(h, t[p + "post_attention_layernorm.weight"], c["rms_norm_eps"])
        if layer < c["first_k_dense_replace"]:
            h = h + _swiglu(x, t, p + "mlp.")
            continue
        scores = F.linear(x, t[p + "mlp.gate.weight"]).softmax(-1)
        top_w, top_i = scores.topk(c["num_experts_per_tok"], dim=-1)
        routed = torch.zeros_like(x)
        for b in range(B):
            for s in range(T):
                for w, e in zip(top_w[b, s], top_i[b, s], strict=True):
                    routed[b, s] += w * _swiglu(x[b, s], t, f"{p}mlp.experts.{int(e)}.")
        h = h + routed + _swiglu(x, t, p + "mlp.shared_experts.")
    return F.linear(_rms(h, t["model.norm.weight"], c["rms_norm_eps"]), t["lm_head.weight"])


# ---------------------------------------------------------------------------------------------------------------
# Forward parity


def test_llama_import_gives_transformers_logits(llama_dir):
    from transformers import AutoModelForCausalLM

    assert (llama_dir / "model.safetensors.index.json").is_file()  # a sharded checkpoint
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    model, family, args = our_model(llama_dir)
    report = import_weights(model, llama_dir, family, args)
    assert report["tensors"] == 2 + 2 * 9 + 1 and "index_sha256" in report and "config_sha256" in report
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours, theirs = model(tokens), hf(tokens).logits
    assert theirs.abs().max() > 1.0  # weights large enough that the attention pattern matters
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    # the q/k permutation is what makes them agree: the same weights loaded without it do not
    with torch.no_grad():
        for layer in model.layers.values():
            layer.attention.wq.weight.copy_(hf.model.layers[int(layer.layer_id)].self_attn.q_proj.weight)
            layer.attention.wk.weight.copy_(hf.model.layers[int(layer.layer_id)].self_attn.k_proj.weight)
        assert (model(tokens) - theirs).abs().max() > 1e-2


def test_deepseek_import_gives_the_reference_forward(deepseek_dir):
    model, family, args = our_model(deepseek_dir)
    import_weights(model, deepseek_dir, family, args)
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    tensors = {**load_file(str(deepseek_dir / "model-00001-of-00002.safetensors")),
               **load_file(str(deepseek_dir / "model-00002-of-00002.safetensors"))}
    with torch.no_grad():
        ours = model(tokens)
    theirs = reference_deepseek_logits(tensors, deepseek_config(), tokens)
    assert theirs.abs().max() > 1.0
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# Round trips through our checkpoints


def checkpointed_run(run_dir: Path, init_from: Path) -> Path:
    """A run directory as a run leaves it: config.yaml of model=from_hf model.init_from=DIR and a step-0 checkpoint of
    the imported model."""
    job = JobConfig()
    job.model.name, job.model.init_from = "from_hf", str(init_from)
    resolve_from_hf(job)
    run_dir.mkdir(parents=True)
    (run_dir / RUN_CONFIG).write_text(yaml.safe_dump(to_dict(job)))
    model, family, args = our_model(init_from)
    import_weights(model, init_from, family, args)
    manager = CheckpointManager(run_dir / "checkpoints", rank=0, world_size=1)
    manager.save(0, model)
    manager.mark_good(0)
    return run_dir


def all_tensors(root: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(root.glob("*.safetensors")):
        out |= load_file(str(path))
    return out


def directory_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir())}


@pytest.mark.parametrize("source", ["llama", "deepseek"])
def test_import_checkpoint_export_reproduces_the_source_and_export_import_export_is_byte_identical(
        source, llama_dir, deepseek_dir, tmp_path):
    src = llama_dir if source == "llama" else deepseek_dir
    dtype = "float32" if source == "llama" else "bfloat16"  # the source's dtype
    run = checkpointed_run(tmp_path / "run", src)
    first = tmp_path / "export1"
    report = export_run(run, first, step="good", dtype=dtype, max_shard_bytes=40_000)
    assert report["step"] == 0 and report["shards"] > 1
    exported, original = all_tensors(first), all_tensors(src)
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    index = json.loads((first / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in first.glob("*.safetensors")}
    for shard in first.glob("*.safetensors"):  # within the limit, or one tensor larger than it alone
        members = load_file(str(shard))
        assert len(members) == 1 or sum(t.numel() * t.element_size() for t in members.values()) <= 40_000
    config = json.loads((first / "config.json").read_text())
    assert args_from_hf_config(config) == args_from_hf_config(json.loads((src / "config.json").read_text()))
    # export -> import -> export: the same bytes, every file
    second = tmp_path / "export2"
    export_run(checkpointed_run(tmp_path / "run2", first), second, step="0", dtype=dtype, max_shard_bytes=40_000)
    assert directory_bytes(second) == directory_bytes(first)


@pytest.mark.parametrize("tie", [False, True])
def test_export_loads_in_transformers_with_our_logits(tie, llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    src = make_llama_dir(tmp_path / "tied", shard_size=None, tie=True) if tie else llama_dir
    run = checkpointed_run(tmp_path / "run", src)
    out = tmp_path / "export"
    export_run(run, out, dtype="float32")
    assert ("lm_head.weight" in all_tensors(out)) is not tie  # a tied head is the embedding, stored once
    # the source's special token ids and generation settings come along (transformers' defaults would differ)
    source = json.loads((src / "config.json").read_text())
    exported = json.loads((out / "config.json").read_text())
    assert (exported["bos_token_id"], exported["eos_token_id"]) == (source["bos_token_id"], source["eos_token_id"]) \
        == (7, 9)
    assert json.loads((out / "generation_config.json").read_text()) == json.loads(
        (src / "generation_config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    model, family, args = our_model(src)
    import_weights(model, src, family, args)
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)


def test_export_carries_the_runs_tokenizer_files_and_its_end_of_text_id(llama_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(["def f(x): return x"] * 20, trainers.BpeTrainer(
        vocab_size=64, special_tokens=["<|endoftext|>", "<unk>"]))
    tokenizer.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>"}')
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "manifest.json").write_text(json.dumps({"tokenizer": {
        "kind": "huggingface", "path": str(tok_dir / "tokenizer.json"), "eos_id": 0}}))
    run = checkpointed_run(tmp_path / "run", llama_dir)
    config = yaml.safe_load((run / RUN_CONFIG).read_text())
    config["data"].update(name="tokenized", path=str(corpus), tokenizer=None)
    (run / RUN_CONFIG).write_text(yaml.safe_dump(config))
    out = tmp_path / "export"
    export_run(run, out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tok_dir / name).read_bytes()
    # the source's generation settings, with the run's tokenizer's end of text
    source = json.loads((llama_dir / "generation_config.json").read_text())
    assert json.loads((out / "generation_config.json").read_text()) == {**source, "eos_token_id": 0}
    assert not (out / "special_tokens_map.json").exists()


def test_export_refusals_name_what_to_change_and_write_nothing(llama_dir, tmp_path, capsys):
    run = checkpointed_run(tmp_path / "run", llama_dir)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    cases = [([str(run), "--out", str(taken)], "not empty"),
             ([str(run), "--out", str(tmp_path / "a"), "--step", "7"], "steps [0]"),
             ([str(tmp_path), "--out", str(tmp_path / "b")], "config.yaml")]
    for argv, needle in cases:
        assert export_main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("export error:") and needle in err and "\n" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "taken"]
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]


# ---------------------------------------------------------------------------------------------------------------
# Sharded import: 3 gloo ranks, so FSDP2's row splits fall inside heads and one rank holds no expert of 4; the Llama
# converted to FP8 with its weights all-gathered in fp8, as the default job's model


def _sharded_worker(rank: int, world: int, port: int, roots: list[str], out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from orchestration.training.distributed import init_weights_by_unit, parallelize

    with rank_process_group("gloo", f"tcp://127.0.0.1:{port}", rank, world):
        for i, root in enumerate(roots):
            family, fields = args_from_hf_config(json.loads((Path(root) / "config.json").read_text()))
            args = args_of(family, fields)
            with torch.device("meta"):
                model = (Llama3 if family == "llama3" else DeepSeekMoE)(args)
            fp8_all_gather = family == "llama3"  # the default job's FP8 model: Float8Linear weights gathered in fp8
            if fp8_all_gather:
                import fp8

                fp8.convert_to_fp8(model, "tensorwise")
            template = copy.deepcopy(model)
            model = parallelize(model, world, "fsdp", "float32", "float32", fp8_all_gather=fp8_all_gather)
            init_weights_by_unit(model, template, 0, torch.device("cpu"))
            report = import_weights(model, root, family, args)
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                torch.save({k: v.clone() for k, v in full.items()}, f"{out}/{i}.pt")
            torch.save(report["bytes_read"], f"{out}/{i}_bytes_{rank}.pt")


@pytest.mark.slow
def test_fsdp2_ranks_read_only_their_rows_and_assemble_the_whole_model(llama_dir, deepseek_dir, tmp_path):
    roots = [str(llama_dir), str(deepseek_dir)]
    mp.spawn(_sharded_worker, args=(3, free_port(), roots, str(tmp_path)), nprocs=3, join=True)
    for i, root in enumerate(roots):
        model, family, args = our_model(Path(root))
        single = import_weights(model, root, family, args)["bytes_read"]
        whole = model.state_dict()
        sharded = torch.load(tmp_path / f"{i}.pt", weights_only=True)
        for name, tensor in sharded.items():
            assert torch.equal(tensor, whole[name]), name
        # the ranks' reads add up to one model's worth of rows (q/k reads round up to whole heads at the cuts)
        per_rank = [torch.load(tmp_path / f"{i}_bytes_{r}.pt", weights_only=True) for r in range(3)]
        assert max(per_rank) < 0.5 * single
        assert single <= sum(per_rank) <= 1.1 * single


# ---------------------------------------------------------------------------------------------------------------
# Bad input: refused when the config is loaded (before Ray, before the run directory), naming the file or tensor


def _job(init_from: Path, model: str = "from_hf") -> dict:
    return {"model": {"name": model, "init_from": str(init_from)}, "logging": {"wandb": False}}


def _damaged_copies(deepseek_dir: Path, tmp_path: Path) -> list[tuple[Path, str, str]]:
    """(directory, model, text the error must name) per kind of damage."""
    cases = []

    def copy(name: str) -> Path:
        dst = tmp_path / name
        dst.mkdir()
        for p in deepseek_dir.iterdir():
            (dst / p.name).write_bytes(p.read_bytes())
        return dst

    d = copy("missing_shard")
    (d / "model-00002-of-00002.safetensors").unlink()
    cases.append((d, "from_hf", "model-00002-of-00002.safetensors"))
    d = copy("truncated")
    data = (d / "model-00002-of-00002.safetensors").read_bytes()
    (d / "model-00002-of-00002.safetensors").write_bytes(data[: len(data) // 2])
    cases.append((d, "from_hf", "truncated"))
    d = copy("index_names_absent_file")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00003-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    cases.append((d, "from_hf", "model-00003-of-00003.safetensors"))
    d = copy("shape_mismatch")
    tensors = deepseek_tensors()
    tensors["model.layers.2.mlp.experts.3.down_proj.weight"] = torch.zeros(64, 16, dtype=torch.bfloat16)
    for p in d.iterdir():
        p.unlink()
    d.rmdir()
    write_deepseek_dir(d, tensors, deepseek_config())
    cases.append((d, "from_hf", "model.layers.2.mlp.experts.3.down_proj.weight"))
    d = copy("wrong_architecture")
    (d / "config.json").write_text(json.dumps({**deepseek_config(), "architectures": ["MixtralForCausalLM"]}))
    cases.append((d, "from_hf", "MixtralForCausalLM"))
    cases.append((deepseek_dir, "debug_dense", "deepseek_moe model, not llama3"))
    cases.append((deepseek_dir, "debug_moe", "config.json hidden_size=64 but the model has dim=128"))
    return cases


def test_bad_checkpoint_directories_are_config_errors_naming_the_file_or_tensor(deepseek_dir, tmp_path):
    for root, model, needle in _damaged_copies(deepseek_dir, tmp_path):
        with pytest.raises(ConfigError, match="^model.init_from: ") as info:
            load_job_config(_job(root, model))
        assert needle in str(info.value), (root.name, str(info.value))
    with pytest.raises(ConfigError, match="model.init_from: model=from_hf takes the architecture"):
        load_job_config({"model": {"name": "from_hf"}})
    with pytest.raises(ConfigError, match="checkpoint.export_hf: final exports"):
        load_job_config({**_job(deepseek_dir), "checkpoint": {"export_hf": "final", "every_steps": 0}})
    # a good directory passes, resolved to the family's preset with config.json's architecture
    job = load_job_config(_job(deepseek_dir))
    assert job.model.name == "deepseek_moe16b" and job.model.overrides["n_routed_experts"] == 4


@pytest.mark.slow
def test_launch_refuses_a_truncated_checkpoint_with_exit_2_before_ray(deepseek_dir, tmp_path, isolated_env):
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for p in deepseek_dir.iterdir():
        (damaged / p.name).write_bytes(p.read_bytes())
    shard = damaged / "model-00001-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    runs = tmp_path / "runs"
    proc = subprocess.run([sys.executable, str(REPO / "launch.py"), "model=from_hf", f"model.init_from={damaged}",
                           f"run_root={runs}", "run_name=x"], capture_output=True, text=True, cwd=REPO,
                          env=isolated_env, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("config error: model.init_from: ") and shard.name in lines[0]
    assert "truncated" in lines[0]
    assert not runs.exists()
