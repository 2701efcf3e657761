"""A reward function that ends its process (``os._exit``, ``sys.exit``): the run stops naming the function,
that it exited and with which code, never blaming the OOM killer. The reward worker runs in a child
process here (a function that really ended the process would end the test's)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

REWARDS = '''
import multiprocessing
import os
import sys


def exits(*, prompts, responses, ground_truths, data_sources, extra):
    os._exit(3)


def sys_exits(*, prompts, responses, ground_truths, data_sources, extra):
    sys.exit(4)


def _child(q):
    q.put(1.0)


def forks(*, prompts, responses, ground_truths, data_sources, extra):
    ctx = multiprocessing.get_context("fork")  # the child ends with os._exit, as multiprocessing's do
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    p.join()
    assert p.exitcode == 0, p.exitcode
    return [q.get()] * len(responses)
'''

SCORE = textwrap.dedent('''
    import json, sys
    from chatlearn.errors import UserError
    from chatlearn.models.reward.functions import RewardManager, resolve_entries
    from chatlearn.models.specs import RewardSpec

    entry = json.loads(sys.argv[1])
    spec = RewardSpec(functions=tuple(resolve_entries({"functions": [entry], "correct_score": 1.0,
                                                       "incorrect_score": 0.0})), base_dir=None, timeout_s=0.0)
    batch = {"prompts": ["p"], "responses": ["r"], "ground_truths": ["1"], "data_sources": ["d"], "extra": [{}]}
    try:
        print(json.dumps(RewardManager(spec).score_one(0, batch)["score"].tolist()))
    except UserError as err:
        print("USERERROR " + err.message)
''')


def score_in_child(tmp_path, function: str) -> subprocess.CompletedProcess:
    path = tmp_path / "my_reward.py"
    path.write_text(REWARDS)
    entry = {"name": "mine", "path": f"{path}:{function}", "weight": 1.0, "kwargs": {}}
    return subprocess.run([sys.executable, "-c", SCORE, json.dumps(entry)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("function, call, code", [("exits", "os._exit", 3), ("sys_exits", "sys.exit", 4)])
def test_a_reward_function_that_exits_the_process_is_named(tmp_path, function, call, code):
    proc = score_in_child(tmp_path, function)
    assert proc.returncode == 0, f"the worker's process ended ({proc.returncode}): {proc.stderr[-2000:]}"
    message = proc.stdout.split("USERERROR ", 1)[-1]
    for word in ("the reward worker exited while scoring", "reward function 'mine' (models.reward.functions[0], ",
                 f"my_reward.py:{function}'", f"called {call}({code})", f"exit code {code}"):
        assert word in message, proc.stdout + proc.stderr
    assert "OOM" not in message and "out of memory" not in message


def test_child_processes_of_a_reward_function_still_exit(tmp_path):
    """multiprocessing's forked children end with os._exit: theirs is not refused."""
    proc = score_in_child(tmp_path, "forks")
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "[1.0]", proc.stdout + proc.stderr


def test_a_reward_worker_that_died_while_scoring_names_the_function():
    """The worker's process ended in a way Python could not see (exit() in native code, a kill): the
    driver names the function that was running, not Ray's list of guesses."""
    import ray

    from chatlearn.runtime.driver.sampling import Sampling

    died = ray.exceptions.RayActorError(error_msg=(
        "The actor died unexpectedly before finishing this task.\n\tclass_name: Worker\n\tpid: 4242\n"
        "The actor is dead because its worker process has died. Some common causes include: (1) the process "
        "was killed by the OOM killer due to high memory usage"))
    err = Sampling.reward_worker_died(died, 1, {"name": "mine", "path": "my_reward.py:score"}, "the rollouts of "
                                      "episode 2")
    message = " ".join(err.message.split())
    for word in ("the reward worker (process 4242) exited while scoring the rollouts of episode 2",
                 "reward function 'mine' (models.reward.functions[1], 'my_reward.py:score')",
                 "logs/worker-4242.log"):
        assert word in message, message
    assert "OOM" not in message and "class_name" not in message
