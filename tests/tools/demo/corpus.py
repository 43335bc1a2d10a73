"""The demo model's training text: the source of Python's own standard library (PSF licence).

Every .py file under the running Python's standard library, tests and data tables left out, in
sorted order; a fixed few percent of the files (by a hash of their path) is held out for
evaluation. Besides the raw files the corpus holds chat turns built from the same files (the user
gives a function's docstring, the assistant thinks one line and writes the function), in the exact
token layout of the chat template.
"""
from __future__ import annotations

import ast
import hashlib
import random
import sys
import sysconfig
import textwrap
from pathlib import Path

import torch

from mtpchat.engine.tokenizer import Tokenizer
from tools.bpe import train_tokenizer

SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "encodings", "pydoc_data", "__pycache__",
             "lib-dynload", "ensurepip", "__phello__"}
HELDOUT_PERCENT = 4


# --- corpus ----------------------------------------------------------------------------------------

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[str]:
    """Relative paths of the library's own .py files, sorted; tests, vendored packages, codec tables
    and the generated sysconfig data left out."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p in SKIP_DIRS or p.startswith("config-") for p in rel.parts[:-1]):
            continue
        if rel.name.startswith("_sysconfigdata"):
            continue
        out.append(rel.as_posix())
    return out


def is_heldout(rel: str) -> bool:
    # by path, not by position: the same files stay out whatever else a Python version ships
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 100 < HELDOUT_PERCENT


def read(root: Path, rel: str) -> str:
    return (root / rel).read_text(encoding="utf-8", errors="replace")


def module_name(rel: str) -> str:
    parts = rel[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def functions(text: str, module: str) -> list[tuple[str, str, str]]:
    """(request, thought, source) for each documented function of a file: the request is the first
    paragraph of its docstring, the source the whole function, dedented."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        request = " ".join(doc.strip().split("\n\n")[0].split()) if doc else ""
        start = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
        if not 20 <= len(request) <= 300 or node.end_lineno - start > 40:
            continue
        source = textwrap.dedent("\n".join(lines[start:node.end_lineno]))
        out.append((request, f"This is `{node.name}` from the `{module}` module.", source))
    return out


def chat_ids(tok: Tokenizer, request: str, thought: str, source: str, think: bool) -> list[int]:
    """A chat turn in the token layout the app produces: the template's generation prompt, then the
    answer (with thinking on: the thought, </think>, the code), then <|im_end|>."""
    ids = tok.apply_chat_template([{"role": "user", "content": request}], enable_thinking=think)
    if think:
        ids += tok.encode(thought + "\n") + [tok.think_end_id] + tok.encode("\n\n" + source)
    else:
        ids += tok.encode(source)
    return ids + [tok.im_end_id] + tok.encode("\n")


def heldout(n: int = 8, chat: bool = False, root: Path | None = None) -> list[str]:
    """Prompts from held-out files, one per file in sorted order, from its first documented function:
    raw code (the function's header and docstring; the model writes the body) or, with `chat`, the
    request (the docstring's first paragraph) for a chat turn."""
    root = root or stdlib_root()
    out = []
    for rel in (r for r in stdlib_files(root) if is_heldout(r)):
        for request, _, source in functions(read(root, rel), module_name(rel)):
            parts = source.split('"""')
            if chat or (len(parts) >= 3 and len(parts[0]) < 200):
                out.append(request if chat else parts[0] + '"""' + parts[1] + '"""\n')
                break
        if len(out) == n:
            break
    return out


def build_corpus(root: Path, vocab: int, seed: int, max_files: int | None = None):
    """-> (tokenizer, train ids, held-out ids): documents shuffled and packed, <|endoftext|> between."""
    files = stdlib_files(root)[:max_files]
    texts = {rel: read(root, rel) for rel in files}
    train = [rel for rel in files if not is_heldout(rel)]
    raw = train_tokenizer([texts[rel] for rel in train], vocab)
    tok = Tokenizer(raw)
    eot = tok.endoftext_id

    def documents(rels):
        docs = [tok.encode(texts[rel]) for rel in rels]
        turns = [f for rel in rels for f in functions(texts[rel], module_name(rel))]
        docs += [chat_ids(tok, *f, think=i % 3 != 0) for i, f in enumerate(turns)]
        random.Random(seed).shuffle(docs)
        return torch.tensor([t for d in docs for t in d + [eot]], dtype=torch.long), len(turns)

    train_ids, n_turns = documents(train)
    held_ids, _ = documents([rel for rel in files if is_heldout(rel)])
    print(f"corpus: {root} (Python {sys.version.split()[0]}), {len(files)} files, {len(files) - len(train)} held out; "
          f"{n_turns} chat turns; {train_ids.numel():,} training tokens, {held_ids.numel():,} held out; "
          f"sha256 {hashlib.sha256(train_ids.numpy().tobytes()).hexdigest()[:16]}", flush=True)
    return raw, tok, train_ids, held_ids
