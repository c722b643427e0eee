"""One language-model GRPO step in memory, no store, no Dagster: what the learning test and the
TRL benchmark run. The loop (`lm.loop`) calls the same pieces one by one to store each artifact."""

from dagster_rl.tasks.lm.data.prompts import PromptSet, prompts_for_step
from dagster_rl.tasks.lm.model.policy import Policy
from dagster_rl.tasks.lm.records import LMRollout, plan_requests
from dagster_rl.tasks.lm.rewards import LMReward, LMRubric, score
from dagster_rl.tasks.lm.rollout.hf import generate_rollouts
from dagster_rl.tasks.lm.settings import GRPOLMSettings, SamplingSettings
from dagster_rl.tasks.lm.train.reference import Reference
from dagster_rl.tasks.lm.train.trainer import TrainMetrics, build_samples, train_step


def inprocess_step(
    policy: Policy,
    optimizer,
    prompt_set: PromptSet,
    seed: int,
    step: int,
    prompts_per_step: int,
    n_samples: int,
    sampling: SamplingSettings,
    rubric: LMRubric,
    grpo: GRPOLMSettings,
    reference: Reference | None = None,
) -> tuple[list[LMRollout], list[LMReward], TrainMetrics]:
    items = prompts_for_step(prompt_set.train, seed, step, prompts_per_step)
    rollouts = generate_rollouts(policy, plan_requests(items, seed, step, n_samples), sampling, prompt_set.template)
    rewards = [score(r, rubric) for r in rollouts]
    samples, facts = build_samples(rollouts, rewards, grpo.advantage_eps)
    # on-policy: the policy being trained sampled them, so the ratio's old policy is its own (TRL's one iteration)
    return (
        rollouts,
        rewards,
        train_step(policy, optimizer, samples, len(samples), grpo, facts, reference=reference, old_logp="trainer"),
    )
