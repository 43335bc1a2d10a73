"""Tools kept with the tests, outside the installed package: the tiny checkpoint writer (tiny.py) and
its tokenizer trainer (bpe.py), the demo model's trainer (demo/), and the generator of the draft
vocabulary's text counts (draft_rank.py). The engine never imports them.

Run one from the repository root with tests/ on the path: `PYTHONPATH=tests python -m tools.<name>`.
"""
