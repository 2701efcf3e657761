"""The container image (docker/Dockerfile, README "Container image"): tools/build_image.sh builds its CPU
flavour with podman and checks it: `chatlearn --version`, a dry run of every template, a read-only output
volume refused before training, and the default job for a few episodes with its output on a mounted folder.
Here the test reads what the run inside left on that folder: its metrics, and an eval that rose.

Building the image takes minutes (the base, then about 3.5 GB of packages; a rebuild with unchanged
dependencies reuses the cached layers), so the test is left out of the suite unless asked for:

    CHATLEARN_TEST_IMAGE=1 .venv/bin/python -m pytest tests/e2e/test_image.py -q

It needs podman, runc and mmdebstrap (the script installs them from apt as root) and is skipped, with the
reason, where they are missing and cannot be installed, or where podman cannot run containers."""
from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from conftest import REPO

EPISODES = 20


def _unavailable() -> str | None:
    """Why the image cannot be built here, or None."""
    if os.environ.get("CHATLEARN_TEST_IMAGE") != "1":
        return ("building the container image takes minutes: asked for with CHATLEARN_TEST_IMAGE=1 "
                "(tests/e2e/test_image.py)")
    missing = [t for t in ("podman", "runc", "mmdebstrap") if shutil.which(t) is None]
    if missing and (os.geteuid() != 0 or shutil.which("apt-get") is None):
        return f"{', '.join(missing)} missing and not installable here (tools/build_image.sh installs them as root)"
    if not missing:
        probe = subprocess.run(["podman", "--runtime", "runc", "info"], capture_output=True, text=True)
        if probe.returncode != 0:
            return f"podman cannot run here: {probe.stderr.strip().splitlines()[-1:]}"
    return None


@pytest.mark.slow
@pytest.mark.image
@pytest.mark.timeout(3600)
@pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))
def test_the_image_builds_and_its_default_job_learns_on_a_mounted_folder(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, CHATLEARN_IMAGE_OUT=str(out), CHATLEARN_IMAGE_EPISODES=str(EPISODES))
    proc = subprocess.run(["bash", "tools/build_image.sh"], cwd=REPO, env=env, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert "chatlearn --version: chatlearn " in log
    templates = sorted(n for n in os.listdir(os.path.join(REPO, "template")) if n.endswith(".yaml") and n != "sft.yaml")
    for name in templates:
        assert f"dry run of template/{name}: ok" in log, name
    assert "a read-only output volume is refused: error: runtime_args.output_dir" in log
    # what the run inside the container wrote on the mounted folder
    run = out / "grpo_fsdp"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["episode"] for r in rows] == list(range(EPISODES + 1)), [r["episode"] for r in rows]
    evals = {r["episode"]: r["eval/reward_mean"] for r in rows if "eval/reward_mean" in r}
    assert set(evals) == {0, EPISODES}, evals
    assert evals[EPISODES] > evals[0] + 0.03, evals  # the toy: +0.10 by episode 20 (README)
    assert all(r["train/grad_norm"] > 0 for r in rows[1:]), rows[1]
    saved = [int(p.parent.parent.name.split("_")[1]) for p in (run / "checkpoints").glob("episode_*/hf/config.json")]
    assert saved == [EPISODES], saved  # the final checkpoint, with its Hugging Face copy
