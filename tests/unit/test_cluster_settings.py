"""Ray Serve settings are checked before Ray starts: a bad value is a one-line error naming its flag."""

from __future__ import annotations

import pytest

from fiberserve.cli import server_config


@pytest.mark.parametrize(
    "values, flag",
    [
        ({"replicas": -1}, "--replicas"),
        ({"replicas": 2, "min_replicas": 0}, "--min-replicas"),
        ({"replicas": 2, "min_replicas": 3, "max_replicas": 2}, "--max-replicas"),
        ({"replicas": 2, "max_replicas": 4, "target_ongoing_requests": 0}, "--target-ongoing-requests"),
        ({"replicas": 2, "max_replicas": 4, "autoscale_delay_s": -1}, "--autoscale-delay-s"),
    ],
)
def test_bad_replica_settings_name_their_flag(values, flag):
    with pytest.raises(SystemExit, match=flag):
        server_config(values)


def test_good_replica_settings_pass_through():
    config = server_config({"replicas": 2, "min_replicas": 1, "max_replicas": 4, "autoscale_delay_s": 5.0})
    assert (config.replicas, config.min_replicas, config.max_replicas, config.autoscale_delay_s) == (2, 1, 4, 5.0)
