"""A 2-rank torchrun step through the trainer entrypoint equals the single-process step."""

import json

import pytest
import torch
from dagster_pipes import encode_param
from safetensors.torch import load as load_bytes
from safetensors.torch import load_file

from dagster_rl.tasks.lm.model.policy import (
    ADAPTER,
    checkpoint_bytes,
    load_checkpoint,
    load_policy,
    make_optimizer,
    save_checkpoint,
)
from dagster_rl.tasks.lm.settings import GRPOLMSettings
from dagster_rl.tasks.lm.train.entrypoint import CHECKPOINT_DIR, GRADS, METRICS, TrainBatch, TrainJob, launch_torchrun, write_job
from dagster_rl.tasks.lm.train.trainer import TrainMetrics, build_samples, micro_batches, shard, train_step
from tests.lm_fixtures import (
    EPS32,
    GRPO,
    assert_within_summation_bound,
    fresh_policy,
    gradient_terms,
    policy_settings,
    positions,
    run,
    step_batch,
)

# a strong KL weight: with a 1-sample batch (one rank's shard empty) the KL term is the whole gradient;
# a small token budget: a rank's shard of 3 samples is 1 micro-batch, the single process's 6 are 2; every
# row padded to the same width in both layouts (`_widths`: the premise of the summation bound)
DDP_GRPO = GRPOLMSettings(**{**GRPO.model_dump(), "kl_beta": 0.5, "clip_eps": 0.05, "micro_batch_tokens": 24})


@pytest.fixture(scope="module")
def trained_v1(tiny_dir, tmp_path_factory):
    """A v1 checkpoint, and the v0 batch it was trained on (stale now: ratio != 1, KL > 0)."""
    policy = fresh_policy(tiny_dir)
    optimizer = make_optimizer(policy, DDP_GRPO)
    rollouts, rewards = step_batch(policy, step=0, prompts=3, samples=2)
    samples, facts = build_samples(rollouts, rewards, DDP_GRPO.advantage_eps)
    train_step(policy, optimizer, samples, len(samples), DDP_GRPO, facts)
    folder = save_checkpoint(tmp_path_factory.mktemp("v1") / "checkpoint", checkpoint_bytes(policy, optimizer))
    return folder, rollouts, rewards


def _pipes_env(messages) -> dict[str, str]:
    """What PipesSubprocessClient would set: the context inline, messages to a file."""
    context = {
        "asset_keys": ["lm_demo/weights"],
        "code_version_by_asset_key": None,
        "provenance_by_asset_key": None,
        "partition_key": "0001",
        "partition_key_range": None,
        "partition_time_window": None,
        "run_id": "test-run",
        "job_name": None,
        "retry_number": 0,
        "extras": {},
    }
    return {
        "DAGSTER_PIPES_CONTEXT": encode_param({"data": context}),
        "DAGSTER_PIPES_MESSAGES": encode_param({"path": str(messages)}),
    }


def _single_process(tiny_dir, folder, batch, device):
    """The single-process step's gradients, metrics and checkpoint, and the |terms| its gradients sum."""
    files = load_checkpoint(folder)
    policy = load_policy(policy_settings(tiny_dir).model_copy(update={"device": device}), files)
    optimizer = make_optimizer(policy, DDP_GRPO, files)
    samples, facts = build_samples(batch.rollouts, batch.rewards, DDP_GRPO.advantage_eps)
    grads = {}
    with gradient_terms(policy) as terms:
        metrics = train_step(policy, optimizer, samples, len(samples), DDP_GRPO, facts, on_grads=grads.update)
    return grads, terms, metrics, checkpoint_bytes(policy, optimizer)


def _widths(samples, plan: list[list[int]]) -> list[int]:
    """Each sample's padded width under a micro-batch plan: the longest sequence of its micro-batch."""
    width = [0] * len(samples)
    for idx in plan:
        for i in idx:
            width[i] = max(len(samples[j].prompt_ids) + len(samples[j].completion_ids) for j in idx)
    return width


def _adam_on(tiny_dir, folder, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter that the input checkpoint's optimizer makes of these gradients: the clip and the
    AdamW step a trainer runs after its gradients are synchronized."""
    files = load_checkpoint(folder)
    policy = load_policy(policy_settings(tiny_dir), files)
    optimizer = make_optimizer(policy, DDP_GRPO, files)
    named = policy.trainable()
    for name, p in named:
        p.grad = grads[name].clone()
    torch.nn.utils.clip_grad_norm_([p for _, p in named], DDP_GRPO.max_grad_norm)
    optimizer.step()
    return load_bytes(checkpoint_bytes(policy, optimizer)[ADAPTER])


TWO_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason=f"a 2-rank NCCL step needs 2 GPUs; torch sees {torch.cuda.device_count()}"
)


@pytest.mark.parametrize(
    "n_samples,device",
    [(1, "cpu"), (6, "cpu"), pytest.param(6, "cuda", marks=[pytest.mark.cuda, TWO_GPUS])],
    ids=["one-shard-empty", "both-shards-full", "nccl-both-shards-full"],
)
@pytest.mark.numerics
def test_two_rank_gradients_equal_single_process(tiny_dir, trained_v1, tmp_path, n_samples, device, record_property):
    folder, rollouts, rewards = trained_v1
    batch = TrainBatch(rollouts=rollouts[:n_samples], rewards=rewards[:n_samples])
    (tmp_path / "batch.json").write_text(batch.model_dump_json())
    job = TrainJob(
        policy=policy_settings(tiny_dir),
        device=device,
        grpo=DDP_GRPO,
        input_checkpoint=str(folder),
        batch=str(tmp_path / "batch.json"),
        output_dir=str(tmp_path / "out"),
        dump_grads=True,
        pipes_asset_key="lm_demo/weights",
    )
    cmd = launch_torchrun(write_job(job, tmp_path / "job.json"), nproc_per_node=2)
    messages = tmp_path / "pipes_messages.jsonl"
    run(cmd, timeout=180, env=_pipes_env(messages))

    dist_grads = load_file(str(tmp_path / "out" / GRADS))
    dist_metrics = TrainMetrics.model_validate_json((tmp_path / "out" / METRICS).read_text())
    grads, terms, metrics, _ = _single_process(tiny_dir, folder, batch, device)
    grads = {k: v.cpu() for k, v in grads.items()}
    samples, _ = build_samples(batch.rollouts, batch.rewards, DDP_GRPO.advantage_eps)
    single_plan = micro_batches(samples, DDP_GRPO.micro_batch_tokens)
    rank_plans = [micro_batches(shard(samples, rank, 2), DDP_GRPO.micro_batch_tokens) for rank in range(2)]
    assert [len(p) for p in rank_plans] == ([1, 0] if n_samples == 1 else [1, 1])
    assert len(single_plan) == (1 if n_samples == 1 else 2)
    # Each row is padded to the same width in both layouts, so its forward is the same computation in
    # both: a row padded to another width is computed with other vector tails, which on AVX2 and
    # torch's default kernels (not AVX-512) round its log-probs an ulp apart, and the KL term's
    # coefficient 1 - exp(ref - new) turns an ulp of a log-prob into a relative error of
    # eps |logp| / |ref - new| in the gradient's factors: measured, 134 eps32 sum|terms| (n - 1 = 46)
    # when one rank ran a length-7 row alone that the single process padded to 8.
    rank_widths = [_widths(shard(samples, r, 2), p) for r, p in enumerate(rank_plans)]
    assert _widths(samples, single_plan) == [rank_widths[i % 2][i // 2] for i in range(n_samples)]

    assert set(dist_grads) == set(grads) and len(grads) == 26  # (2 layers x 6 modules + lm_head) x (A, B)
    assert sum(float(g.norm()) for g in grads.values()) > 1e-3
    # The gradients before the optimizer, where the two runs differ by summation order alone: the
    # same per-position terms, added in micro-batches of other sizes, on two ranks then all-reduced, by
    # kernels that block the reduction by the batch's shape (lm_fixtures.assert_within_summation_bound).
    # Padding and the synchronizing forward add exact zeros; world_size / total_samples in the loss's
    # scale and DDP's division by the world size are exact (powers of two apart).
    n = positions(samples)
    worst = assert_within_summation_bound(dist_grads, grads, terms, n)
    record_property("grad_diff", f"{worst:.2f}/{n - 1} eps32*sum|terms|")
    bound = {name: (n - 1) * EPS32 * terms[name] for name in grads}
    # the gradient norm: |(|a| - |b|)| <= |a - b|, and |a - b| <= the norm of the element-wise bound
    norm_bound = float(torch.linalg.vector_norm(torch.cat([b.flatten() for b in bound.values()])))
    assert abs(dist_metrics.grad_norm - metrics.grad_norm) <= norm_bound, (dist_metrics.grad_norm, metrics.grad_norm, norm_bound)
    assert dist_metrics.world_size == 2 and metrics.world_size == 1
    assert dist_metrics.samples_used == metrics.samples_used == n_samples
    # The loss's statistics are means over samples (summed in float64) of per-token functions of float32
    # log-probs that the two layouts round differently in their last bits: a few eps32 of each value.
    # rel 1e-5 is 84 eps32 (measured: 0.2 eps32); abs 1e-7 is for the values near 0.
    for field in ("loss", "ratio", "ratio_max_dev", "kl", "clip_frac"):
        assert getattr(dist_metrics, field) == pytest.approx(getattr(metrics, field), rel=1e-5, abs=1e-7), field
    assert metrics.kl > 0 and metrics.ratio != 1.0
    # The written checkpoint is exactly the optimizer step on the synchronized gradients: the same AdamW,
    # from the same input checkpoint, on rank 0's gradients, gives it bit for bit on this machine. (The
    # single-process adapter is not compared: Adam's first steps move every weight by about the
    # learning rate times the sign of its gradient, so a gradient that rounds to either side of 0 in
    # the two runs moves its weight by a learning rate either way.)
    dist_adapter = load_bytes(load_checkpoint(tmp_path / "out" / CHECKPOINT_DIR)[ADAPTER])
    replayed = _adam_on(tiny_dir, folder, dist_grads)
    assert set(replayed) == set(dist_adapter)
    assert all(torch.equal(dist_adapter[k], replayed[k]) for k in replayed), [
        k for k in replayed if not torch.equal(dist_adapter[k], replayed[k])
    ]
    # under Dagster Pipes, rank 0 alone reported: one open, log, metrics message, materialization, close
    reported = [json.loads(line) for line in messages.read_text().splitlines()]
    assert [m["method"] for m in reported] == ["opened", "log", "report_custom_message", "report_asset_materialization", "closed"]
    payload = reported[2]["params"]["payload"]
    assert payload["metrics"]["samples_used"] == n_samples and payload["metrics"]["world_size"] == 2
    assert reported[3]["params"]["asset_key"] == "lm_demo/weights"
    assert reported[3]["params"]["data_version"] == payload["checkpoint_hash"]
    stats_dev = max(
        abs(getattr(dist_metrics, f) - getattr(metrics, f)) / max(abs(getattr(metrics, f)), 1e-30)
        for f in ("loss", "ratio", "kl")
    )
    print(
        json.dumps(
            {
                "n_samples": n_samples,
                "positions": n,
                "worst |difference| / (eps32 sum|terms|)": worst,
                "loss stats max rel diff / eps32": stats_dev / EPS32,
            }
        )
    )


def test_torchrun_command():
    cmd = launch_torchrun(
        "job.json", nproc_per_node=4, nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=29400, python="py"
    )
    assert cmd == [
        "py",
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "4",
        "--max-restarts",
        "0",
        "--rdzv-backend",
        "static",
        "--node-rank",
        "1",
        "--master-addr",
        "10.0.0.1",
        "--master-port",
        "29400",
        "-m",
        "dagster_rl.tasks.lm.train.entrypoint",
        "job.json",
    ]
    assert "--standalone" in launch_torchrun("job.json", nproc_per_node=2)
    with pytest.raises(ValueError, match="master_addr"):
        launch_torchrun("job.json", nproc_per_node=2, nnodes=2)
