"""The shipped SmolLM2 experiment through `dagster-rl train`, at a tiny batch: three GRPO steps of a
real pretrained model with tied embeddings, each step's held-out evaluation running in a thread beside
the next step (where two model loads at once used to leave lm_head on the meta device at step 1)."""

import subprocess

from dagster import DagsterInstance

from tests import REPO
from tests.cli_runs import BIN, home_with
from tests.harness import open_lab
from tests.lm_fixtures import FLOAT32_TOLERANCE
from tests.settings import shipped_settings
from tests.smollm2 import SMOLLM2_EXPERIMENT, TINY_BATCH, require_smollm2

STEPS = ("0000", "0001", "0002")


def test_three_steps_of_the_shipped_experiment_through_dagster_rl_train(tmp_path):
    require_smollm2()
    home, env = home_with(tmp_path, shipped_settings(SMOLLM2_EXPERIMENT, **TINY_BATCH))
    done = subprocess.run(
        [str(BIN / "dagster-rl"), "train", SMOLLM2_EXPERIMENT, f"{STEPS[0]}...{STEPS[-1]}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    with DagsterInstance.from_config(str(home)) as instance:
        [run] = instance.get_runs()
    assert run.tags["dagster_rl/range"] == f"{STEPS[0]}...{STEPS[-1]}"
    lab = open_lab(home, home / "experiments")
    try:
        weights = [lab.latest(SMOLLM2_EXPERIMENT, "weights", s) for s in STEPS]
        evaluations = [lab.latest(SMOLLM2_EXPERIMENT, "evaluation", s) for s in STEPS]
    finally:
        lab.close()
    assert [w["weights_version"] for w in weights] == [1, 2, 3]
    assert all(w["n_trials"] == 4 and w["policy_lag"] == 0.0 for w in weights)
    assert all(0.0 <= w["judge_s"] <= w["generate_s"] and w["train_s"] > 0.0 for w in weights)  # a step's time, split
    # on-policy at every step: the trainer's log-probs of the sampled tokens are the sampler's, within the
    # on_policy check's float32 bound (30 layers of hidden 576 round more than the tiny models: up to 1.6e-4
    # measured over 15 steps of 48 samples)
    assert all(w["logp_max_dev"] <= FLOAT32_TOLERANCE for w in weights), [w["logp_max_dev"] for w in weights]
    assert all(e["n_prompts"] == 4 and e["weights_version"] == v for e, v in zip(evaluations, (1, 2, 3), strict=True))
    assert len({e["base_accuracy"] for e in evaluations}) == 1  # the base, evaluated once, the same for every step
