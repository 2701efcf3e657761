"""The container image's output-volume check (chatlearn/config/container.py): an output folder the
container cannot write is refused before anything is loaded; results that would be lost with the container
(outside the volume, or in an anonymous volume) are warned of; outside the image nothing is checked."""
from __future__ import annotations

import pytest

from chatlearn.errors import UserError
from chatlearn.config.container import VOLUME_ENV, check_output_volume

ANON = "a" * 64


def mountinfo(tmp_path, source: str, target: str) -> str:
    path = tmp_path / "mountinfo"
    path.write_text("1 0 8:1 / / rw - ext4 /dev/vda rw\n"
                    f"2 1 8:1 {source} {target} rw,relatime - ext4 /dev/vda rw\n")
    return str(path)


def test_outside_the_image_nothing_is_checked():
    assert check_output_volume("/proc/no/such/out", environ={}) is None


def test_an_unwritable_output_folder_is_refused():
    # /proc takes no new file, even for root: as a read-only or foreign-owned host folder would refuse
    with pytest.raises(UserError) as err:
        check_output_volume("/proc/chatlearn-out/run", environ={VOLUME_ENV: "/proc/chatlearn-out"})
    message = err.value.message
    assert "runtime_args.output_dir: '/proc/chatlearn-out/run'" in message and "cannot be written" in message
    assert "-v $PWD/out:/proc/chatlearn-out" in message and "Nothing was trained" in message


def test_a_mounted_writable_volume_passes(tmp_path):
    vol = tmp_path / "vol"
    vol.mkdir()
    info = mountinfo(tmp_path, "/srv/runs", str(vol))
    assert check_output_volume(str(vol / "output" / "grpo"), environ={VOLUME_ENV: str(vol)}, mountinfo=info) is None
    assert not list(vol.iterdir())  # the probe leaves nothing


def test_an_anonymous_volume_or_a_folder_outside_it_is_warned_of(tmp_path):
    vol = tmp_path / "vol"
    vol.mkdir()
    anon = mountinfo(tmp_path, f"/var/lib/containers/storage/volumes/{ANON}/_data", str(vol))
    note = check_output_volume(str(vol / "x"), environ={VOLUME_ENV: str(vol)}, mountinfo=anon)
    assert "anonymous volume" in note and f"-v $PWD/out:{vol}" in note
    outside = check_output_volume(str(tmp_path / "elsewhere"), environ={VOLUME_ENV: str(vol)}, mountinfo=anon)
    assert "lies outside the output volume" in outside
