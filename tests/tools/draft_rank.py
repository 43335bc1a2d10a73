"""Write engine/draft_pieces.json, the text counts the draft vocabulary is ranked by
(engine/draft_vocab.py). Run it from the repository root, then commit the file:

    PYTHONPATH=tests python -m tools.draft_rank

The text: tools/draft_text.txt (chat answers, code in several languages, Markdown, math and a few
other languages), the bundled chat template, and the Python sources of engine/ and kernels/ as they
are when this runs (English comments and code). The engine reads only the written counts, so
editing a source file changes nothing until this is run again.

No tokenizer is involved, so one file serves every checkpoint. The text is cut where a Qwen-style
pre-tokenizer cuts (tools/bpe.py SPLIT_PATTERN: before a word, between digits, around punctuation
and whitespace runs), and each distinct piece is written with how often it occurs. A byte-level BPE
never merges across its pre-tokenizer's cuts, so with a tokenizer that cuts at least there (Qwen's,
the demo's, the tests') encoding each piece and counting its tokens that many times gives the
counts of encoding the whole text.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from tokenizers import Regex, pre_tokenizers

from tools.bpe import SPLIT_PATTERN

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "engine" / "draft_pieces.json"
COMMAND = "PYTHONPATH=tests python -m tools.draft_rank"


def sources(root: Path = ROOT) -> list[Path]:
    """The files the counts come from (module docstring), in a fixed order."""
    files = [Path(__file__).with_name("draft_text.txt"), root / "engine" / "chat_template.jinja"]
    for folder in ("engine", "kernels"):
        files += sorted((root / folder).glob("*.py"))
    return files


def count_pieces(texts: list[str]) -> Counter:
    """Each distinct pre-tokenizer piece of `texts` and how often it occurs."""
    split = pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated")
    counts: Counter = Counter()
    for text in texts:
        counts.update(piece for piece, _ in split.pre_tokenize_str(text))
    return counts


def write(out: Path, counts: Counter, files: list[str]) -> None:
    # most frequent first, one piece a line: a regenerated file diffs by the pieces that moved
    pieces = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    body = json.dumps({"command": COMMAND, "files": files, "pieces": pieces}, ensure_ascii=False, indent=0)
    out.write_text(body + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    files = sources()
    counts = count_pieces([f.read_text(encoding="utf-8") for f in files])
    write(args.out, counts, [f.relative_to(ROOT).as_posix() for f in files])
    print(f"wrote {args.out}: {len(counts):,} pieces, {sum(counts.values()):,} in all, from {len(files)} files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
