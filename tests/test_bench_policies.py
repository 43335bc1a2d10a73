"""`mtpchat bench`'s profile x policy table on a tiny checkpoint (CPU): every profile against MTP
off, each fixed k and adaptive k, with outputs equal to MTP off, the histogram of k, and the
draft step's ratio to a decode step."""
import json

from mtpchat.cli import main
from mtpchat.engine.bench import PROFILES


def test_profiles_model_their_acceptance_lengths():
    lengths = {name: 1 + sum(p[:3]) for name, p in PROFILES.items()}
    assert abs(lengths["code"] - 3.3) < 0.05 and abs(lengths["chat-thinking"] - 2.5) < 0.05
    assert abs(lengths["creative"] - 1.8) < 0.05
    for p in PROFILES.values():                      # P(at least i accepted) can only fall with i
        assert all(1 >= a >= b > 0 for a, b in zip(p, p[1:]))


def test_bench_profile_policy_table(capsys, gqa3):
    args = ["bench", "--model", str(gqa3), "--device", "cpu", "--tokens", "8", "--context", "16",
            "--policy-tokens", "24", "--policy-repeats", "1", "--profiles-only"]
    assert main(args + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r["policies"]) == set(PROFILES)
    for name, p in r["policies"].items():
        row = p["policies"]
        assert list(row) == ["off", "1", "2", "3", "4", "adaptive"]
        assert all(c["identical_to_mtp_off"] and c["ms_per_token"] > 0 for c in row.values()), name
        assert row["off"]["k_histogram"] == {"0": sum(row["off"]["k_histogram"].values())}
        # k = 4 throughout, shrunk only at the token limit
        assert set(row["4"]["k_histogram"]) <= {"0", "1", "2", "3", "4"} and "4" in row["4"]["k_histogram"]
        assert row["adaptive"]["vs_off"] > 0 and row["adaptive"]["vs_best_fixed"] > 0
    assert set(r["draft_step_ratio"]) == {"1", "2", "3", "4"} and all(x > 0 for x in r["draft_step_ratio"].values())
    assert "ttft_ms" in r and not r["ttft_ms"] and not r["mtp_real"] and "exactness" not in r
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "kernel plan: split_norm=True" in table
    assert "ms per token, end to end" in table and "chat-thinking (2.51)" in table and "adaptive/best fixed" in table
