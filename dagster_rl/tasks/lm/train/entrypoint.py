"""The trainer entrypoint: `python -m dagster_rl.tasks.lm.train.entrypoint <job.json | session folder>`, alone or
under torchrun.

A job file: one step. Every rank loads the base, the input checkpoint (none: a fresh adapter,
version 0) and the batch, takes its shard (rank r: samples r, r + W, ...; maybe none) and runs the
one data-parallel train step. Global rank 0 then writes `<output_dir>/checkpoint/` (see `policy`),
`<output_dir>/metrics.json` and `<output_dir>/timings.json`, and, when launched through Dagster
Pipes, reports the metrics back (a log line, a custom message with the metrics, and an asset
materialization when the job names an asset key). Other ranks write and report nothing.

A session folder (`lm.session`): the same step, job after job, until told to stop. Rank 0 takes
each job from the folder and broadcasts it to the other ranks; every rank keeps the policy, the
reference and the optimizer state (`TrainerState`) and trains from memory when the job's input checkpoint
is the one it holds, else loads it: the same bytes either way. Rank 0 writes each step's outputs as
above, reports them through one Pipes session open for the whole range (a message per step, naming
the step), then its answer. A stop file, an idle timeout or the driver's death (when it runs on
this machine) ends the workers; a failed step ends them too, unanswered (the job stays pending:
restarted workers take it up again), with the error in the folder's `ended`.

Device: the job's `device` (the experiment's `policy.device`); under torchrun on CUDA rank r of a
node uses GPU LOCAL_RANK. Process group: nccl when the ranks train on CUDA, gloo on the CPU.
An in-process trainer passes its own `TrainerStateSlot`: it keeps its policy loaded between steps, as a
session does; a one-step launch loads the base from disk (its cold start).
"""

import gc
import json
import os
import sys
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import Field
from safetensors.torch import save_file

from dagster_rl.base.strict import Strict
from dagster_rl.core.records import Record
from dagster_rl.runtime.lifetime import alive
from dagster_rl.tasks.agent.records import AgentReward, AgentTrajectory
from dagster_rl.tasks.lm.model.policy import (
    CheckpointError,
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
from dagster_rl.tasks.lm.records import LMRollout
from dagster_rl.tasks.lm.rewards import LMReward
from dagster_rl.tasks.lm.settings import GRPOLMSettings, PolicySettings
from dagster_rl.tasks.lm.train.reference import BEHAVIOR, Reference, adapter_reference, reference_of
from dagster_rl.tasks.lm.train.session import (
    ENDED,
    JOBS,
    RESULTS,
    SPEC,
    STOP,
    Answer,
    SessionSpec,
    last_answered,
    pending_jobs,
    seq_name,
    write_whole,
)
from dagster_rl.tasks.lm.train.trainer import TrainMetrics, build_samples, shard, train_step

CHECKPOINT_DIR = "checkpoint"
METRICS = "metrics.json"
TIMINGS = "timings.json"
GRADS = "grads.safetensors"


class TrainBatch(Record):
    """What a step trains on: its rollouts and their rewards (matched by trial id); single-turn
    completions, or multi-turn trajectories with their masks (`dagster_rl.tasks.agent.records`)."""

    rollouts: list[LMRollout | AgentTrajectory]
    rewards: list[LMReward | AgentReward]


class TrainJob(Strict):
    policy: PolicySettings
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="policy.device, which the policy's own dump leaves out")
    grpo: GRPOLMSettings = GRPOLMSettings()
    input_checkpoint: str | None = Field(None, description="checkpoint folder; none: a fresh adapter (version 0)")
    input_hash: str | None = Field(
        None, description="the input checkpoint's `checkpoint_hash`: workers holding it train from memory"
    )
    reference_checkpoint: str | None = Field(
        None, description="the KL term's reference adapter (a checkpoint folder); none: the base"
    )
    reference_hash: str | None = Field(None, description="the reference's `checkpoint_hash`: workers holding it keep it")
    behavior_checkpoint: str | None = Field(
        None, description="the weights that sampled the stale batch (a checkpoint folder), whose log-probs grpo.mismatch needs"
    )
    behavior_hash: str | None = Field(None, description="the behavior checkpoint's `checkpoint_hash`")
    batch: str = Field(description="a TrainBatch JSON file")
    output_dir: str
    step: int | None = Field(None, description="the step this job trains (reported with its metrics)")
    old_logp: Literal["sampler", "trainer"] = Field(
        "sampler",
        description="the ratio's old policy: the sampler's recorded log-probs (stale rollouts), or the trainer's own, "
        "detached (rollouts the trained weights sampled)",
    )
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
    """The torchrun command that runs this worker (on a job file, or a session folder) on one node
    of a job (run it with env PYTHONPATH set so the workers import this package). One node and no
    master address: `--standalone`; else a static rendezvous at the master. `node_rank` and
    `master_port` may be placeholders a pod expands (`$(JOB_COMPLETION_INDEX)`, `$(MASTER_PORT)`)."""
    if nproc_per_node < 1 or nnodes < 1 or (isinstance(node_rank, int) and not 0 <= node_rank < nnodes):
        raise ValueError(f"nproc_per_node={nproc_per_node}, nnodes={nnodes}, node_rank={node_rank}: need >= 1, >= 1, 0..nnodes-1")
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc_per_node),
        "--max-restarts",
        "0",
    ]
    if nnodes == 1 and master_addr is None:
        cmd.append("--standalone")
    else:
        if master_addr is None:
            raise ValueError("a multi-node job needs master_addr: the address of the node with node_rank 0")
        cmd += [
            "--rdzv-backend",
            "static",
            "--node-rank",
            str(node_rank),
            "--master-addr",
            master_addr,
            "--master-port",
            str(master_port),
        ]
    return cmd + ["-m", "dagster_rl.tasks.lm.train.entrypoint", str(job_path)]


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


@dataclass
class TrainerState:
    """What a trainer keeps between steps: the policy with its adapter, the optimizer over it, the
    reference, and which checkpoint and reference they are (hashes; on rank 0 only, the checkpoint's)."""

    policy: Policy
    device: torch.device
    optimizer: torch.optim.Optimizer | None = None
    grpo: GRPOLMSettings | None = None
    checkpoint: str | None = None
    reference: Reference | None = None
    reference_key: str | None = None
    behavior: Reference | None = None  # the job's behavior adapter (`behavior_checkpoint`), when it names one
    behavior_key: str | None = None


class TrainerStateSlot:
    """A trainer's `TrainerState` between calls (the in-process trainer's; a session's lives in `serve`),
    used by one step at a time (hold `lock`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.held: TrainerState | None = None


def holds(held: TrainerState | None, job: TrainJob) -> bool:
    """Whether `held` is the job's input checkpoint, trained with the job's settings (rank 0 decides)."""
    return (
        held is not None
        and held.optimizer is not None
        and job.input_hash is not None
        and held.checkpoint == job.input_hash
        and held.grpo == job.grpo
        and held.policy.settings.model_dump() == job.policy.model_dump()
    )


def prepare(job: TrainJob, device: torch.device, held: TrainerState | None, from_memory: bool) -> TrainerState:
    """The job's policy, reference and optimizer: kept from `held` when `from_memory` (rank 0 found
    that it holds the job's input), else the input checkpoint loaded: into the loaded base when the
    settings are the same (bit for bit a fresh load), else with the base loaded afresh."""
    # `held`, when it has the job's base loaded on the job's device (its adapter may be another)
    same_base = (
        held
        if held is not None and held.device == device and held.policy.settings.model_dump() == job.policy.model_dump()
        else None
    )
    if same_base is not None and from_memory:
        _reference(job, same_base)
        _behavior(job, same_base)
        return same_base
    checkpoint = load_checkpoint(job.input_checkpoint) if job.input_checkpoint else None
    digest = checkpoint_hash(checkpoint) if checkpoint is not None else None
    if job.input_hash is not None and digest != job.input_hash:
        raise CheckpointError(
            f"the input checkpoint in {job.input_checkpoint} is not the one the job names (hash {job.input_hash}): it was "
            "changed or cut short on its way; run the step again"
        )
    if same_base is not None and checkpoint is not None:
        load_adapter(same_base.policy, checkpoint)
        held = same_base
    else:  # another base, or a fresh adapter (version 0)
        held = TrainerState(load_policy(job.policy, checkpoint, device), device)
    _reference(job, held)
    _behavior(job, held)
    held.optimizer = make_optimizer(held.policy, job.grpo, checkpoint)  # after the reference: the same trainable parameters
    held.grpo, held.checkpoint = job.grpo, digest
    return held


def _reference(job: TrainJob, held: TrainerState) -> None:
    """The job's KL reference, loaded unless `held` has it already."""
    wanted = job.reference_hash or job.reference_checkpoint or "base"
    if held.reference is None or held.reference_key != wanted:
        files = load_checkpoint(job.reference_checkpoint) if job.reference_checkpoint else None
        held.reference, held.reference_key = reference_of(held.policy, files), wanted


def _behavior(job: TrainJob, held: TrainerState) -> None:
    """The job's behavior adapter, loaded unless `held` has it already; none when the job names none."""
    if job.behavior_checkpoint is None:
        held.behavior = None
        return
    wanted = job.behavior_hash or job.behavior_checkpoint
    if held.behavior is None or held.behavior_key != wanted:
        held.behavior = adapter_reference(held.policy, load_checkpoint(job.behavior_checkpoint), BEHAVIOR)
        held.behavior_key = wanted


def train_held(job: TrainJob, held: TrainerState, rank: int, world: int) -> tuple[TrainMetrics, dict[str, torch.Tensor]]:
    """One step of `held` on the job's batch, data-parallel when in a process group (a fresh DDP
    wrapper per step, as a one-step launch builds it: the same buckets, the same sums)."""
    batch = TrainBatch.model_validate_json(Path(job.batch).read_text())
    samples, facts = build_samples(batch.rollouts, batch.rewards, job.grpo.advantage_eps)
    assert held.optimizer is not None  # `prepare` made it
    ddp = None
    grads: dict[str, torch.Tensor] = {}
    try:
        if dist.is_initialized():
            device = held.device
            ddp = torch.nn.parallel.DistributedDataParallel(
                held.policy.model, device_ids=[device.index] if device.type == "cuda" else None
            )
        metrics = train_step(
            held.policy,
            held.optimizer,
            shard(samples, rank, world),
            len(samples),
            job.grpo,
            facts,
            ddp=ddp,
            on_grads=grads.update if job.dump_grads else None,
            reference=held.reference,
            old_logp=job.old_logp,
            behavior=held.behavior,
        )
    finally:
        # Free DDP's reducer (its hooks on the parameters) while the process group lives: destroying
        # the group first deadlocks (its destructor holds a lock that a gloo thread, waiting for the GIL, needs).
        if ddp is not None:
            del ddp
            gc.collect()
    held.checkpoint = None  # changed: rank 0 sets the hash of what it writes
    return metrics, grads


def write_outputs(job: TrainJob, held: TrainerState, metrics: TrainMetrics, grads: dict, timings: dict[str, float]) -> str:
    """Rank 0: the step's checkpoint, metrics and timings under the job's output folder; returns the checkpoint's hash."""
    out = Path(job.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = checkpoint_bytes(held.policy, held.optimizer)
    save_checkpoint(out / CHECKPOINT_DIR, files)
    (out / METRICS).write_text(metrics.model_dump_json(indent=2))
    (out / TIMINGS).write_text(json.dumps(timings))
    if grads:
        save_file({k: v.cpu().contiguous() for k, v in grads.items()}, str(out / GRADS))
    held.checkpoint = checkpoint_hash(files)
    return held.checkpoint


def run_job(job: TrainJob, report=None, slot: TrainerStateSlot | None = None) -> TrainMetrics:
    """Run the step on this rank; rank 0 writes the outputs. `report(metrics, checkpoint_hash, job, timings)`
    on rank 0. `slot`: the `TrainerState` of an in-process trainer, kept between its calls."""
    rank, world, device = _setup(job.device)
    try:
        t0 = time.perf_counter()
        held = prepare(job, device, slot.held if slot else None, from_memory=slot is not None and holds(slot.held, job))
        if slot is not None:
            slot.held = held
        t1 = time.perf_counter()
        metrics, grads = train_held(job, held, rank, world)
        t2 = time.perf_counter()
        if rank == 0:
            timings = {"load_s": t1 - t0, "update_s": t2 - t1}
            digest = write_outputs(job, held, metrics, grads, timings)
            if report is not None:
                report(metrics, digest, job, timings)
        return metrics
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---- a session: job after job ------------------------------------------------------------------


def serve(folder: Path, report=None) -> int:
    """Take the session folder's jobs in order until stopped; returns how many steps were trained."""
    spec = SessionSpec.model_validate_json((folder / SPEC).read_text())
    rank, world, device = _setup(spec.device)
    held: TrainerState | None = None
    trained, why = 0, "failed"
    inbox = _Inbox(folder, spec) if rank == 0 else None
    try:
        while True:
            command = inbox.next(held) if inbox is not None else None
            if world > 1:
                box = [command]
                dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
                command = box[0]
            assert command is not None  # rank 0 reads it from the folder; the other ranks receive it
            what = command["what"]
            if what == "stop":
                why = command["why"]
                return trained
            if what == "idle":
                continue
            job = TrainJob.model_validate(command["job"])
            try:
                t0 = time.perf_counter()
                held = prepare(job, device, held, from_memory=command["from_memory"])
                t1 = time.perf_counter()
                metrics, grads = train_held(job, held, rank, world)
                t2 = time.perf_counter()
                if rank == 0:
                    timings = {"load_s": t1 - t0, "update_s": t2 - t1, "from_memory": float(command["from_memory"])}
                    digest = write_outputs(job, held, metrics, grads, timings)
                    timings["save_s"] = time.perf_counter() - t2
                    if report is not None:
                        report(metrics, digest, job, timings)
                    answer = Answer(
                        seq=command["seq"],
                        step=job.step,
                        metrics=metrics,
                        checkpoint_hash=digest,
                        from_memory=command["from_memory"],
                        timings=timings,
                    )
                    write_whole(folder / RESULTS / seq_name(command["seq"]), answer.model_dump_json())
            except Exception as e:
                # no answer: the job stays pending, for restarted workers (a lost peer is no fault of
                # the step) or the driver's next attempt; `ended` says what happened
                why = f"failed at step job {command['seq']}: {type(e).__name__}: {e}"
                raise
            trained += 1
    finally:
        if rank == 0:
            try:
                write_whole(folder / ENDED, why)
            except OSError:
                pass
        if dist.is_initialized():
            dist.destroy_process_group()


class _Inbox:
    """Rank 0's view of the folder: the next command for every rank."""

    def __init__(self, folder: Path, spec: SessionSpec):
        self.folder, self.spec = folder, spec
        pending = pending_jobs(folder)  # restarted workers take up the job their predecessors left
        self.seq = pending[0] if pending else last_answered(folder) + 1
        (folder / ENDED).unlink(missing_ok=True)  # what ended their predecessors
        self.last_job = self.last_broadcast = self.last_owner_check = time.monotonic()

    def next(self, held: TrainerState | None) -> dict:
        while True:
            now = time.monotonic()
            path = self.folder / JOBS / seq_name(self.seq)
            if path.exists():
                job = TrainJob.model_validate_json(path.read_text())
                command = {"what": "job", "seq": self.seq, "job": job.model_dump(mode="json"), "from_memory": holds(held, job)}
                self.seq += 1
                self.last_job = self.last_broadcast = now
                return command
            if (self.folder / STOP).exists():
                return {"what": "stop", "why": "stopped"}
            if now - self.last_owner_check > 0.5:
                self.last_owner_check = now
                if self.spec.owner and not alive(self.spec.owner):
                    return {"what": "stop", "why": "owner gone"}
                if not (self.folder / SPEC).exists():
                    return {"what": "stop", "why": "folder gone"}
            if now - self.last_job > self.spec.idle_timeout_s:
                return {"what": "stop", "why": "idle"}
            if now - self.last_broadcast > self.spec.keepalive_s:
                self.last_broadcast = now
                return {"what": "idle"}
            time.sleep(self.spec.poll_s)


def _pipes_reporter(pipes, asset_key: str | None = None):
    def report(metrics: TrainMetrics, checkpoint_hash: str, job: TrainJob, timings: dict[str, float]) -> None:
        values = metrics.model_dump(exclude_none=True)  # kl: absent when not computed (kl_beta 0)
        step = "" if job.step is None else f" (step {job.step:04d})"
        pipes.log.info(f"trained adapter v{metrics.version}{step}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
        pipes.report_custom_message({"step": job.step, "metrics": values, "checkpoint_hash": checkpoint_hash, "timings": timings})
        key = job.pipes_asset_key or asset_key
        if key is not None:
            pipes.report_asset_materialization(asset_key=key, metadata=values, data_version=checkpoint_hash)

    return report


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dagster_rl.tasks.lm.train.entrypoint <job.json | session folder>", file=sys.stderr)
        return 2
    target = Path(args[0])
    rank0 = int(os.environ.get("RANK", "0")) == 0
    with ExitStack() as stack:
        report = None
        if rank0:
            from dagster_pipes import PipesEnvVarParamsLoader, open_dagster_pipes

            if PipesEnvVarParamsLoader().is_dagster_pipes_process():
                report = _pipes_reporter(stack.enter_context(open_dagster_pipes()))
        if target.is_dir():
            trained = serve(target, report)
            if rank0:
                print(
                    json.dumps({"steps": trained, "ended": (target / ENDED).read_text() if (target / ENDED).exists() else None}),
                    flush=True,
                )
            return 0
        metrics = run_job(TrainJob.model_validate_json(target.read_text()), report)
    if rank0:
        print(json.dumps(metrics.model_dump()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
