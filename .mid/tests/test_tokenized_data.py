"""Tokenizers, corpus preparation and the tokenized dataset, with real parts: a BPE tokenizer trained here with the
`tokenizers` library on Python standard library sources, corpora prepared by the command itself (in a subprocess
where exit codes, stderr and interruption matter), shards read back through memory maps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from orchestration.data import prepare as prepare_mod
from orchestration.data.prepare import in_validation, token_dtype
from orchestration.data.shard_digest import VERIFIED_FILE
from orchestration.data.shards import CorpusError, TokenizedDataset, load_manifest, sample_location, window_start
from orchestration.data.tokenizer import ByteTokenizer, TokenizerError, load_tokenizer, padded_vocab_size
from orchestration.data.train_tokenizer import EOS_TOKEN
from orchestration.training.elastic import plan_batch

REPO = Path(__file__).resolve().parent.parent
STDLIB = Path(sysconfig.get_paths()["stdlib"])
# A few packages of the standard library: ~0.5 MB of real Python and reST text, UTF-8, present on every machine.
CORPUS_DIRS = [STDLIB / "json", STDLIB / "email", STDLIB / "logging", STDLIB / "importlib"]


def run_module(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, check=False)


def prepare_cli(*args: str) -> subprocess.CompletedProcess:
    return run_module("orchestration.data.prepare", *args)


def tree_bytes(root: Path) -> dict[str, bytes]:
    """The corpus's bytes; not its verified-shards marker, which records this machine's file identities."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != VERIFIED_FILE}


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Path:
    """A 1024-entry byte-level BPE tokenizer trained by the command on the corpus directories."""
    out = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    proc = run_module("orchestration.data.train_tokenizer", "--input", *map(str, CORPUS_DIRS), "--vocab-size",
                      "1024", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="module")
def corpus(bpe, tmp_path_factory) -> Path:
    """The corpus directories prepared by the command with 2 processes and small shards (several per split)."""
    out = tmp_path_factory.mktemp("corpus") / "prepared"
    proc = prepare_cli("--input", *map(str, CORPUS_DIRS), "--tokenizer", str(bpe), "--out", str(out),
                       "--val-fraction", "0.1", "--workers", "2", "--shard-tokens", "40000")
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stderr  # the progress line
    return out


def split_documents(ids: np.ndarray, eos: int) -> list[np.ndarray]:
    cuts = np.flatnonzero(ids == eos) + 1
    assert cuts[-1] == len(ids), "every document ends with the EOS id"
    return np.split(ids, cuts)[:-1]


def test_trained_tokenizer_loads_with_its_eos_and_round_trips_any_text(bpe):
    tok = load_tokenizer(str(bpe))
    assert tok.vocab_size == 1024 and tok.eos_id == 0 and tok.eos_token == EOS_TOKEN
    text = 'def f(x):\n    return {"a": x}  # \u00e9t\u00e9 \u2603 tabs\tand  spaces\n\n'
    ids = tok.encode_batch([text])[0]
    assert len(ids) < len(text.encode()) / 1.5  # merges learned from Python source compress it
    assert tok.decode(ids) == text


def test_byte_tokenizer_round_trip_and_padded_vocab():
    tok = ByteTokenizer()
    text = "caf\u00e9 \u2603\n"
    ids = tok.encode_batch([text])[0]
    assert ids == list(text.encode("utf-8")) and tok.decode(ids + [tok.eos_id]) == text
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    assert [padded_vocab_size(v) for v in (256, 257, 1024, 32000, 32001)] == [256, 272, 1024, 32000, 32016]
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_prepared_corpus_decodes_to_its_documents_and_split_is_whole_documents(bpe, corpus):
    manifest = load_manifest(corpus)
    tok = load_tokenizer(str(bpe))
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == 1024 and manifest["eos_id"] == tok.eos_id
    assert manifest["tokenizer"]["sha256"] == tok.sha256
    texts = [Path(s["path"]).read_text() for s in manifest["sources"]]
    assert sum(s["bytes"] for s in manifest["sources"]) == sum(len(t.encode()) for t in texts)
    for split in ("train", "val"):
        entry = manifest["splits"][split]
        ids = np.concatenate([np.fromfile(corpus / s["file"], dtype="<u2") for s in entry["shards"]])
        docs = split_documents(ids, tok.eos_id)
        expected = [t for t in texts if t and in_validation(t, 0.1) == (split == "val")]
        assert len(docs) == len(expected) == entry["documents"] > 0
        assert [tok.decode(d[:-1].tolist()) for d in docs] == expected
        assert entry["tokens"] == len(ids) == sum(s["tokens"] for s in entry["shards"])
        for shard in entry["shards"]:
            shard_ids = np.fromfile(corpus / shard["file"], dtype="<u2")
            assert int((shard_ids == tok.eos_id).sum()) == shard["documents"]  # shards cut between documents
    assert len(manifest["splits"]["train"]["shards"]) > 2
    assert 0.02 < manifest["splits"]["val"]["documents"] / len(texts) < 0.25  # about --val-fraction 0.1


def test_rerun_and_process_count_give_identical_bytes(bpe, corpus, tmp_path):
    args = ["--input", *map(str, CORPUS_DIRS), "--tokenizer", str(bpe), "--val-fraction", "0.1",
            "--shard-tokens", "40000"]
    again = prepare_cli(*args, "--out", str(corpus), "--workers", "2")
    assert again.returncode == 0 and "already prepared" in again.stderr
    one_process = tmp_path / "one"
    assert prepare_cli(*args, "--out", str(one_process), "--workers", "1").returncode == 0
    assert tree_bytes(one_process) == tree_bytes(corpus)
    other = prepare_cli(*[a if a != "0.1" else "0.2" for a in args], "--out", str(corpus), "--workers", "1")
    assert other.returncode == 2 and "val_fraction (saved 0.1, now 0.2)" in other.stderr


def test_killed_prepare_continues_to_the_same_bytes(bpe, tmp_path):
    """SIGKILL in the middle (after some files' completion markers), then the same command: the result equals a run
    that was never interrupted, and the files done before the kill were not tokenized again."""
    # Packages every Python has (Debian's and Ubuntu's python3 leave the stdlib's test package out).
    inputs = [str(STDLIB / "email"), str(STDLIB / "asyncio"), str(STDLIB / "json")]
    args = ["--input", *inputs, "--tokenizer", str(bpe), "--val-fraction", "0.1", "--workers", "1"]
    out = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, "-m", "orchestration.data.prepare", *args, "--out", str(out)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while len(list((out / ".parts").glob("*.done.json"))) < 5 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be interrupted"
    done_before = len(list((out / ".parts").glob("*.done.json")))
    assert done_before >= 5 and not (out / "manifest.json").exists()  # nothing claimed complete
    resumed = prepare_cli(*args, "--out", str(out))
    assert resumed.returncode == 0, resumed.stderr
    assert f"continuing an interrupted preparation: {done_before} of" in resumed.stderr
    one_shot = tmp_path / "one_shot"
    assert prepare_cli(*args, "--out", str(one_shot)).returncode == 0
    assert tree_bytes(out) == tree_bytes(one_shot) and not (out / ".parts").exists()


def test_failed_file_stops_without_manifest_and_same_settings_continue(bpe, tmp_path):
    """A non-UTF-8 file stops the run naming it; the files done before stay done, and once the file is fixed (same
    size) the same command finishes to the bytes of a clean run."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"doc{i}.txt").write_text(f"document {i}: " + "some words of text " * (20 + i))
    bad = src / "doc3.txt"
    good_bytes = bad.read_bytes()
    bad.write_bytes(good_bytes[:5] + b"\xff" + good_bytes[6:])
    args = ["--input", str(src), "--tokenizer", str(bpe), "--val-fraction", "0.3", "--workers", "1"]
    failed = prepare_cli(*args, "--out", str(tmp_path / "out"))
    assert failed.returncode == 2 and f"{bad} is not UTF-8 text" in failed.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert len(list((tmp_path / "out" / ".parts").glob("*.done.json"))) == 3  # doc0..doc2, before the bad file
    bad.write_bytes(good_bytes)
    resumed = prepare_cli(*args, "--out", str(tmp_path / "out"))
    assert resumed.returncode == 0 and "3 of 6 files already tokenized" in resumed.stderr
    assert prepare_cli(*args, "--out", str(tmp_path / "clean")).returncode == 0
    assert tree_bytes(tmp_path / "out") == tree_bytes(tmp_path / "clean")


def test_bad_inputs_name_the_file_and_claim_nothing(bpe, tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "first document"}) + "\n" + json.dumps({"body": "no text field"}) + "\n")
    proc = prepare_cli("--input", str(docs), "--tokenizer", str(bpe), "--out", str(tmp_path / "a"))
    assert proc.returncode == 2 and f"{docs}:2: no field 'text' (has ['body']); set --text-field" in proc.stderr
    assert not (tmp_path / "a" / "manifest.json").exists()

    garbage = tmp_path / "tokenizer.json"
    garbage.write_text("{not json")
    proc = prepare_cli("--input", str(docs), "--tokenizer", str(garbage), "--out", str(tmp_path / "b"))
    assert proc.returncode == 2 and f"{garbage} is not a Hugging Face tokenizer.json" in proc.stderr
    assert not (tmp_path / "b").exists()  # refused before anything was written

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    (empty / "b.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    proc = prepare_cli("--input", str(empty), "--tokenizer", str(bpe), "--out", str(tmp_path / "c"))
    assert proc.returncode == 2 and "no document for training (2 files, 2 empty documents" in proc.stderr
    assert not (tmp_path / "c" / "manifest.json").exists()

    proc = prepare_cli("--input", str(tmp_path / "missing"), "--tokenizer", str(bpe), "--out", str(tmp_path / "d"))
    assert proc.returncode == 2 and "missing' does not exist" in proc.stderr

    with pytest.raises(TokenizerError, match="--eos-token"):
        load_tokenizer(str(bpe), eos_token="<|not-there|>")


def test_skip_bad_files_lists_them_in_the_manifest(bpe, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "good.txt").write_text("plain text " * 50)
    (src / "latin1.txt").write_bytes("caf\u00e9 ".encode("latin-1") * 20)
    out = tmp_path / "out"
    proc = prepare_cli("--input", str(src), "--tokenizer", str(bpe), "--out", str(out), "--val-fraction", "0",
                       "--skip-bad-files")
    assert proc.returncode == 0, proc.stderr
    manifest = load_manifest(out)
    assert [s["path"] for s in manifest["skipped_sources"]] == [str(src / "latin1.txt")]
    assert "not UTF-8" in manifest["skipped_sources"][0]["reason"]
    assert manifest["splits"]["train"]["documents"] == 1 and manifest["splits"]["val"]["tokens"] == 0


def test_jsonl_and_parquet_inputs_round_trip(bpe, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"record {i}: " + "value = compute(x, y)\n" * (3 + i % 4) for i in range(40)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in texts[:20]))
    pq.write_table(pa.table({"content": texts[20:], "id": list(range(20))}), tmp_path / "b.parquet")
    out = tmp_path / "out"
    proc = prepare_cli("--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet"), "--tokenizer", str(bpe),
                       "--out", str(out), "--text-field", "content", "--val-fraction", "0.2", "--workers", "2")
    assert proc.returncode == 0, proc.stderr
    manifest = load_manifest(out)
    tok = load_tokenizer(str(bpe))
    decoded = {}
    for split in ("train", "val"):
        ids = np.concatenate([np.fromfile(out / s["file"], dtype="<u2") for s in manifest["splits"][split]["shards"]])
        decoded[split] = [tok.decode(d[:-1].tolist()) for d in split_documents(ids, tok.eos_id)]
    assert decoded["train"] == [t for t in texts if not in_validation(t, 0.2)]
    assert decoded["val"] == [t for t in texts if in_validation(t, 0.2)] and decoded["val"]
    assert [s["documents"] for s in manifest["sources"]] == [20, 20]


def test_sample_windows_are_pure_and_cross_shard_boundaries(corpus):
    ds = TokenizedDataset(corpus, seq_len=64, seed=7)
    stream = np.concatenate([np.fromfile(corpus / s["file"], dtype="<u2")
                             for s in ds.manifest["splits"]["train"]["shards"]]).astype(np.int64)
    ends = np.cumsum(ds.train.shard_tokens)
    crossing = 0
    for i in range(400):
        start = window_start(i, 7, 64, len(stream))
        assert 0 <= start <= len(stream) - 65
        shard, offset = sample_location(i, 7, 64, ds.train.shard_tokens)
        assert (ends[shard - 1] if shard else 0) + offset == start and offset < ds.train.shard_tokens[shard]
        assert torch.equal(ds.sample(i), torch.from_numpy(stream[start:start + 65]))
        crossing += int(offset + 65 > ds.train.shard_tokens[shard])
    assert crossing > 0  # some windows ran into the next shard and still read the right tokens
    assert torch.equal(TokenizedDataset(corpus, 64, 7).sample(123), ds.sample(123))
    assert not torch.equal(TokenizedDataset(corpus, 64, 8).sample(123), ds.sample(123))


def test_global_batch_is_the_same_at_every_world_size(corpus):
    """What each rank reads for a step, put back together, is the step's global batch at any world size (1..5), and
    a resize mid-run (4 -> 3 -> 5 -> 2 workers) continues with exactly the samples not read yet."""
    ds = TokenizedDataset(corpus, seq_len=32, seed=3)
    global_batch = 13
    reference = ds.batch(0, global_batch * 6)[0]
    for world_sizes in ([1] * 6, [2] * 6, [4, 4, 3, 5, 5, 2], [5, 1, 3, 2, 4, 3]):
        cursor, rows = 0, []
        for world in world_sizes:
            plan = plan_batch(global_batch, 4, world)
            for rank in range(world):
                for micro in range(plan.grad_accum):
                    lo, hi = plan.sample_slice(rank, micro)
                    if hi > lo:
                        rows.append(ds.batch(cursor + lo, cursor + hi)[0])
            cursor += global_batch
        assert torch.equal(torch.cat(rows), reference)


def test_validation_sequences_are_fixed_consecutive_windows(corpus):
    ds = TokenizedDataset(corpus, seq_len=64, seed=0)
    val = np.concatenate([np.fromfile(corpus / s["file"], dtype="<u2")
                          for s in ds.manifest["splits"]["val"]["shards"]]).astype(np.int64)
    capacity = ds.validation_capacity()
    assert capacity == (len(val) - 1) // 64 and capacity > 8
    inputs, targets = ds.validation_batch(2, 5)
    assert torch.equal(inputs, torch.from_numpy(val[128:320].reshape(3, 64)))
    assert torch.equal(targets, torch.from_numpy(val[129:321].reshape(3, 64)))
    with pytest.raises(CorpusError, match="lower data.eval_sequences"):
        ds.validation_batch(0, capacity + 1)


def test_corpus_errors_say_what_to_do(corpus, tmp_path):
    with pytest.raises(CorpusError, match="has no manifest.json"):
        TokenizedDataset(tmp_path, 64, 0)
    copy = tmp_path / "copy"
    copy.mkdir()
    for name, data in tree_bytes(corpus).items():
        (copy / name).write_bytes(data)
    shard = copy / "train_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(CorpusError, match="train_00001.bin is .* bytes, the manifest says"):
        TokenizedDataset(copy, 64, 0)
    os.remove(shard)
    with pytest.raises(CorpusError, match="train_00001.bin is missing"):
        load_manifest(copy)


def test_prepare_helps():
    proc = prepare_cli("--help")
    assert proc.returncode == 0
    for option in ("--input", "--tokenizer", "--out", "--val-fraction", "--workers", "--text-field"):
        assert option in proc.stdout
    assert prepare_mod.MANIFEST_FILE == "manifest.json"


def test_byte_stream_holds_out_the_files_after_max_files(tmp_path):
    """data=stdlib: training reads the first data.max_files files (sorted), evaluation windows come from the files
    after them, consecutive from the first; a one-file source has no held-out data."""
    from orchestration.data.select import build_datasets
    from orchestration.validation import from_dict

    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"f{i}.py").write_text(f"# file {i}\n" + f"x{i} = {i}\n" * 40)
    job = from_dict({"data": {"source": str(src), "max_files": 3, "seq_len": 16, "eval_sequences": 4}})
    train, held_out = build_datasets(job)
    train_bytes = b"\n".join((src / f"f{i}.py").read_bytes() for i in range(3))
    assert train.corpus.tobytes() == train_bytes and train.vocab_size == 256
    assert held_out.files == [src / "f3.py"]  # enough for 4 windows of 16 + 1 bytes: f4 is not read
    inputs, targets = held_out.validation_batch(1, 3)
    expected = np.frombuffer((src / "f3.py").read_bytes(), dtype=np.uint8).astype(np.int64)
    assert torch.equal(inputs, torch.from_numpy(expected[16:48].reshape(2, 16)))
    assert torch.equal(targets, torch.from_numpy(expected[17:49].reshape(2, 16)))
    one_file = from_dict({"data": {"source": str(src / "f0.py"), "seq_len": 16}})
    assert build_datasets(one_file)[1] is None


def test_a_validation_split_smaller_than_eval_sequences_is_used_whole_and_said_once(corpus, caplog):
    """A small corpus's held-out split (fewer sequences than data.eval_sequences) is evaluated whole, not refused;
    the config records how many, and one warning says so. An empty split is still refused."""
    import logging

    from orchestration.config import ConfigError
    from orchestration.data.select import resolve_data
    from orchestration.validation import from_dict

    capacity = TokenizedDataset(corpus, seq_len=64, seed=0).validation_capacity()
    job = from_dict({"data": {"name": "tokenized", "path": str(corpus), "tokenizer": None, "seq_len": 64,
                              "eval_sequences": capacity + 50}})
    with caplog.at_level(logging.WARNING, logger="orchestration.data.select"):
        resolve_data(job)
    assert job.data.eval_sequences == capacity
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"evaluating on all {capacity}" in warnings[0]
    too_long = from_dict({"data": {"name": "tokenized", "path": str(corpus), "tokenizer": None,
                                   "seq_len": 64 * (capacity + 2), "eval_sequences": 4},
                          "model": {"overrides": {"max_seq_len": 64 * (capacity + 2)}}})
    with pytest.raises(ConfigError, match="holds no sequence"):
        resolve_data(too_long)
