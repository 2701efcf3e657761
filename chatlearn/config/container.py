"""Inside the container image (docker/Dockerfile): a run's results must reach a writable volume.

The image declares its output folder a volume and names it in ``CHATLEARN_OUTPUT_VOLUME``. When a config is
validated (``run``, also with ``--dry-run``; ``sft`` and ``eval`` before they load a model),
:func:`check_output_volume` refuses, in one paragraph,
an output folder the container's user cannot write (a host folder mounted read-only, or owned by another
user), and warns when what the run writes would not outlive the container: an output folder outside the
volume, or the volume the engine made up when none was mounted (an anonymous volume). Outside the image
(the variable unset) it does nothing.
"""
from __future__ import annotations

import os
import re

from chatlearn.config.writable import nearest_existing, probe
from chatlearn.errors import ConfigError

VOLUME_ENV = "CHATLEARN_OUTPUT_VOLUME"
# the source of a volume docker or podman made up for a container started without one: a 64-hex-digit name
_ANONYMOUS = re.compile(r"/volumes/[0-9a-f]{64}/_data$")


def check_output_volume(output_dir: str, key: str = "runtime_args.output_dir", environ=None,
                        mountinfo: str = "/proc/self/mountinfo") -> str | None:
    """Refuse an output folder the container cannot write; return a warning (or None) when its results
    would be lost with the container. Does nothing outside the image (``CHATLEARN_OUTPUT_VOLUME`` unset)."""
    volume = (os.environ if environ is None else environ).get(VOLUME_ENV)
    if not volume:
        return None
    out = os.path.abspath(output_dir)
    folder = nearest_existing(out)
    problem = probe(folder) if os.path.isdir(folder) else "it is a file, not a folder"
    if problem:
        raise ConfigError(
            f"{output_dir!r} ({out}) cannot be written by this container's user (uid {os.getuid()}): "
            f"{folder!r}: {problem}. A run in the image writes its checkpoints and metrics to the "
            f"output volume {volume}, which must be a host folder (or a named volume) this user can write: "
            f"`mkdir -p out && chown {os.getuid()} out` (or `chmod a+rwx out`), then `docker run -v "
            f"$PWD/out:{volume} ...` (not `:ro`); with rootless podman, own the folder yourself and add "
            f"`--userns=keep-id:uid={os.getuid()},gid={os.getgid()}`. Nothing was trained.", key=key)
    if not _inside(out, volume):
        return (f"{key} {out!r} lies outside the output volume {volume}: what the run writes stays in the "
                f"container and is lost with it. Choose a {key} under {volume} (the templates write "
                f"output/<exp_name> there).")
    if _anonymous(volume, mountinfo):
        return (f"no folder was mounted on the output volume {volume}: the run writes to an anonymous volume, "
                f"which `--rm` deletes with the container. Mount one: `-v $PWD/out:{volume}`.")
    return None


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _anonymous(volume: str, mountinfo: str) -> bool:
    """Whether ``volume`` is mounted from an anonymous volume (mountinfo's fourth field is the source)."""
    try:
        with open(mountinfo, encoding="utf-8") as f:
            rows = [line.split() for line in f]
    except OSError:
        return False
    target = os.path.realpath(volume)
    return any(len(r) > 4 and r[4] == target and _ANONYMOUS.search(r[3]) for r in rows)
