"""Print where an inductor-generated Triton kernel comes from: its source-node comment and its header.

    python3 benchmarks/inductor_kernel_source.py <kernel-name-substring> [--cache-dir DIR]

Profiles name inductor kernels after the aten ops they fuse (triton_per_fused_..._select_backward_...), which does
not say which model code produced them; inductor writes that mapping as comments above each kernel in the files of
its cache. Used to find the slow fused kernel of a profile (BENCHMARKS.md, end-to-end section).
"""

from __future__ import annotations

import argparse
import getpass
import os
import pathlib
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--cache-dir", default=os.environ.get("TORCHINDUCTOR_CACHE_DIR")
                    or os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
    ap.add_argument("--lines", type=int, default=40)
    args = ap.parse_args()
    seen = 0
    for path in pathlib.Path(args.cache_dir).rglob("*.py"):
        text = path.read_text(errors="replace")
        at = text.find(f"async_compile.triton('{args.name}")
        if at < 0:
            continue
        # The graph's output code: comments naming the source nodes sit right above each kernel's definition.
        block_start = text.rfind("\n\n", 0, at)
        comments = [ln for ln in text[block_start:at].splitlines() if ln.lstrip().startswith("#")]
        print(f"== {path}")
        print("\n".join(comments)[-4000:])
        body = text[at:].splitlines()
        print("\n".join(ln for ln in body[: args.lines * 3] if "numel" in ln or "def " in ln or "tl.load" in ln)[:3000])
        seen += 1
        if seen >= 2:
            break
    if not seen:
        print(f"no kernel named like {args.name!r} under {args.cache_dir}")


if __name__ == "__main__":
    main()
