"""What a run's checkpoint holds, and resuming from it: every trained model's state (in the folder its
kind declares, chatlearn/config/kinds.py), the replay buffer, the rollouts ahead, the data sampler and
the config, under one step counter (:class:`~chatlearn.checkpoint.manager.CheckpointManager` makes
each one atomic)."""
from __future__ import annotations

import os

from chatlearn.checkpoint.manager import CheckpointManager
from chatlearn.config.data_fingerprint import data_fingerprint
from chatlearn.config.names import Part
from chatlearn.errors import UserError
from chatlearn.logging.console import info, warn
from chatlearn.runtime.driver.overlap import kept_rollouts


class RunCheckpoints:
    """Saves and restores the state of a run's trained models and of the driver's parts beside them
    (``replay``, ``pipeline``: the rollouts ahead or None, ``sampler``)."""

    def __init__(self, cfg, plan, sched, trained: tuple[str, ...], replay, pipeline, sampler, config_text: str):
        rt = cfg.runtime_args
        self.cfg, self.plan, self.sched, self.trained = cfg, plan, sched, trained
        self.replay, self.pipeline, self.sampler, self.config_text = replay, pipeline, sampler, config_text
        self.ckpt = CheckpointManager(os.path.join(rt.output_dir, "checkpoints"), rt.keep_last_checkpoints)
        # what the train data is, by content: a resumed run compares its own (config_history.check_resume)
        self.data = data_fingerprint(rt.data_path)
        self.pending: int | None = None  # the episode whose checkpoint is saved, not yet committed

    def due(self, episode: int) -> bool:
        """Whether episode ``episode`` ends with a checkpoint (the last, and every ``save_episode_interval``)."""
        rt = self.cfg.runtime_args
        return episode == rt.num_episode or (rt.save_episode_interval > 0 and episode % rt.save_episode_interval == 0)

    def folder(self, model: str) -> str:
        """The folder of ``model``'s state inside a checkpoint (its kind's)."""
        return self.plan.kind(model).checkpoint_folder

    def save(self, episode: int) -> None:
        """Every trained model's sharded state, the replay buffer, the rollouts ahead, the data sampler and
        the run's config, plus a Hugging Face folder of the policy when ``save_hf``: complete, but committed
        (:meth:`commit`) only once the episode's metrics row is written, so that the checkpoint and its row
        are one unit: a run killed between them resumes from the checkpoint before and runs the episode
        again (its push, evaluation and row), never past an episode whose metrics are lost."""
        def write(tmp: str) -> None:
            # the model resident now last (it stays resident for what follows: the policy trainer for the
            # weight push), so that models taking turns move only as much as they must
            trained = sorted(self.trained, key=lambda m: self.sched.is_resident(m, self.sched.parts(m)))
            for model in trained:
                self.sched.take_turn(model)
                self.sched.groups[model].call("save_checkpoint", os.path.abspath(os.path.join(tmp, self.folder(model))))
            self.replay.save(tmp)
            if self.pipeline is not None:  # the finished rollouts of the episodes after this one
                self.pipeline.save(tmp)
            if self.cfg.models.policy_trainer.save_hf:
                self.sched.ensure("policy_trainer", [Part.WEIGHTS])
                self.sched.groups["policy_trainer"].call("save_hf", os.path.abspath(os.path.join(tmp, "hf")))

        self.ckpt.save(episode, write, {"sampler": self.sampler.state_dict(), "data": self.data},
                       config_text=self.config_text, commit=False)
        self.pending = episode

    def commit(self) -> None:
        """Commit the checkpoint saved in this episode (nothing when none was): after its metrics row."""
        if self.pending is not None:
            self.ckpt.commit(self.pending)
            self.pending = None

    def restore(self) -> tuple[int, str] | None:
        """The newest complete checkpoint's ``(episode, path)`` with every trained model's state, the sampler
        and the replay buffer loaded from it; None when there is none. The rollout engine still holds the
        initial weights: the caller pushes the checkpoint's."""
        found = self.ckpt.latest_usable(warn=warn)
        if found is None:
            return None
        episode, path = found
        state = self.ckpt.read_state(path)
        self.ckpt.adopt(state)  # keep-last-N goes on counting this run's checkpoints
        info(f"resuming from {path} (episode {episode})")
        kept_rollouts(path, self.plan.max_staleness)  # refused before anything loads when the bound changed
        for model in self.trained:
            self.sched.take_turn(model)
            try:
                self.sched.groups[model].call("load_checkpoint", os.path.abspath(os.path.join(path, self.folder(model))))
            except UserError as err:  # from the trainer ranks, wrapped by Ray
                cause = getattr(err, "cause", None) or err
                raise UserError(
                    f"cannot resume from the newest checkpoint {path!r}: {cause.message} To resume from the "
                    f"checkpoint before it, delete or move that folder; to start "
                    "over, run with --no-resume or set runtime_args.enable_resume_training=false.") from err
        self.sampler.load_state_dict(state["sampler"])
        self.replay.load(path)
        return episode, path
