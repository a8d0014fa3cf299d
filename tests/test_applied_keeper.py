"""``start_keeper`` where a killed keeper left its job behind (``actormesh apply`` after a crash)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from actormesh.job import JobError
from actormesh.job._applied import start_keeper


@pytest.mark.timeout(60)
def test_a_left_job_that_cannot_be_killed_is_logged_and_the_new_apply_goes_on(tmp_path: Path,
                                                                                caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "job_state.pkl").write_bytes(b"not a pickled job")  # what a crashed keeper may leave
    with caplog.at_level(logging.WARNING, logger="actormesh.job"), pytest.raises(JobError, match="applying the job failed"):
        start_keeper({"job": "bogus"}, str(tmp_path), timeout_s=30)  # the new keeper refuses this request
    assert any("could not kill the job a dead keeper left" in r.getMessage() for r in caplog.records)
    assert not (tmp_path / "job_state.pkl").exists()  # released, not left for the next apply
