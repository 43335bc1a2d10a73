"""SVG snapshots of the main screen, wide and narrow, after a reply on the pinned demo.

Every number is pinned: the fake engine's simulated clock and acceptance pattern, the fake GPU's
readings, a fixed wall clock. Regenerate after an intended change with `--snapshot-update`.
"""
from mtpchat.app import demo


def test_main_screen_wide(snap_compare, tmp_path):
    assert snap_compare(demo.build(tmp_path), terminal_size=(150, 46), run_before=demo.play)


def test_main_screen_narrow(snap_compare, tmp_path):
    assert snap_compare(demo.build(tmp_path), terminal_size=(90, 40), run_before=demo.play)
