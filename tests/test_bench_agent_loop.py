"""tests/bench/bench_agent_loop.py --random-weights: an official shape's random weights served from
the bench's own process (no checkpoint), here the demo model's small shape on the CPU. Each turn
after the first resumes the history from the server's turn snapshot, and the table comes with
what it was measured on."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

from serve_support import DEMO

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
import bench_agent_loop  # noqa: E402


def test_random_weights_serve_the_loop_from_this_process_and_resume_each_turn(capsys):
    argv = ["--random-weights", str(DEMO / "config.json"), "--start", "200", "--end", "1200", "--turns", "3",
            "--device", "cpu", "--max-tokens", "4"]
    assert bench_agent_loop.main(argv) == 0
    out = capsys.readouterr().out
    rows = [[cell.strip().replace(",", "") for cell in line.strip("|").split("|")]
            for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"], out
    prompt, new, cached = ([int(r[i]) for r in rows] for i in (1, 2, 3))
    # the history grows from about --start to about --end tokens of the demo tokenizer
    assert 200 <= prompt[0] < 500 and 1200 <= prompt[-1] < 1600, out
    assert new == [prompt[0], prompt[1] - prompt[0], prompt[2] - prompt[1]], out
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), out
    for before_turn, now in zip(prompt, cached[1:]):
        assert now >= before_turn - 16, out        # the last turn's history resumed, not prefilled again
    assert "demo" in out and "float32 weights" in out and "device: CPU" in out and "date: 20" in out
    assert "command: python tests/bench/bench_agent_loop.py " + " ".join(argv) in out
    # the server and its generation threads are gone
    assert not [t.name for t in threading.enumerate() if t.name in ("server", "mtpchat-generate")]


def test_random_weights_refuse_a_shape_the_prompts_ids_do_not_fit(tmp_path, capsys):
    import json
    config = json.loads((DEMO / "config.json").read_text())
    config["text_config"]["vocab_size"] = 512
    (tmp_path / "config.json").write_text(json.dumps(config))
    try:
        bench_agent_loop.main(["--random-weights", str(tmp_path / "config.json"), "--device", "cpu"])
    except SystemExit as exc:
        assert "vocabulary (512) is smaller than the demo tokenizer's (4,096)" in str(exc)
    else:
        raise AssertionError("a shape whose vocabulary is smaller than the prompts' ids was built")
