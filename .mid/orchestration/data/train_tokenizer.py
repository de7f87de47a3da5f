"""Train a byte-level BPE tokenizer on a corpus and save it as a Hugging Face tokenizer.json.

    python -m orchestration.data.train_tokenizer --input /usr/lib/python3.11 --vocab-size 32768 --out tok.json

Byte-level (GPT-2 / Llama 3 style): every text encodes, nothing is unknown, and decoding gives the text back exactly.
The end-of-document token <|endoftext|> is the first id after the merges' alphabet is fixed (id 0).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

from orchestration.data.sources import DEFAULT_EXCLUDE, DEFAULT_INCLUDE, SourceError, find_sources, read_documents

EOS_TOKEN = "<|endoftext|>"
LOG = logging.getLogger("orchestration.data.train_tokenizer")


def train_bpe(documents: Iterator[str], vocab_size: int, min_frequency: int = 2):
    """A byte-level BPE tokenizer of `vocab_size` entries (the EOS token and the 256 byte symbols included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + 2:
        raise ValueError(f"--vocab-size {vocab_size} is below the 256 byte symbols plus the EOS token and a merge")
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False and no normalizer: decode(encode(text)) == text for every text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestration.data.train_tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="files, directories or glob patterns")
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--out", required=True, help="path of the tokenizer.json to write")
    parser.add_argument("--text-field", default="text", help="field of .jsonl lines / column of .parquet files")
    parser.add_argument("--include", nargs="+", default=list(DEFAULT_INCLUDE),
                        help="patterns of the files read from directory inputs")
    parser.add_argument("--exclude", nargs="+", default=list(DEFAULT_EXCLUDE),
                        help="names (or patterns) of directories not searched below directory inputs, e.g. "
                             "site-packages")
    parser.add_argument("--min-frequency", type=int, default=2, help="pairs seen fewer times are not merged")
    parser.add_argument("--skip-bad-files", action="store_true",
                        help="leave out files that cannot be read (named in a warning) instead of stopping")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    try:
        sources = find_sources(args.input, tuple(args.include), tuple(args.exclude))
    except SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    skipped: list[str] = []

    def documents() -> Iterator[str]:
        for source in sources:
            try:
                texts = list(read_documents(source, args.text_field))
            except SourceError as exc:
                if not args.skip_bad_files:
                    raise
                LOG.warning("skipped: %s", exc)
                skipped.append(str(source.path))
                continue
            yield from (t for t in texts if t)

    out = Path(args.out)
    try:
        tokenizer = train_bpe(documents(), args.vocab_size, args.min_frequency)
    except (SourceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if tokenizer.get_vocab_size() < args.vocab_size:
        LOG.warning("the corpus yields %d entries, fewer than --vocab-size %d", tokenizer.get_vocab_size(),
                    args.vocab_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tokenizer.save(str(tmp))
    tmp.replace(out)
    LOG.info("wrote %s: %d entries from %d files (%d skipped), end of document %s = id %d", out,
             tokenizer.get_vocab_size(), len(sources) - len(skipped), len(skipped), EOS_TOKEN,
             tokenizer.token_to_id(EOS_TOKEN))
    return 0


if __name__ == "__main__":
    sys.exit(main())
