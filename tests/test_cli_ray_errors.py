"""A user error raised inside a Ray actor reaches the user as one paragraph with exit code 2."""
from __future__ import annotations

import pytest

from chatlearn import cli
from chatlearn.errors import UserError


@pytest.mark.timeout(120)
def test_user_error_from_an_actor_is_unwrapped(monkeypatch, capsys):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        @ray.remote
        def fails():
            raise UserError("the checkpoint is damaged. Use another checkpoint.", key="checkpoints/episode_000002")

        monkeypatch.setattr(cli, "_run", lambda args: ray.get(fails.remote()))
        assert cli.main(["run", "template/grpo_fsdp.yaml"]) == 2
    finally:
        ray.shutdown()
    err = capsys.readouterr().err
    assert err == "error: checkpoints/episode_000002: the checkpoint is damaged. Use another checkpoint.\n"
