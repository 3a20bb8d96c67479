"""`make test` runs the suite under pytest-xdist's ``--dist loadgroup``: the tests that share a
module-scoped fixture starting processes, and the crowded tests, must land in one worker as groups."""

from __future__ import annotations

import pytest


@pytest.mark.crowded
def test_a_grouped_test_carries_its_group_in_the_id_xdist_schedules_by(request):
    if not request.config.getoption("loadgroup", default=False):  # set in pytest-xdist's workers
        pytest.skip("only under --dist loadgroup (make test); make test-quick runs in one process")
    # pytest-xdist sends the scheduler `item.nodeid`; the group is a suffix of it. With pytest 9.2
    # the suffix went to an attribute pytest no longer reads, and no group was kept together.
    assert request.node.nodeid.endswith("@crowded"), request.node.nodeid
