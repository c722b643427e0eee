"""The `on_policy` check of a language-model step: the trainer's log-probability of every sampled
token against the sampler's, checked where the behavior policy is the trained policy, reported
where it lags; a failing step's rollouts are moved aside (those generated a step ahead too) so that
a re-run samples them again; and what a vLLM server would refuse is refused when the file loads."""

from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from dagster_rl.core.checks import on_policy
from dagster_rl.core.task import Backends
from dagster_rl.judges.rubric_judge import RubricJudge
from dagster_rl.store.artifact_store import ArtifactStore
from dagster_rl.tasks.lm.backends import HFRollouts, LMTrainer
from dagster_rl.tasks.lm.experiment import LMExperiment
from dagster_rl.tasks.lm.loop import LMLoop
from dagster_rl.tasks.lm.rewards import score
from tests.settings import tiny_grpo


def small_experiment(**overrides) -> LMExperiment:
    """tiny_grpo without its warm-up: 4 steps of 4 prompts x 4 samples."""
    raw = tiny_grpo(n_steps=4, prompts_per_step=4, n_samples=4, min_trials_per_step=8, **overrides)
    raw.pop("warmup")
    return LMExperiment.model_validate(raw)


def test_the_check_bounds_the_largest_and_the_mean_difference_and_reports_a_lagged_step():
    f32, bf16 = (1e-3, 1e-3), (1.0, 0.02)
    ok = on_policy(4.8e-7, 1e-8, f32, "float32", behavior_version=3, trained_version=3)
    assert ok.passed and ok.value == 4.8e-7 and ok.message.endswith("(bounds 0.001 and 0.001, float32)")
    bad = on_policy(1.04, -0.2, f32, "float32", behavior_version=3, trained_version=3)
    assert not bad.passed and bad.value == 1.04
    for cause in ("--generation-config vllm", "--logprobs-mode processed_logprobs", "dtype", "stale adapter", "moved aside"):
        assert cause in bad.message, cause
    # bfloat16: a large difference on a few tokens is rounding; a shift of the mean is another distribution
    assert on_policy(0.66, -0.0015, bf16, "bfloat16", 3, 3).passed
    assert not on_policy(0.3, -0.05, bf16, "bfloat16", 3, 3).passed  # e.g. a top-p 0.95 cut: -log(0.95) a token
    lagged = on_policy(0.3, 0.1, f32, "float32", behavior_version=2, trained_version=3)
    assert lagged.passed and lagged.value == 0.3 and lagged.message.startswith("not checked: the rollouts' behavior policy v2")
    assert not on_policy(None, 0.0, f32, "float32", 1, 1).passed and not on_policy(float("nan"), 0.0, f32, "float32", 1, 1).passed


def test_the_tolerance_is_the_dtypes_unless_the_experiment_sets_it():
    assert small_experiment().on_policy_tolerance == (1e-3, 1e-3)
    assert small_experiment(policy={"base_model": "builtin:tiny-qwen2", "dtype": "bfloat16"}).on_policy_tolerance == (1.0, 0.02)
    assert small_experiment(checks={"on_policy_tolerance": 0.01}).on_policy_tolerance == (0.01, 1e-3)


def test_an_openai_server_experiment_that_targets_lm_head_or_cuts_top_p_fails_at_load_naming_the_field():
    with pytest.raises(ValidationError, match=r"policy.lora.target_modules names \['lm_head'\]: rollout backend openai_server"):
        small_experiment(rollout={"backend": "openai_server"})  # tiny_grpo's adapter targets lm_head
    lora = {"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], "init_seed": 7}
    with pytest.raises(ValidationError, match=r"sampling.top_p is 0.9: rollout backend openai_server needs top_p 1"):
        small_experiment(
            rollout={"backend": "openai_server"},
            policy={"base_model": "builtin:tiny-qwen2", "lora": lora},
            sampling={"top_p": 0.9},
        )
    assert small_experiment(sampling={"top_p": 0.9}).sampling.top_p == 0.9  # the hf engine records the log-probs before top-p


@dataclass
class Skewed(HFRollouts):
    """The hf engine, with its recorded log-probabilities off by `by`: a sampler the trainer does not score."""

    by: float = 0.0

    def generate(self, exp, requests, behavior, template, on_done=None):
        out = [
            r.model_copy(update={"sampling_logprobs": [v + self.by for v in r.sampling_logprobs]})
            for r in super().generate(exp, requests, behavior, template)
        ]
        for r in out:
            if on_done is not None:
                on_done(r)
        return out


def run(exp, store, rollout, steps):
    """The loop as the driver walks it: step by step, stopping at the first failed check."""
    backends = Backends(rollout, RubricJudge(lambda e, r: score(r, e.rubric)), LMTrainer())
    loop, results = LMLoop(), {}
    for r in loop.iter_steps(exp, steps, loop.initial_weights(exp, store), store, backends, print):
        if hasattr(r, "checks"):
            results[r.step] = r
            if not all(c.passed for c in r.checks):
                break
    return results


def test_pipelined_steps_check_the_step_whose_behavior_is_the_trained_policy_and_report_the_others(tmp_path):
    exp = small_experiment(max_policy_lag=1)
    results = run(exp, ArtifactStore(f"file://{tmp_path}/artifacts"), HFRollouts(), [0, 1, 2])
    checks = {k: next(c for c in r.checks if c.name == "on_policy") for k, r in results.items()}
    assert all(c.passed for c in checks.values())
    assert checks[0].message.endswith("(bounds 0.001 and 0.001, float32)") and results[0].metrics["logp_max_dev"] < 1e-5
    assert abs(results[0].metrics["logp_mean_dev"]) < 1e-6
    for k in (1, 2):  # generated with the weights of step k - 2: the lag's drift, reported
        assert checks[k].message.startswith(f"not checked: the rollouts' behavior policy v{k - 1} is not the trained policy v{k}")
        assert checks[k].value == results[k].metrics["logp_max_dev"] > 1e-5


def test_with_the_mismatch_correction_a_lagged_step_is_checked_against_the_recomputed_behavior_log_probs(tmp_path):
    """At lag 2 with `grpo.mismatch` the trainer recomputes the log-probs of the weights that sampled
    each stale step (a no-grad forward with their adapter): they equal the sampler's within
    rounding, so every step is checked, and the mismatch weight is 1 to rounding (nothing capped)."""
    exp = small_experiment(max_policy_lag=2, grpo={"mismatch": {"level": "token", "action": "truncate", "cap": 2.0}})
    results = run(exp, ArtifactStore(f"file://{tmp_path}/artifacts"), HFRollouts(), [0, 1, 2, 3])
    assert [r.metrics["behavior_step"] for r in results.values()] == [-1.0, -1.0, -1.0, 0.0]
    assert [r.metrics["policy_lag"] for r in results.values()] == [0.0, 1.0, 2.0, 2.0]
    for k, r in results.items():
        check = next(c for c in r.checks if c.name == "on_policy")
        assert check.passed and not check.message.startswith("not checked"), (k, check.message)
        assert r.metrics["logp_max_dev"] < 1e-5 and r.metrics["mismatch_capped_frac"] == 0.0, (k, r.metrics)
        assert r.metrics["mismatch_weight"] == pytest.approx(1.0, abs=1e-5)
        if k:  # stale: the trainer's recomputation, not its own forward, is what it compared
            assert "recomputed with the behavior weights v" in check.message and r.metrics["ratio_max_dev"] > 1e-5


@pytest.mark.parametrize("lag", [0, 1, 3])
def test_a_step_off_policy_fails_its_check_and_its_rollouts_are_moved_aside_with_the_next_steps(tmp_path, lag):
    exp = small_experiment(max_policy_lag=lag)
    store = ArtifactStore(f"file://{tmp_path}/artifacts")
    results = run(exp, store, Skewed(by=0.01), [0, 1])
    assert list(results) == [0]  # stopped there
    check = next(c for c in results[0].checks if c.name == "on_policy")
    assert not check.passed and check.value == pytest.approx(0.01, abs=1e-4)
    moved = sorted(p.name.split(".")[0] for p in (tmp_path / "artifacts" / "quarantine" / "rollouts").iterdir())
    assert results[0].refs["rollouts"].key in moved and not store.exists("rollouts", results[0].refs["rollouts"].key)
    # lag 1: step 1 was generated a step ahead by the same sampler with the initial weights, which a
    # re-run reaches again: moved aside too. Lag 0: it was generated with step 0's weights, which no
    # re-run after the fix reaches (its rollouts differ, so do its weights). Lag 3: steps 1-3 were
    # queued with the initial weights: those that had started are moved aside, the others never sampled
    assert len(moved) == (2 if lag == 1 else 1) if lag < 3 else 2 <= len(moved) <= 4
    assert not [p for p in (tmp_path / "artifacts" / "rollouts").iterdir() if (p / "manifest.json").exists()]
    # the fix: the same steps sample again, and pass
    again = run(exp, store, HFRollouts(), [0])
    assert again[0].cache["rollouts"] == "miss" and all(c.passed for c in again[0].checks)
    assert store.exists("rollouts", again[0].refs["rollouts"].key)
