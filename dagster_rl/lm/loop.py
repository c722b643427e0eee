"""The language-model step in one process: what the CPU example and the tests run.

`inprocess_step` generates the step's rollouts with the current adapter, scores them and trains
once; `evaluate` scores greedy completions of the held-out split. The Dagster driver calls the
same pieces one by one (rollouts, rewards, then the worker) to store each as an artifact.
"""

from pydantic import BaseModel

from dagster_rl.lm.policy import Policy
from dagster_rl.lm.rewards import LMReward, LMRubric, score, score_text
from dagster_rl.lm.rollout_hf import LMRollout, generate_rollouts, greedy_completions, plan_requests
from dagster_rl.lm.settings import GRPOLMSettings, SamplingSettings
from dagster_rl.lm.tasks import PromptSet, prompts_for_step
from dagster_rl.lm.trainer import TrainMetrics, build_samples, train_step


class EvalResult(BaseModel):
    n: int
    accuracy: float
    mean_reward: float


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
) -> tuple[list[LMRollout], list[LMReward], TrainMetrics]:
    items = prompts_for_step(prompt_set.train, seed, step, prompts_per_step)
    rollouts = generate_rollouts(policy, plan_requests(items, seed, step, n_samples), sampling, prompt_set.template)
    rewards = [score(r, rubric) for r in rollouts]
    samples, facts = build_samples(rollouts, rewards, grpo.advantage_eps)
    return rollouts, rewards, train_step(policy, optimizer, samples, len(samples), grpo, facts)


def evaluate(policy: Policy, prompt_set: PromptSet, rubric: LMRubric, max_new_tokens: int) -> EvalResult:
    texts = greedy_completions(policy, prompt_set.eval, prompt_set.template, max_new_tokens)
    scored = [score_text(t, it.reference, rubric) for t, it in zip(texts, prompt_set.eval)]
    correct = [a is not None and a == it.reference for (a, _), it in zip(scored, prompt_set.eval)]
    n = len(texts)
    return EvalResult(
        n=n,
        accuracy=sum(correct) / n if n else 0.0,
        mean_reward=sum(sum(c.values()) for _, c in scored) / n if n else 0.0,
    )
