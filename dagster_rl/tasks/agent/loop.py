"""The agent's loop: the language-model loop (`dagster_rl.tasks.lm.loop.LMLoop`: weights, pipelining, the
GRPO update, the `on_policy` check, evaluation off the critical path) over episodes instead of
completions.

A step plays `prompts_per_step` fresh training worlds, `n_samples` trials each (trial
`s{step}-p{p}-n{n}` plays world `t{step}.{p}`, seeded by (experiment seed, step, p, n)); each
trajectory goes to the judge the moment its episode ends, while the others still play. The
rollouts and rewards are trial sets (`dagster_rl.core.steps.trial_set`): a failed trial is never cached.
The warm-up (`<exp>/sft`) fits the adapter to the environment's demonstrations; every step's
held-out evaluation plays `task.n_eval` other worlds greedily and reports success and mean turns
beside the warm-up's (`start_*`) and the base model's (`base_*`).
"""

import tempfile
import time
from pathlib import Path

from dagster_rl.base import counters
from dagster_rl.base.errors import ArtifactConflictError
from dagster_rl.base.hashing import cache_key, canonical_json, seed_of
from dagster_rl.core.experiment import step_key
from dagster_rl.core.progress import Progress
from dagster_rl.core.records import CALL_TIMES, CallTimes, Rewards, Rollouts, TrialFailed, call_times_key
from dagster_rl.core.steps import Judged, judge_as_they_land, mean, recovered, rewards_key, rollouts_key, step_rewards, trial_set
from dagster_rl.core.task import Backends, StepAsset, WarmupResult, Warn, Weights
from dagster_rl.sandbox.bubblewrap import default_sandboxes
from dagster_rl.sandbox.placement import Sandboxes
from dagster_rl.store.artifact_store import ArtifactRef, ArtifactStore
from dagster_rl.tasks.agent.environment import World, environment_of
from dagster_rl.tasks.agent.evaluation import AgentEvaluation, evaluate
from dagster_rl.tasks.agent.experiment import AgentExperiment as Exp
from dagster_rl.tasks.agent.records import AgentReward, AgentTrajectory, EpisodeRequest
from dagster_rl.tasks.agent.rollout_hf import TrialTimes
from dagster_rl.tasks.agent.warmup import AgentWarmupStats, warm_up
from dagster_rl.tasks.lm.backend_protocols import Checkpoint
from dagster_rl.tasks.lm.loop import LMLoop
from dagster_rl.tasks.lm.model.policy import load_policy
from dagster_rl.tasks.lm.step_generation import Generated
from dagster_rl.tasks.lm.train.warmup import WARMUP
from dagster_rl.tasks.lm.weights import base_weights, stored_weights, torch_threads

CODE_VERSIONS = {
    "warmup": "agent-sft-1",
    "rollouts": "agent-hf-rollouts-2",  # 2: hf turns continue the KV cache of the turn before (other float rounding)
    "rewards": "agent-rubric-1",
    # 2: its greedy turns continue the KV cache (a tie may break otherwise); 3: an episode that failed is played again,
    # and one that fails every attempt fails the evaluation (it was stored as a failed episode: `failed`)
    "evaluation": "agent-greedy-eval-3",
}


def sandbox_root() -> Path:
    """Where the warm-up's and the evaluation's episodes keep their trials' folders (the rollout
    environment's scratch folder holds the steps')."""
    return Path(tempfile.gettempdir()) / "dagster_rl_sandboxes"


def checked_sandboxes(exp: Exp, sandboxes: Sandboxes | None) -> Sandboxes | None:
    """Where the experiment's programs run (`sandboxes`, else bubblewrap on this machine), checked to make
    sandboxes before the first episode when its environment runs programs (a `SandboxUnavailable` naming what
    to install otherwise); None when it runs none."""
    if not environment_of(exp.task.environment.name).runs_programs:
        return None
    sandboxes = sandboxes or default_sandboxes()
    sandboxes.check()
    return sandboxes


def tool_metrics(exp: Exp, trajectories: list[AgentTrajectory]) -> dict[str, float]:
    """The share of trials that ran a program, and programs per trial (environments that run programs only)."""
    if not environment_of(exp.task.environment.name).runs_programs:
        return {}
    calls = [sum(len(turn.calls) for turn in t.turns) for t in trajectories]
    return {"tool_call_share": mean([float(n > 0) for n in calls]), "tool_calls_per_trial": mean([float(n) for n in calls])}


def environment_timings(times: dict[str, TrialTimes]) -> dict[str, float]:
    """Of a step's generate_s: its trials' environments' answers, and their programs in the sandbox (sums over trials)."""
    return {"environment_s": sum(t.environment_s for t in times.values()), "sandbox_s": sum(t.sandbox_s for t in times.values())}


def tool_shares(evaluation: AgentEvaluation, **others: AgentEvaluation) -> dict[str, float]:
    """`tool_call_share` of an evaluation, and of the others as `<name>_tool_call_share` (environments that run programs)."""
    if evaluation.tool_call_share is None:
        return {}
    found = {"tool_call_share": evaluation.tool_call_share}
    return found | {f"{k}_tool_call_share": e.tool_call_share for k, e in others.items() if e.tool_call_share is not None}


def store_call_times(store: ArtifactStore, trajectories: list[AgentTrajectory], times: dict[str, TrialTimes]) -> None:
    """Each new trajectory's program wall times (`call_times`, keyed by the trajectory's content):
    beside the trajectory, not in it, so a trial replayed elsewhere stores the same bytes; the first
    writer's times are kept."""
    for t in trajectories:
        known = times.get(t.trial_id)
        if known is None or not any(turn.calls for turn in t.turns):
            continue
        key = call_times_key(t)
        if not store.exists(CALL_TIMES, key):
            try:
                store.put_model(CALL_TIMES, key, CallTimes(trial_id=t.trial_id, seconds=known.calls))
            except ArtifactConflictError:
                pass  # another writer stored this trajectory's times first


def plan_episodes(exp: Exp, step: int) -> list[EpisodeRequest]:
    requests = []
    for p in range(exp.prompts_per_step):
        world = exp.training_world(step, p)
        for n in range(exp.n_samples):
            seed = seed_of(exp.seed, step, p, n)
            requests.append(
                EpisodeRequest(
                    trial_id=f"s{step}-p{p}-n{n}",
                    step=step,
                    prompt=p,
                    sample=n,
                    world_id=world.id,
                    world_seed=world.seed,
                    seed=seed,
                )
            )
    return requests


class AgentLoop(LMLoop):
    """The loop; `sandboxes`: where the environments' programs run in the warm-up's and the
    evaluations' episodes (a run's rollout backend names its own; default: bubblewrap on this machine)."""

    def __init__(self, sandboxes: Sandboxes | None = None):
        self.sandboxes = sandboxes

    def sandboxes_for(self, exp: Exp) -> Sandboxes | None:
        """Where the experiment's programs run (see `checked_sandboxes`)."""
        found = checked_sandboxes(exp, self.sandboxes)
        self.sandboxes = found or self.sandboxes
        return found

    def program_inputs(self, exp: Exp) -> dict[str, str]:
        """What a key holds of the sandbox: the interpreter programs run on (environments that run programs)."""
        return {"sandbox": sandboxes.identity()} if (sandboxes := self.sandboxes_for(exp)) is not None else {}

    def iter_steps(self, exp, steps, start, store, backends, warn):
        """The language-model loop's, with the rollout backend's sandboxes for the evaluations too."""
        self.sandboxes = getattr(backends.rollout, "sandboxes", None) or self.sandboxes
        return super().iter_steps(exp, steps, start, store, backends, warn)

    def prompt_set(self, exp: Exp) -> list[World]:  # type: ignore[override]
        """The held-out worlds (a step's training worlds are its own: `plan_episodes`)."""
        return exp.heldout_worlds()

    def initial_weights(self, exp: Exp, store: ArtifactStore) -> Weights[Checkpoint]:  # type: ignore[override]
        """Step 0's weights: the warm-up's adapter when the experiment has one, else the base's."""
        if exp.warmup is None:
            return base_weights(exp, store)
        files, ref, _ = self._warmup(exp, store)
        return stored_weights("sft", ref, files)

    # ---- the warm-up --------------------------------------------------------------------------
    def _warmup(self, exp: Exp, store: ArtifactStore) -> tuple[dict[str, bytes], ArtifactRef, bool]:
        settings = exp.warmup
        if settings is None:
            raise ValueError(f"experiment {exp.name} has no warmup section")
        env = exp.task.environment
        key = cache_key(
            "weights",
            CODE_VERSIONS["warmup"],
            policy=exp.policy,
            warmup=exp.warmup,
            environment=env,
            environment_code=environment_of(env.name).code_version,
            max_turns=exp.demo_turns,
            seed=exp.seed,
            **self.program_inputs(exp),
        )

        def compute() -> dict[str, bytes]:
            counters.bump("warmups")
            with torch_threads(exp.trainer.threads_per_process):  # a training job, sized like the trainer's
                files, stats = warm_up(load_policy(exp.policy), exp, settings, sandbox_root(), self.sandboxes_for(exp))
            return {**files, WARMUP: canonical_json(stats)}

        return store.get_or_put_files("weights", key, compute)

    def warmup(self, exp: Exp, store: ArtifactStore) -> WarmupResult:  # type: ignore[override]
        """The `<exp>/sft` asset: the warm-up and its held-out greedy success and turns beside the base's."""
        t0 = time.monotonic()
        files, ref, hit = self._warmup(exp, store)
        stats = AgentWarmupStats.model_validate_json(files[WARMUP])
        worlds = self.prompt_set(exp)
        sft, _, _ = self._evaluation(exp, stored_weights("sft", ref, files), worlds, store)
        base, _, _ = self._evaluation(exp, base_weights(exp, store), worlds, store)
        return WarmupResult(
            cache="hit" if hit else "miss",
            ref=ref,
            metadata={
                "success": sft.success,
                "mean_turns": sft.mean_turns,
                "mean_reward": sft.mean_reward,
                "base_success": base.success,
                "base_mean_turns": base.mean_turns,
                **tool_shares(sft, base=base),
                "n_worlds": sft.n,
                "demos": stats.demos,
                "demo_turns": stats.demo_turns,
                "sft_steps": len(stats.losses),
                "first_loss": stats.losses[0],
                "final_loss": stats.losses[-1],
                "action_tokens": stats.tokens,
                "warmup_s": time.monotonic() - t0,
            },
        )

    # ---- a step's episodes ----------------------------------------------------------------------
    def generate(  # type: ignore[override]
        self,
        exp: Exp,
        step: int,
        behavior: Weights[Checkpoint],
        prompts: list[World],
        store: ArtifactStore,
        backends: Backends,
        warn: Warn,
    ) -> Generated[AgentTrajectory, AgentReward]:
        t0 = time.monotonic()
        requests = {r.trial_id: r for r in plan_episodes(exp, step)}
        progress, judge = backends.progress, backends.judge
        progress.begin(step, len(requests))
        judged = Judged()  # judged as each episode ends, while the others still play

        times: dict[str, TrialTimes] = {}

        def run(pending: list[str]) -> list[AgentTrajectory | TrialFailed]:
            progress.generated(step, len(requests) - len(pending))
            outcomes = judge_as_they_land(
                exp,
                judge,
                judged,
                lambda on_done: backends.rollout.generate(exp, [requests[t] for t in pending], behavior, on_done, times),
                landed=lambda _: progress.generated(step),
                generated=lambda: progress.phase(step, "judging"),
                done=lambda n: progress.judged(step, n),
            )
            store_call_times(store, [o for o in outcomes if isinstance(o, AgentTrajectory)], times)
            return outcomes

        def make(trajectories: list[AgentTrajectory], failed: list[str]) -> Rollouts[AgentTrajectory]:
            return Rollouts[AgentTrajectory](
                step=step,
                behavior_policy=behavior.lineage(),
                n_trials_planned=len(requests),
                trajectories=trajectories,
                skipped=failed,
            )

        complete_key = self._rollouts_key(exp, step, behavior)
        rollouts = trial_set(store, "rollouts", complete_key, Rollouts[AgentTrajectory], list(requests), run, make, warn)
        if rollouts.hit:
            progress.generated(step, len(requests))
        key = rewards_key(CODE_VERSIONS["rewards"], judge, rollouts.ref, rubric=exp.rubric, max_turns=exp.task.episode.max_turns)
        rewards = step_rewards(
            store, exp, key, rollouts, judged, judge, warn, Rewards[AgentReward], lambda n: progress.judged(step, n)
        )
        progress.phase(step, "training")
        return Generated(
            rollouts.value,
            rollouts.ref,
            complete_key,
            rewards.value,
            rewards.ref,
            cache={"rollouts": rollouts.cache, "rewards": rewards.cache},
            trials=len(rollouts.attempted),
            judge_calls=len(rewards.attempted),
            seconds=time.monotonic() - t0,
            recovered=recovered(rollouts, rewards),
            judge_seconds=judged.clock.judge_s,
            judge_hidden_seconds=judged.clock.hidden_s,
            timings=environment_timings(times),
        )

    def _rollouts_key(self, exp: Exp, step: int, behavior: Weights[Checkpoint]) -> str:
        return rollouts_key(
            CODE_VERSIONS["rollouts"],
            exp,
            step,
            behavior.ref,
            policy=exp.policy,
            sampling=exp.sampling,
            environment_code=environment_of(exp.task.environment.name).code_version,
            **exp.rollout.cache_inputs(),
            **self.program_inputs(exp),
        )

    def _train(self, exp, step, previous, gen, store, backends, reference, behavior=None):
        """The language-model update over the trajectories, with the episodes' turns in the step's metrics."""
        result, weights = super()._train(exp, step, previous, gen, store, backends, reference, behavior)
        used = {r.trial_id: r for r in gen.rewards.rewards}
        sampled = [float(sum(t.completion_mask)) for t in gen.rollouts.trajectories if t.trial_id in used]
        metrics = {
            **result.metrics,
            "mean_turns": mean([float(r.turns) for r in used.values()]),
            "mean_sampled_tokens": mean(sampled),
            **tool_metrics(exp, [t for t in gen.rollouts.trajectories if t.trial_id in used]),
        }
        return result.model_copy(update={"metrics": metrics}), weights

    # ---- held-out evaluation ------------------------------------------------------------------
    def evaluate(  # type: ignore[override]
        self,
        exp: Exp,
        step: int,
        weights: Weights[Checkpoint],
        base: Weights[Checkpoint],
        initial: Weights[Checkpoint],
        prompts: list[World],
        store: ArtifactStore,
        progress: Progress,
    ) -> StepAsset:
        """The step's held-out greedy success and mean turns, beside those of the weights step 0
        started from (the warm-up's, when there is one; else the base's) and the base's."""
        t0 = time.monotonic()
        with progress.doing(f"step {step_key(step)}: held-out evaluation on {len(prompts)} worlds"):
            scored, ref, hit = self._evaluation(exp, weights, prompts, store)
            start, _, _ = self._evaluation(exp, initial, prompts, store)
            base_scored, _, _ = self._evaluation(exp, base, prompts, store)
        return StepAsset(
            asset="evaluation",
            step=step,
            cache="hit" if hit else "miss",
            ref=ref,
            metadata={
                "success": scored.success,
                "mean_turns": scored.mean_turns,
                "mean_reward": scored.mean_reward,
                "start_success": start.success,
                "start_mean_turns": start.mean_turns,
                "base_success": base_scored.success,
                **tool_shares(scored, start=start, base=base_scored),
                "n_worlds": scored.n,
                "weights_version": weights.version,
                "eval_s": time.monotonic() - t0,
            },
        )

    def _evaluation(
        self, exp: Exp, weights: Weights[Checkpoint], prompts: list[World], store: ArtifactStore
    ) -> tuple[AgentEvaluation, ArtifactRef, bool]:
        env = exp.task.environment
        key = cache_key(
            "evaluation",
            CODE_VERSIONS["evaluation"],
            weights=weights.ref.content_hash,
            policy=exp.policy,
            environment=env,
            environment_code=environment_of(env.name).code_version,
            worlds=[(w.id, w.seed) for w in prompts],
            max_turns=exp.task.episode.max_turns,
            max_turn_tokens=exp.task.episode.max_turn_tokens,
            rubric=exp.rubric,
            **self.program_inputs(exp),
        )

        def compute() -> AgentEvaluation:
            counters.bump("evaluations")
            return evaluate(
                load_policy(exp.policy, weights.payload),
                exp,
                prompts,
                sandbox_root(),
                self.sandboxes_for(exp),
                weights_hash=weights.ref.content_hash,
            )

        return store.get_or_put("evaluations", key, AgentEvaluation, compute)
