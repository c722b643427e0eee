"""The trainer's workers read multi-turn trajectories as they read completions: a 2-rank torchrun step
over trajectories (observations masked) through the worker entrypoint equals the single-process step."""

import pytest
import torch
from safetensors.torch import load_file

from dagster_rl.tasks.agent.chat import ChatTurns
from dagster_rl.tasks.agent.records import AgentReward, AgentTrajectory
from dagster_rl.tasks.agent.rollout_hf import run_episodes
from dagster_rl.tasks.lm.model.policy import checkpoint_bytes, load_checkpoint, load_policy, make_optimizer, save_checkpoint
from dagster_rl.tasks.lm.settings import GRPOLMSettings, SamplingSettings
from dagster_rl.tasks.lm.train.entrypoint import GRADS, METRICS, TrainBatch, TrainJob, launch_torchrun, write_job
from dagster_rl.tasks.lm.train.trainer import TrainMetrics, build_samples, train_step
from tests.agent_fixtures import ChatterSettings, agent_settings, busy_policy, request, stage_of
from tests.lm_fixtures import assert_within_summation_bound, gradient_terms, positions, run

TARGETS = ("q_proj", "v_proj", "lm_head")  # linear layers only: what lm_fixtures.gradient_terms measures
DDP_GRPO = GRPOLMSettings(learning_rate=0.01, kl_beta=0.5, clip_eps=0.2, micro_batch_tokens=256)


@pytest.mark.numerics
def test_two_rank_step_over_trajectories_equals_the_single_process_step(tmp_path, record_property):
    policy = busy_policy(TARGETS)
    group = [
        request(0).model_copy(update={"trial_id": f"s0-p0-n{n}", "sample": n, "seed": n}) for n in range(5)
    ]  # one world, 5 samples
    chatter = stage_of(ChatterSettings(), ChatTurns.of(policy.tokenizer), tmp_path / "sandboxes")
    trajectories = run_episodes(policy, group, chatter, SamplingSettings(max_new_tokens=5))
    assert all(isinstance(t, AgentTrajectory) and 0 in t.completion_mask for t in trajectories)
    rewards = [
        AgentReward(
            trial_id=t.trial_id,
            step=0,
            prompt=0,
            world_id=t.world_id,
            correct=False,
            turns=3,
            end_reason=t.end_reason,
            components={},
            reward=float(i % 3),
        )
        for i, t in enumerate(trajectories)
    ]  # rewards 0 1 2 0 1 in one group: advantages of both signs
    batch = TrainBatch(rollouts=trajectories, rewards=rewards)
    (tmp_path / "batch.json").write_text(batch.model_dump_json())
    folder = save_checkpoint(tmp_path / "input", checkpoint_bytes(policy, None))
    job = TrainJob(
        policy=agent_settings(TARGETS), device="cpu", grpo=DDP_GRPO, input_checkpoint=str(folder),
        batch=str(tmp_path / "batch.json"), output_dir=str(tmp_path / "out"), dump_grads=True,
    )  # fmt: skip
    run(launch_torchrun(write_job(job, tmp_path / "job.json"), nproc_per_node=2), timeout=180)
    dist_grads = load_file(str(tmp_path / "out" / GRADS))
    dist_metrics = TrainMetrics.model_validate_json((tmp_path / "out" / METRICS).read_text())

    single = load_policy(agent_settings(TARGETS), load_checkpoint(folder))
    samples, facts = build_samples(batch.rollouts, batch.rewards, DDP_GRPO.advantage_eps)
    assert all(s.mask is not None for s in samples) and len({s.advantage for s in samples}) > 1
    grads = {}
    with gradient_terms(single) as terms:
        metrics = train_step(
            single, make_optimizer(single, DDP_GRPO), samples, len(samples), DDP_GRPO, facts, on_grads=grads.update
        )
    assert sum(float(g.norm()) for g in grads.values()) > 1e-4
    n = positions(samples)
    worst = assert_within_summation_bound(dist_grads, grads, terms, n)
    record_property("grad_diff", f"{worst:.2f}/{n - 1} eps32*sum|terms|")
    assert dist_metrics.world_size == 2 and dist_metrics.samples_used == metrics.samples_used == 5
    for field in ("loss", "ratio", "kl", "clip_frac"):
        assert getattr(dist_metrics, field) == pytest.approx(getattr(metrics, field), rel=1e-5, abs=1e-7), field
    assert dist_metrics.logp_max_dev < 1e-4 and torch.isfinite(torch.tensor(dist_metrics.grad_norm))
