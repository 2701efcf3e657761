"""What reaches the console: chatlearn's own lines; third-party logs go to ``<output_dir>/logs/``.

Libraries under a run (vLLM, Ray, transformers, torch, datasets, ...) log a lot that matters only
when something goes wrong. By default a run keeps them off the console:

* the driver process (``chatlearn run``): the Python loggers of those libraries and Python
  warnings (``logging.captureWarnings``) are written to ``<output_dir>/logs/driver.log``
  (:class:`ThirdPartyLogs`; lines logged before the output folder may be written are kept in
  memory until then);
* every worker process (a trainer rank, a rollout replica, a reward worker): its standard output
  and error, at the file-descriptor level, go to ``<output_dir>/logs/worker-<pid>.log``
  (:func:`setup_worker`, first thing in the worker), which catches C/C++ warnings, progress bars
  and library prints as well as Python logging. ``<pid>`` is the one in Ray's
  ``(Worker pid=...)`` prefix of ``--verbose``. A worker's exception reaches the driver as the run's
  error; when a worker process dies, the driver prints the end of its log (:func:`failure_hint`).
  Nothing of the workers' output streams to the driver then, so a run's own Ray head starts without
  its log monitor (:func:`workers_stream_to_driver`, ``chatlearn.runtime.cluster.cluster.lean_local_head``).

``--verbose`` (``CHATLEARN_VERBOSE=1``) shows everything on the console as well, as it comes.
The driver tells the workers where to write through ``CHATLEARN_LOG_DIR`` and
``CHATLEARN_VERBOSE`` (passed by :func:`chatlearn.runtime.cluster.worker_env.worker_env`).
"""
from __future__ import annotations

import logging
import logging.handlers
import os
import re
import sys

ENV_LOG_DIR = "CHATLEARN_LOG_DIR"
ENV_VERBOSE = "CHATLEARN_VERBOSE"
LOG_SUBDIR = "logs"

# Loggers of the libraries a run uses (their children included: "ray.data", "vllm.v1...").
THIRD_PARTY_LOGGERS = ("ray", "vllm", "transformers", "torch", "datasets", "huggingface_hub", "accelerate",
                       "sglang", "megatron", "urllib3", "filelock", "fsspec", "asyncio", "wandb", "tensorboard",
                       "math_verify", "latex2sympy2_extended", "py.warnings")
_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class ChatlearnLines(logging.Handler):
    """chatlearn's own lines on the console: ``[chatlearn] <message>`` (``[chatlearn] warning:
    <message>`` from a warning; a record with ``bare`` set prints its message alone), on standard
    output, or standard error for a record with ``stderr`` set: the stream as it is when the line
    is written (a test's captured stream, a redirected one)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr if getattr(record, "stderr", False) else sys.stdout
            if getattr(record, "bare", False):
                prefix = ""
            else:
                prefix = "[chatlearn] warning: " if record.levelno >= logging.WARNING else "[chatlearn] "
            stream.write(f"{prefix}{record.getMessage()}\n")
            stream.flush()
        except Exception:  # noqa: BLE001  (logging's own contract: a handler never raises)
            self.handleError(record)


# chatlearn's logger: its lines go to the console through ChatlearnLines only, never into the
# third-party log file (ThirdPartyLogs routes the libraries' loggers, not this one)
LOG = logging.getLogger("chatlearn")
LOG.propagate = False
LOG.setLevel(logging.INFO)
if not any(isinstance(h, ChatlearnLines) for h in LOG.handlers):
    LOG.addHandler(ChatlearnLines())


def info(message: str, stderr: bool = False, bare: bool = False) -> None:
    """A line of chatlearn's on the console (see :class:`ChatlearnLines`)."""
    LOG.info(message, extra={"stderr": stderr, "bare": bare})


def warn(message: str, stderr: bool = False) -> None:
    """A warning line of chatlearn's on the console (see :class:`ChatlearnLines`)."""
    LOG.warning(message, extra={"stderr": stderr})


def verbose() -> bool:
    """Whether third-party logs are shown on the console too (``--verbose``)."""
    return os.environ.get(ENV_VERBOSE, "") == "1"


def log_dir(output_dir: str) -> str:
    return os.path.join(output_dir, LOG_SUBDIR)


def ray_init_options() -> dict:
    """Logging arguments of ``ray.init``. ``configure_logging`` keeps the handlers of Ray's ``ray``
    logger (:class:`ThirdPartyLogs` routes it) and sets their level and format; off, Ray 2.x removes
    them. The workers' output streams to the driver only where it is not written to a run's logs
    folder (:func:`workers_stream_to_driver`)."""
    return {"logging_level": "WARNING", "configure_logging": True, "log_to_driver": workers_stream_to_driver()}


def workers_stream_to_driver() -> bool:
    """Whether the workers' standard output reaches the console through Ray: with ``--verbose``, or
    where nothing sends it to a logs folder (chatlearn used as a library, not by ``chatlearn run`` or
    ``chatlearn eval``). Otherwise :func:`setup_worker` writes all of it to the run's logs folder."""
    return verbose() or not os.environ.get(ENV_LOG_DIR)


def raylet_lines_to_log() -> None:
    """Ray's driver prints the errors the cluster publishes (``(raylet) A worker died ...``, naming the
    OOM killer as a possible cause of any death) straight to the console, beside chatlearn's own
    paragraph about the same worker. Where the workers' output goes to the run's logs folder
    (:func:`workers_stream_to_driver` false), those lines go to the driver's log as well
    (``<output_dir>/logs/driver.log``, logger ``ray``). Ray's ``print_to_stdstream`` (Ray 2.40 to
    2.60: ``ray._private.worker``, looked up at each call by its error listener) is wrapped once."""
    try:
        import ray._private.worker as ray_worker
    except ImportError:
        return
    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "chatlearn_routed", False):
        return

    def routed(data, ignore_prefix: bool = False):
        if isinstance(data, dict) and data.get("pid") == "raylet" and not workers_stream_to_driver():
            for line in data.get("lines") or []:
                logging.getLogger("ray").warning("(raylet) %s", line)
            return None
        return original(data, ignore_prefix)

    routed.chatlearn_routed = True
    ray_worker.print_to_stdstream = routed


class ThirdPartyLogs:
    """Routes the driver's third-party logging to ``<output_dir>/logs/driver.log`` for a run.

    ``with ThirdPartyLogs() as logs: ...; logs.attach(output_dir)`` (or :func:`attach_logs`): records are buffered from the
    start and written once :meth:`attach` names the folder (a run writes into its output folder
    only after its checks passed). :meth:`attach` also sets ``CHATLEARN_LOG_DIR`` for the workers.
    On exit every logger, the warnings capture and the environment are put back as they were.
    """

    def __init__(self, loggers: tuple[str, ...] = THIRD_PARTY_LOGGERS):
        self.names = loggers
        self.path: str | None = None
        self._saved: dict[str, tuple[list, bool]] = {}  # logger -> (its handlers, propagate) before
        self._env: str | None = None
        self._buffer = logging.handlers.MemoryHandler(capacity=1 << 30, flushLevel=logging.CRITICAL + 1)
        self._buffer.setFormatter(logging.Formatter(_FORMAT))
        self._files: list[logging.Handler] = []
        self._console: logging.Handler | None = None

    def _handlers(self, name: str) -> list[logging.Handler]:
        """The handlers for logger ``name`` now: the buffer or the file, and the console (``--verbose``).
        Ray's logger gets a file handler of its own: ``ray.init`` sets its handlers' format."""
        if self.path is None:
            out = [self._buffer]
        elif name == "ray":
            out = [self._file_handler()]
        else:
            out = [self._files[0]]
        if self._console is not None:
            out.append(self._console if name != "ray" else _stream_handler())
        return out

    def _file_handler(self) -> logging.Handler:
        handler = logging.FileHandler(self.path, encoding="utf-8")
        handler.setFormatter(logging.Formatter(_FORMAT))
        self._files.append(handler)
        return handler

    def _sweep(self) -> None:
        """Route every library logger: the top ones, and those below them that have handlers of their
        own (a library may give a child logger its own console handler and stop it propagating)."""
        names = set(self.names)
        for name, logger in list(logging.Logger.manager.loggerDict.items()):
            if isinstance(logger, logging.Logger) and logger.handlers and any(
                    name.startswith(top + ".") for top in self.names):
                names.add(name)
        for name in sorted(names):
            logger = logging.getLogger(name)
            if name not in self._saved:
                self._saved[name] = (list(logger.handlers), logger.propagate)
            for h in list(logger.handlers):
                logger.removeHandler(h)
            for h in self._handlers(name):
                logger.addHandler(h)
            logger.propagate = False

    def __enter__(self) -> "ThirdPartyLogs":
        global _active
        _active = self
        self._env = os.environ.get(ENV_LOG_DIR)
        if verbose():
            self._console = _stream_handler()
        logging.captureWarnings(True)
        self._sweep()
        return self

    def attach(self, output_dir: str) -> str:
        """Start writing to ``<output_dir>/logs/driver.log`` (what was buffered first); returns the folder."""
        folder = os.path.abspath(log_dir(output_dir))
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, "driver.log")
        self._buffer.setTarget(self._file_handler())
        self._buffer.flush()
        self._sweep()  # from the buffer to the file; and loggers set up since (libraries imported later)
        os.environ[ENV_LOG_DIR] = folder
        return folder

    def __exit__(self, *exc) -> None:
        global _active
        if _active is self:
            _active = None
        for name, (handlers, propagate) in self._saved.items():
            logger = logging.getLogger(name)
            for h in list(logger.handlers):
                logger.removeHandler(h)
            for h in handlers:
                logger.addHandler(h)
            logger.propagate = propagate
        self._saved.clear()
        logging.captureWarnings(False)
        self._buffer.close()
        for handler in self._files:
            handler.close()
        if self._env is None:
            os.environ.pop(ENV_LOG_DIR, None)
        else:
            os.environ[ENV_LOG_DIR] = self._env


def _stream_handler() -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT))
    return handler


_active: ThirdPartyLogs | None = None


def attach_logs(output_dir: str) -> str | None:
    """:meth:`ThirdPartyLogs.attach` of the routing in effect (``chatlearn run`` sets one up); returns
    the log folder, or None when third-party logs are not routed (chatlearn used as a library)."""
    return _active.attach(output_dir) if _active is not None else None


def reroute_logs() -> None:
    """Route the loggers libraries set up since the run's logs were attached (a library imported
    later, as by the models built in the driver's process of a run without Ray) as the others."""
    if _active is not None and _active.path is not None:
        _active._sweep()


class NativeOutputToLog:
    """While open, this process's file descriptors 1 and 2 (what native code and child processes write:
    C/C++ warnings, prints below Python) go to ``$CHATLEARN_LOG_DIR/worker-<pid>.log``, while Python's
    ``sys.stdout`` and ``sys.stderr`` go on writing to the console through copies of the old
    descriptors: a run without Ray builds its models in the driver's process, whose libraries would
    otherwise print on the console what a worker process's :func:`setup_worker` sends to its log.
    Nothing changes with ``--verbose`` or without ``CHATLEARN_LOG_DIR``."""

    def __init__(self):
        self._saved: tuple | None = None

    def __enter__(self) -> "NativeOutputToLog":
        fd = _worker_log()
        if fd is None:
            return self
        sys.stdout.flush()
        sys.stderr.flush()
        consoles = (os.dup(1), os.dup(2))
        streams = (sys.stdout, sys.stderr)
        self._saved = (consoles, streams)
        sys.stdout = open(consoles[0], "w", buffering=1, encoding=_encoding(streams[0]), closefd=False)
        sys.stderr = open(consoles[1], "w", buffering=1, encoding=_encoding(streams[1]), closefd=False)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        return self

    def __exit__(self, *exc) -> None:
        if self._saved is None:
            return
        (out, err), (stdout, stderr) = self._saved
        self._saved = None
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdout, sys.stderr = stdout, stderr
        os.close(out)
        os.close(err)


def _encoding(stream) -> str:
    return getattr(stream, "encoding", None) or "utf-8"


def _worker_log() -> int | None:
    """A descriptor open for appending to ``$CHATLEARN_LOG_DIR/worker-<pid>.log``; None with ``--verbose``,
    without ``CHATLEARN_LOG_DIR`` or where the file cannot be opened (the console it is)."""
    folder = os.environ.get(ENV_LOG_DIR)
    if not folder or verbose():
        return None
    try:
        return os.open(os.path.join(folder, f"worker-{os.getpid()}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError:
        return None


_redirected = False


def setup_worker() -> None:
    """In a worker process, before anything else is imported: send its standard output and error
    (file descriptors 1 and 2, inherited by the processes it starts) to
    ``$CHATLEARN_LOG_DIR/worker-<pid>.log``. Nothing changes with ``--verbose`` or without
    ``CHATLEARN_LOG_DIR``."""
    global _redirected
    fd = None if _redirected else _worker_log()
    if fd is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    _redirected = True
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Python buffers a standard output that is not a terminal in blocks, and a worker ends by
    # ray.kill (no flush): what libraries print would be lost that way
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)


_PID = re.compile(r"\bpid[=: ]+(\d+)")


def failure_hint(error: BaseException, output_dir: str, lines: int = 40) -> str:
    """For a run that failed with ``error``: where the third-party logs are and, when the error names
    a worker process whose log exists (a worker that died: Ray's error gives its pid), the end of
    that log, which holds the reason (a crash, a C++ abort, the last messages of a library)."""
    folder = log_dir(output_dir)
    if not os.path.isdir(folder):
        return ""
    out = [f"[chatlearn] third-party logs of this run: {folder}/"]
    seen = set()
    for pid in _PID.findall(str(error)):
        path = os.path.join(folder, f"worker-{pid}.log")
        if pid in seen or not os.path.isfile(path):
            continue
        seen.add(pid)
        with open(path, encoding="utf-8", errors="replace") as f:
            tail = f.readlines()[-lines:]
        out.append(f"[chatlearn] the last lines of {path}:")
        out.extend("    " + line.rstrip("\n") for line in tail)
    return "\n".join(out)
