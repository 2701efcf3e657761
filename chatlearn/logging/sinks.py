"""Where a run's metrics go: ``metrics.jsonl`` always, TensorBoard and Weights & Biases on request.

``runtime_args.log_args_dict`` switches the optional sinks (ChatLearn's keys):

* ``enable_tensorboard``: event files in ``tensorboard_dir`` (default ``<log_dir>/tensorboard``);
  every metric is a scalar with the episode as its step, and the resolved config is a text entry.
* ``enable_wandb``: a W&B run in ``wandb_dir`` (W&B writes under ``<wandb_dir>/wandb/``; default
  ``<log_dir>``, so ``<log_dir>/wandb/``) with ``wandb_project``, ``wandb_name``, ``wandb_id``,
  ``wandb_resume``; the resolved config is the run's config, the episode its x-axis. ``WANDB_MODE``
  is honoured; without it and without an API key the run is recorded offline (``wandb sync``
  uploads it later) instead of prompting for a key.

Every copy of the config a run writes or prints (TensorBoard, W&B, ``<output_dir>/config.yaml``,
``chatlearn run --dry-run``) has secrets redacted (:func:`chatlearn.config.secrets.redact`: secret keys,
values read from the environment, kept as ``${oc.env:...}``, URL passwords, HTTP credentials).
"""
from __future__ import annotations

import netrc
import os
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf

from chatlearn.config.schema import raw_defaults
from chatlearn.config.secrets import env_sources, redact
from chatlearn.errors import UserError
from chatlearn.logging.console import info
from chatlearn.logging.jsonl import write_text_atomic
from chatlearn.logging.metrics import MetricsWriter, SamplesWriter


def loggable_config(cfg: DictConfig) -> dict:
    """The resolved config as plain containers, secrets redacted (chatlearn.config.secrets)."""
    return redact(OmegaConf.to_container(cfg, resolve=True), env_sources(cfg))


def config_yaml(cfg: DictConfig) -> str:
    """The resolved config as YAML text, secrets redacted: what ``--dry-run`` prints and
    ``config.yaml`` holds."""
    return OmegaConf.to_yaml(OmegaConf.create(loggable_config(cfg)))


def changed_config(cfg: DictConfig) -> dict:
    """The settings of the resolved ``cfg`` whose value differs from the schema's default, as nested
    plain containers, secrets redacted: what ``chatlearn run --dry-run`` prints (``--all``: every key,
    :func:`config_yaml`). A default that interpolates another key (``${runtime_args.seed}``) is taken
    with the value that key has in ``cfg``; a required key (no default) always counts as set; lists
    are compared whole."""
    final = OmegaConf.to_container(cfg, resolve=True)
    raw = raw_defaults()
    context = OmegaConf.create(final)
    missing = object()

    def default_of(value):
        if isinstance(value, str) and "${" in value:
            OmegaConf.update(context, "_chatlearn_default_", value, force_add=True)
            try:
                return context._chatlearn_default_
            except Exception:  # noqa: BLE001 (an unresolvable default: then the setting counts as changed)
                return missing
        return value

    def diff(node, defaults):
        out = {}
        for key, value in node.items():
            default = defaults.get(key, missing) if isinstance(defaults, dict) else missing
            if isinstance(value, dict) and isinstance(default, dict):
                sub = diff(value, default)
                if sub:
                    out[key] = sub
            elif default == "???" or default_of(default) != value:
                out[key] = value
        return out

    return redact(diff(final, raw), env_sources(cfg))


def write_config_yaml(cfg: DictConfig, path: str) -> None:
    """Write :func:`config_yaml` to ``path`` atomically (a temporary file, fsynced, renamed)."""
    write_text_atomic(path, config_yaml(cfg))


def sink_dirs(cfg: DictConfig) -> tuple[str, str]:
    """(tensorboard_dir, wandb_dir) with their defaults applied."""
    la = cfg.runtime_args.log_args_dict
    log_dir = la.log_dir or cfg.runtime_args.output_dir
    return la.tensorboard_dir or os.path.join(log_dir, "tensorboard"), la.wandb_dir or log_dir


SAMPLE_COLUMNS = ("prompt", "response", "reward", "ground_truth", "data_source", "response_tokens", "finished")


def samples_markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (TensorBoard's text tab renders it)."""
    def cell(value) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>")

    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + "---|" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in SAMPLE_COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


class MetricSinks:
    """Every sink of a run behind one ``write(episode, metrics)`` / ``close()``.

    ``metrics.jsonl`` is the record of the run; a TensorBoard or W&B failure in the middle of
    training is reported once and that sink is switched off, instead of ending the run.
    """

    def __init__(self, cfg: DictConfig):
        self.jsonl = MetricsWriter(cfg.runtime_args.output_dir)
        self.samples = SamplesWriter(cfg.runtime_args.output_dir)
        self.path = self.jsonl.path
        self._sinks: list = []
        self._closed = False
        la = cfg.runtime_args.log_args_dict
        tb_dir, wandb_dir = sink_dirs(cfg)
        try:
            if la.enable_tensorboard:
                self._sinks.append(TensorBoardSink(tb_dir, cfg))
            if la.enable_wandb:
                self._sinks.append(WandbSink(wandb_dir, cfg))
        except BaseException:
            self.close()
            raise

    def write(self, episode: int, metrics: dict) -> None:
        self.jsonl.write(episode, metrics)
        self._to_sinks("write", episode, metrics)

    def write_samples(self, episode: int, rows: list[dict]) -> None:
        """Sampled prompt/response rows of ``episode``: to ``samples.jsonl``, TensorBoard (a markdown
        table, text tab) and W&B (a table), with the same failure handling as :meth:`write`."""
        self.samples.write(episode, rows)
        self._to_sinks("write_samples", episode, rows)

    def _to_sinks(self, method: str, *args) -> None:
        """``sink.<method>(*args)`` on every sink; one that fails is reported once and switched off."""
        for sink in list(self._sinks):
            try:
                getattr(sink, method)(*args)
            except Exception as err:  # noqa: BLE001 (a monitoring failure must not end training)
                self._sinks.remove(sink)
                info(f"{sink.name} logging stopped after an error: {err}")
                _close_quietly(sink)

    def truncate_after(self, episode: int) -> None:
        """Drop ``metrics.jsonl`` and ``samples.jsonl`` rows past ``episode`` (on resume; the other
        sinks keep their history)."""
        self.jsonl.truncate_after(episode)
        self.samples.truncate_after(episode)

    def close(self) -> None:
        sinks, self._sinks = self._sinks, []
        for sink in sinks:
            _close_quietly(sink)
        if not self._closed:
            self._closed = True
            self.jsonl.close()
            self.samples.close()


def _close_quietly(sink) -> None:
    try:
        sink.close()
    except Exception:  # noqa: BLE001 (closing is best effort)
        pass


class TensorBoardSink:
    name = "TensorBoard"

    def __init__(self, log_dir: str, cfg: DictConfig):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise UserError(f"runtime_args.log_args_dict.enable_tensorboard is True but TensorBoard cannot be "
                            f"imported ({err}). Install it (pip install tensorboard) or turn the option off.")
        try:
            self.writer = SummaryWriter(log_dir=log_dir)
        except OSError as err:
            raise UserError(f"cannot write TensorBoard logs to {log_dir!r}: {err}. Fix "
                            "runtime_args.log_args_dict.tensorboard_dir.")
        yaml_text = config_yaml(cfg)
        # indented lines render as a preformatted block in TensorBoard's markdown
        self.writer.add_text("config", "\n".join("    " + line for line in yaml_text.splitlines()), 0)
        self.writer.flush()

    def write(self, episode: int, metrics: dict) -> None:
        for key, value in sorted(metrics.items()):
            if value is not None:
                self.writer.add_scalar(key, float(value), episode)
        self.writer.flush()

    def write_samples(self, episode: int, rows: list[dict]) -> None:
        self.writer.add_text("samples", samples_markdown(rows), episode)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    name = "W&B"

    def __init__(self, root: str, cfg: DictConfig):
        try:
            import wandb
        except ImportError as err:
            raise UserError(f"runtime_args.log_args_dict.enable_wandb is True but wandb cannot be imported "
                            f"({err}). Install it (pip install wandb) or turn the option off.")
        la, rt = cfg.runtime_args.log_args_dict, cfg.runtime_args
        mode = None  # wandb reads WANDB_MODE itself
        if not os.environ.get("WANDB_MODE") and not wandb_credentials_configured():
            mode = "offline"
            info(f"wandb: no API key configured (WANDB_API_KEY or `wandb login`); recording the run offline "
                 f"under {os.path.join(root, 'wandb')} (upload it later with `wandb sync`)")
        os.makedirs(root, exist_ok=True)
        try:
            self.run = wandb.init(project=la.wandb_project or rt.exp_name, name=la.wandb_name, id=la.wandb_id,
                                  resume=la.wandb_resume, dir=root, mode=mode, config=loggable_config(cfg),
                                  # the run's own console output stays on the console only
                                  settings=wandb.Settings(console="off", quiet=True))
        except Exception as err:  # noqa: BLE001 (wandb raises its own error types for auth and network)
            raise UserError(f"cannot start the W&B run: {' '.join(str(err).split())}. Check WANDB_API_KEY and "
                            "the runtime_args.log_args_dict.wandb_* keys, or set WANDB_MODE=offline.")
        self.run.define_metric("episode")
        self.run.define_metric("*", step_metric="episode")

    def write(self, episode: int, metrics: dict) -> None:
        row = {k: float(v) for k, v in metrics.items() if v is not None}
        row["episode"] = episode
        self.run.log(row)

    def write_samples(self, episode: int, rows: list[dict]) -> None:
        import wandb

        # the episode as a column too: tables of several episodes stay apart once merged or exported
        table = wandb.Table(columns=["episode", *SAMPLE_COLUMNS],
                            data=[[episode, *(r.get(c) for c in SAMPLE_COLUMNS)] for r in rows])
        self.run.log({"samples": table, "episode": episode})

    def close(self) -> None:
        self.run.finish()


def wandb_credentials_configured() -> bool:
    """Whether W&B would find credentials: WANDB_API_KEY, an identity token file, or ``wandb login``'s netrc."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False
