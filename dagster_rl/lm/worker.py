"""The trainer entrypoint: `python -m dagster_rl.lm.worker <job.json>`, alone or under torchrun.

Every rank loads the base, the input checkpoint (none: a fresh adapter, version 0) and the batch,
takes its shard (rank r: samples r, r + W, ...; maybe none) and runs the one data-parallel train
step. Global rank 0 then writes `<output_dir>/checkpoint/` (see `policy`) and
`<output_dir>/metrics.json`, and, when launched through Dagster Pipes, reports the metrics back
(a log line, a custom message with the metrics, and an asset materialization when the job names an
asset key). Other ranks write and report nothing.

Device: the job's `device` (the experiment's `policy.device`); under torchrun on CUDA rank r of a
node uses GPU LOCAL_RANK. Process group: nccl when the ranks train on CUDA, gloo on the CPU.
An in-process trainer passes its loaded policy (`loaded`): only the input adapter is read from the
job then; a torchrun or pod worker loads the base from disk (its cold start).
"""

import gc
import json
import os
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import Field
from safetensors.torch import save_file

from dagster_rl.experiment import Strict
from dagster_rl.lm.policy import (
    Policy,
    checkpoint_bytes,
    checkpoint_hash,
    load_adapter,
    load_checkpoint,
    load_policy,
    make_optimizer,
    resolve_device,
    save_checkpoint,
)
from dagster_rl.lm.rewards import LMReward
from dagster_rl.lm.records import LMRollout
from dagster_rl.lm.reference import reference_of
from dagster_rl.lm.settings import GRPOLMSettings, PolicySettings
from dagster_rl.lm.trainer import TrainMetrics, build_samples, shard, train_step
from dagster_rl.records import Record

CHECKPOINT_DIR = "checkpoint"
METRICS = "metrics.json"
GRADS = "grads.safetensors"


class TrainBatch(Record):
    """What a step trains on: its rollouts and their rewards (matched by trial id)."""

    rollouts: list[LMRollout]
    rewards: list[LMReward]


class TrainJob(Strict):
    policy: PolicySettings
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="policy.device, which the policy's own dump leaves out")
    grpo: GRPOLMSettings = GRPOLMSettings()
    input_checkpoint: str | None = Field(None, description="checkpoint folder; none: a fresh adapter (version 0)")
    reference_checkpoint: str | None = Field(None, description="the KL term's reference adapter (a checkpoint folder); none: the base")
    batch: str = Field(description="a TrainBatch JSON file")
    output_dir: str
    dump_grads: bool = Field(False, description="debug: rank 0 writes the synchronized gradients before clipping")
    pipes_asset_key: str | None = Field(None, description="under Dagster Pipes: report a materialization of this asset")


def write_job(job: TrainJob, path: Path | str) -> Path:
    path = Path(path)
    path.write_text(job.model_dump_json(indent=2))
    return path


def launch_torchrun(
    job_path: Path | str,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int | str = 0,
    master_addr: str | None = None,
    master_port: int | str = 29500,
    python: str = sys.executable,
) -> list[str]:
    """The torchrun command that runs this worker on one node of a job (run it with env PYTHONPATH set
    so the workers import this package). One node and no master address: `--standalone`; else a
    static rendezvous at the master. `node_rank` and `master_port` may be placeholders a pod expands
    (`$(JOB_COMPLETION_INDEX)`, `$(MASTER_PORT)`)."""
    if nproc_per_node < 1 or nnodes < 1 or (isinstance(node_rank, int) and not 0 <= node_rank < nnodes):
        raise ValueError(f"nproc_per_node={nproc_per_node}, nnodes={nnodes}, node_rank={node_rank}: need >= 1, >= 1, 0..nnodes-1")
    cmd = [python, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node), "--max-restarts", "0"]
    if nnodes == 1 and master_addr is None:
        cmd.append("--standalone")
    else:
        if master_addr is None:
            raise ValueError("a multi-node job needs master_addr: the address of the node with node_rank 0")
        cmd += ["--rdzv-backend", "static", "--node-rank", str(node_rank), "--master-addr", master_addr, "--master-port", str(master_port)]
    return cmd + ["-m", "dagster_rl.lm.worker", str(job_path)]


def _setup(setting: str) -> tuple[int, int, torch.device]:
    """(global rank, world size, device); joins the process group when launched by torchrun."""
    if "RANK" not in os.environ:
        return 0, 1, resolve_device(setting)
    device = resolve_device(setting, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=process_group_backend(device))
    return dist.get_rank(), dist.get_world_size(), device


def process_group_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _policy(job: TrainJob, checkpoint: dict[str, bytes] | None, device: torch.device, loaded: Policy | None) -> Policy:
    if loaded is None or checkpoint is None:
        return load_policy(job.policy, checkpoint, device)
    if loaded.settings.model_dump() != job.policy.model_dump() or next(loaded.model.parameters()).device != device:
        raise ValueError("the loaded policy has other settings or another device than the job's; load the job's own")
    return load_adapter(loaded, checkpoint)


def run_job(job: TrainJob, report=None, loaded: Policy | None = None) -> TrainMetrics:
    """Run the step on this rank; rank 0 writes the outputs. `report(metrics, checkpoint_hash)` on rank 0.
    `loaded`: a policy of the job's settings, kept loaded by an in-process trainer (its adapter is replaced)."""
    rank, world, device = _setup(job.device)
    ddp = None
    try:
        checkpoint = load_checkpoint(job.input_checkpoint) if job.input_checkpoint else None
        policy = _policy(job, checkpoint, device, loaded)
        reference = reference_of(policy, load_checkpoint(job.reference_checkpoint) if job.reference_checkpoint else None)
        optimizer = make_optimizer(policy, job.grpo, checkpoint)
        batch = TrainBatch.model_validate_json(Path(job.batch).read_text())
        samples, facts = build_samples(batch.rollouts, batch.rewards, job.grpo.advantage_eps)
        ddp = None
        if dist.is_initialized():
            ddp = torch.nn.parallel.DistributedDataParallel(policy.model, device_ids=[device.index] if device.type == "cuda" else None)
        out = Path(job.output_dir)
        grads = {}
        metrics = train_step(
            policy,
            optimizer,
            shard(samples, rank, world),
            len(samples),
            job.grpo,
            facts,
            ddp=ddp,
            on_grads=grads.update if job.dump_grads else None,
            reference=reference,
        )
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            files = checkpoint_bytes(policy, optimizer)
            save_checkpoint(out / CHECKPOINT_DIR, files)
            (out / METRICS).write_text(metrics.model_dump_json(indent=2))
            if grads:
                save_file({k: v.cpu().contiguous() for k, v in grads.items()}, str(out / GRADS))
            if report is not None:
                report(metrics, checkpoint_hash(files))
        return metrics
    finally:
        # Free DDP's reducer while the process group lives: destroying the group first deadlocks
        # (its destructor holds a lock that a gloo thread, waiting for the GIL, needs).
        if ddp is not None:
            del ddp
            gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def _pipes_reporter(pipes, asset_key: str | None):
    def report(metrics: TrainMetrics, checkpoint_hash: str) -> None:
        values = metrics.model_dump()
        pipes.log.info(f"trained adapter v{metrics.version}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
        pipes.report_custom_message({"metrics": values, "checkpoint_hash": checkpoint_hash})
        if asset_key is not None:
            pipes.report_asset_materialization(asset_key=asset_key, metadata=values, data_version=checkpoint_hash)

    return report


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dagster_rl.lm.worker <job.json>", file=sys.stderr)
        return 2
    job = TrainJob.model_validate_json(Path(args[0]).read_text())
    with ExitStack() as stack:
        report = None
        if int(os.environ.get("RANK", "0")) == 0:
            from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes

            if PipesEnvVarParamsLoader().is_dagster_pipes_process():
                report = _pipes_reporter(stack.enter_context(open_dagster_pipes()), job.pipes_asset_key)
        metrics = run_job(job, report)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(metrics.model_dump()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
