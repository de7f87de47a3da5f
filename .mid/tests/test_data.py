import torch

from orchestration.data.byte_stream import ByteTextDataset, collect_text_files, python_stdlib_dir


def make_dataset(seed=7):
    files = collect_text_files(python_stdlib_dir(), "*.py", 50)
    return ByteTextDataset(files, seq_len=64, seed=seed)


def test_sample_is_pure_function_of_seed_and_index():
    a, b = make_dataset(), make_dataset()
    for i in (0, 1, 12345):
        assert torch.equal(a.sample(i), b.sample(i))
    assert not torch.equal(a.sample(0), a.sample(1))
    assert not torch.equal(a.sample(0), make_dataset(seed=8).sample(0))


def test_batch_targets_are_next_bytes_of_real_text():
    ds = make_dataset()
    inputs, targets = ds.batch(10, 14)
    assert inputs.shape == targets.shape == (4, 64)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    text = bytes(inputs[0].tolist())
    assert sum(c < 128 for c in text) > 60  # ASCII source text, not noise


def test_every_byte_of_the_corpus_can_be_sampled(tmp_path):
    """With a corpus of seq_len + 2 bytes both window starts occur, so the last byte is a target."""
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(bytes(range(10, 76)))  # 66 bytes = seq_len 64 + 2
    ds = ByteTextDataset([corpus], seq_len=64, seed=0)
    assert ds.window_rule == 2
    assert {int(ds.sample(i)[0]) - 10 for i in range(200)} == {0, 1}
