"""What startup built is frozen out of the collector's view while serving, and collectable again
after."""

import gc

from scheduler.cell.gc_pauses import startup_frozen


def test_a_timed_run_freezes_startup_objects_and_unfreezes_after():
    startup = [[i] for i in range(1000)]  # objects the collector tracks
    with startup_frozen():
        frozen = gc.get_freeze_count()
        assert frozen >= len(startup)
    assert gc.get_freeze_count() == 0
