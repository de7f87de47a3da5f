"""Tokenizers a corpus is prepared with: bytes, or a Hugging Face tokenizer.json.

A tokenizer here is what orchestration.data.prepare needs (text -> ids, the id that ends a document) and what a run
needs to size the model (vocab_size) and to refuse a corpus of another tokenizer (sha256). The `tokenizers` library
loads the tokenizer.json that Llama 3 and DeepSeek checkpoints ship and that orchestration.data.train_tokenizer writes.

tiktoken's .tiktoken files are not taken: such a file holds the merge ranks only, not the pre-tokenization pattern
nor the special tokens, so it does not define a tokenizer by itself (convert it to a tokenizer.json first, e.g. with
transformers' `convert_tiktoken_to_fast`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

BYTES = "bytes"

# The FP8 GEMMs need both sizes of the output head to be multiples of 16 (fp8/head.py and
# fp8.convert.require_fp8_output_head): a debug model's vocabulary is the tokenizer's rounded up.
VOCAB_MULTIPLE = 16

# Special tokens that end a document, in the order they are looked for: GPT-2 style BPE (and the tokenizers this
# project trains), Llama 3, DeepSeek (written with escapes: the repository is ASCII), SentencePiece conversions.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "</s>", "<eos>")


class TokenizerError(ValueError):
    """A tokenizer that cannot be used; the message names the file and what to change."""


def padded_vocab_size(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    """The smallest multiple of `multiple` that holds `vocab_size` ids."""
    return -(-vocab_size // multiple) * multiple


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, and 256 as the end of a document: the byte stream's alphabet plus the separator a
    prepared corpus needs. Exact round trip for any text."""

    kind = BYTES
    vocab_size = 257
    eos_id = 256
    eos_token = "<eos>"
    path = BYTES
    # The definition above is the whole tokenizer; its digest names it and its version.
    sha256 = hashlib.sha256(b"elastic-fp8 bytes tokenizer: utf-8 bytes 0..255, eos 256").hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i != self.eos_id).decode("utf-8")


class HuggingFaceTokenizer:
    """A tokenizer.json loaded with the `tokenizers` library. Documents are encoded without the post-processor's
    special tokens (no BOS per document): the corpus separates documents with the EOS id only."""

    kind = "huggingface"

    def __init__(self, path: Path, eos_token: str | None = None):
        from tokenizers import Tokenizer

        self.path = str(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise TokenizerError(f"cannot read tokenizer file {path}: {exc.strerror or exc}") from None
        try:
            self._tok = Tokenizer.from_str(data.decode("utf-8"))
        except Exception as exc:  # noqa: BLE001 - the library raises plain Exception subclasses from Rust
            raise TokenizerError(f"{path} is not a Hugging Face tokenizer.json the `tokenizers` library can load "
                                 f"({type(exc).__name__}: {str(exc)[:200]}); pass a tokenizer.json or 'bytes'") \
                from None
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        candidates = (eos_token,) if eos_token else EOS_CANDIDATES
        found = [(t, self._tok.token_to_id(t)) for t in candidates if self._tok.token_to_id(t) is not None]
        if not found:
            hint = (f"has no token {eos_token!r}" if eos_token else
                    f"has none of the end-of-document tokens {', '.join(EOS_CANDIDATES)}")
            raise TokenizerError(f"tokenizer {path} {hint}: name its end-of-document token with --eos-token")
        self.eos_token, self.eos_id = found[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [enc.ids for enc in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


Tokenizer = ByteTokenizer | HuggingFaceTokenizer


def load_tokenizer(spec: str, eos_token: str | None = None) -> Tokenizer:
    """`bytes`, or the path of a Hugging Face tokenizer.json. Raises TokenizerError naming the file."""
    if spec == BYTES:
        if eos_token is not None:
            raise TokenizerError("the bytes tokenizer's end of document is fixed (id 256); drop --eos-token")
        return ByteTokenizer()
    path = Path(spec)
    if not path.is_file():
        raise TokenizerError(f"tokenizer {spec!r} is neither 'bytes' nor an existing tokenizer.json file")
    if path.suffix == ".tiktoken" or path.name.endswith(".model"):
        raise TokenizerError(f"{path}: only Hugging Face tokenizer.json files are supported (a .tiktoken or "
                             "SentencePiece .model file lacks the pre-tokenizer or special tokens it needs); convert "
                             "it to tokenizer.json, e.g. with transformers' PreTrainedTokenizerFast.save_pretrained")
    return HuggingFaceTokenizer(path, eos_token)
