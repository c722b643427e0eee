"""The language-model task's backends: batched `transformers` generation (rollout `hf`), and the
GRPO update in this process (trainer `in_process`), under `torchrun` (trainer `torchrun`), or on
an Indexed Job of pods (trainer `k8s`).

Every trainer runs the code the pods run: it writes a job folder and runs `dagster_rl.lm.worker`
in this process, under `torchrun` started by a `launch` (Dagster Pipes from the driver, or a plain
subprocess), or under `torchrun` in each of `nodes` pods placed by a `PodLauncher` (the job folder
then lies on storage the pods share). The in-process trainer keeps its policy loaded between steps
and loads only each step's input adapter into it; generation keeps the policies of the last two
checkpoints it saw and loads a new checkpoint's adapter into the older one. Loading an adapter into
a loaded policy is the same, bit for bit, as loading the base afresh with it.
"""

import os
import subprocess
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from dagster_rl import counters
from dagster_rl.faults import InjectedFault, maybe_fail
from dagster_rl.lm.experiment import LMExperiment
from dagster_rl.hashing import content_hash
from dagster_rl.lm.policy import Policy, checkpoint_hash, load_adapter, load_checkpoint, load_policy, save_checkpoint
from dagster_rl.lm.rewards import LMReward
from dagster_rl.lm.settings import PolicySettings
from dagster_rl.lm.records import LMRollout, RolloutRequest
from dagster_rl.lm.rollout_hf import generate_rollouts
from dagster_rl.lm.trainer import TrainMetrics
from dagster_rl.lm.worker import CHECKPOINT_DIR, METRICS, TrainBatch, TrainJob, launch_torchrun, run_job, write_job
from dagster_rl.pods import COMPLETION_INDEX, MASTER_ADDR, MASTER_PORT, PodJob, PodLauncher
from dagster_rl.records import TrialFailed
from dagster_rl.retries import Limits, with_retries
from dagster_rl.task import Launch, Weights

REPO = Path(__file__).resolve().parents[2]


def subprocess_launch(command: list[str], env: dict[str, str]) -> None:
    """Run the command in a plain subprocess (the launch of a loop without Dagster)."""
    proc = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"trainer command {' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")


@dataclass
class _Loaded:
    policy: Policy
    checkpoint: str  # hash of the adapter it holds now
    lock: threading.Lock = field(default_factory=threading.Lock)


class PolicyCache:
    """Loaded policies, the last `size` checkpoints generation saw: a checkpoint it has seen reuses
    its policy; a new one loads its adapter into the least recently used policy (the base model is
    read from disk `size` times per run, not once per step)."""

    def __init__(self, size: int = 2):
        self.size, self._items, self._lock = size, OrderedDict(), threading.Lock()

    @contextmanager
    def use(self, exp: LMExperiment, files: dict[str, bytes]) -> Iterator[Policy]:
        """The policy with the checkpoint's adapter, held by this caller alone until the block ends."""
        key = content_hash([exp.policy, checkpoint_hash(files)])
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
            elif len(self._items) < self.size:
                self._items[key] = _Loaded(load_policy(exp.policy, files), key)
            else:
                self._items[key] = self._items.pop(next(iter(self._items)))
            entry = self._items[key]
        with entry.lock:
            if entry.checkpoint != key:  # recycled (here or by another caller since): load what this caller needs
                load_adapter(entry.policy, files)
                entry.checkpoint = key
            yield entry.policy


@dataclass
class HFRollouts:
    """In-process `transformers` generation of a step's requests with the behavior adapter."""

    limits: Limits = Limits()
    policies: PolicyCache = field(default_factory=PolicyCache)

    def generate(
        self, exp: LMExperiment, requests: Sequence[RolloutRequest], behavior: Weights[dict[str, bytes]], template: str
    ) -> list[LMRollout | TrialFailed]:
        """One outcome per request: its rollout, or how it failed after its retries. Each attempt
        generates the trials still pending, in batches; a trial's tokens do not depend on its batch,
        so a trial that finished is never generated again."""
        with self.policies.use(exp, behavior.payload) as policy:
            return self._generate(exp, policy, requests, template)

    def _generate(self, exp: LMExperiment, policy: Policy, requests: Sequence[RolloutRequest], template: str) -> list[LMRollout | TrialFailed]:
        done: dict[str, LMRollout] = {}
        errors: dict[str, BaseException] = {}
        pending = list(requests)
        for attempt in range(self.limits.max_retries + 1):
            if not pending:
                break
            counters.bump("trials_executed", len(pending))
            healthy = []
            for r in pending:
                try:
                    maybe_fail(exp.faults.flaky_trial_rate, attempt, exp.seed, "trial", r.trial_id)
                    healthy.append(r)
                except InjectedFault as e:
                    errors[r.trial_id] = e
            start = time.monotonic()
            try:
                generated = generate_rollouts(policy, healthy, exp.sampling, template)
            except Exception as e:  # noqa: BLE001 - the attempt of these trials failed: retry them
                errors.update(dict.fromkeys((r.trial_id for r in healthy), e))
            else:
                if time.monotonic() - start > self.limits.timeout_s:
                    late = TimeoutError(f"generating {len(healthy)} rollouts took longer than {self.limits.timeout_s} s")
                    errors.update(dict.fromkeys((r.trial_id for r in healthy), late))
                else:
                    done.update((g.trial_id, g) for g in generated)
            pending = [r for r in pending if r.trial_id not in done]
        return [done.get(r.trial_id) or TrialFailed(trial_id=r.trial_id, error=repr(errors[r.trial_id])) for r in requests]


class LoadedPolicy:
    """The in-process trainer's policy, loaded once per run and kept between steps (each step loads
    only its input adapter into it), held by one step at a time."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._policy: Policy | None = None

    def get(self, settings: PolicySettings) -> Policy:
        """The loaded policy (call it holding `lock`); loaded afresh when the settings change."""
        if self._policy is None or self._policy.settings != settings:
            self._policy = None  # free the old model before loading the new one
            self._policy = load_policy(settings)
        return self._policy


@dataclass(frozen=True)
class LMTrainer:
    """One GRPO update through the worker entrypoint: in this process when neither `launch` nor
    `pods` is set; `nproc_per_node` torchrun workers on this machine, started by `launch`; or
    `nproc_per_node` torchrun workers in each pod of a `PodJob` placed by `pods`."""

    limits: Limits = Limits(max_retries=0, timeout_s=3600.0, max_concurrency=1)
    launch: Launch | None = None
    nproc_per_node: int = 1
    threads_per_process: int = 1
    workdir: Path | None = None
    pods: PodLauncher | None = None
    loaded: LoadedPolicy = field(default_factory=LoadedPolicy, compare=False, repr=False)

    def train(
        self,
        exp: LMExperiment,
        previous: dict[str, bytes],
        rollouts: list[LMRollout],
        rewards: list[LMReward],
        reference: dict[str, bytes] | None = None,
    ) -> tuple[dict[str, bytes], TrainMetrics]:
        """One update from `previous`; `reference`: the KL term's reference adapter (None: the base)."""
        if self.workdir is not None:
            self.workdir.mkdir(parents=True, exist_ok=True)

        def attempt(n: int) -> tuple[dict[str, bytes], TrainMetrics]:
            counters.bump("train_calls")
            with tempfile.TemporaryDirectory(prefix="dagster-rl-train-", dir=self.workdir) as tmp:
                return self._run(exp, previous, rollouts, rewards, reference, Path(tmp))

        return with_retries("training", attempt, self.limits.max_retries, self.limits.timeout_s)

    def _run(self, exp, previous, rollouts, rewards, reference, tmp: Path) -> tuple[dict[str, bytes], TrainMetrics]:
        (tmp / "batch.json").write_text(TrainBatch(rollouts=rollouts, rewards=rewards).model_dump_json())
        job = TrainJob(
            policy=exp.policy,
            device=exp.policy.device,
            grpo=exp.grpo,
            input_checkpoint=str(save_checkpoint(tmp / "input", previous)),
            reference_checkpoint=str(save_checkpoint(tmp / "reference", reference)) if reference is not None else None,
            batch=str(tmp / "batch.json"),
            output_dir=str(tmp / "output"),
        )
        job_path = write_job(job, tmp / "job.json")
        if self.pods is not None:
            self.pods.run(self.pod_job(exp, job_path, step=rollouts[0].step if rollouts else 0))
        elif self.launch is None:
            with self.loaded.lock:
                run_job(job, loaded=self.loaded.get(exp.policy))
        else:
            env = {
                "OMP_NUM_THREADS": str(self.threads_per_process),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            }
            self.launch(launch_torchrun(job_path, self.nproc_per_node), env)
        out = tmp / "output"
        return load_checkpoint(out / CHECKPOINT_DIR), TrainMetrics.model_validate_json((out / METRICS).read_text())

    def pod_job(self, exp: LMExperiment, job_path: Path, step: int) -> PodJob:
        """The set of pods of one update: torchrun on each, node rank = the pod's completion index,
        static rendezvous at pod 0 (its DNS name, from the Job's headless Service)."""
        t = exp.trainer
        command = launch_torchrun(
            job_path,
            t.nproc_per_node,
            nnodes=t.nodes,
            node_rank=f"$({COMPLETION_INDEX})",
            master_addr=f"$({MASTER_ADDR})",
            master_port=f"$({MASTER_PORT})",
            python="python",
        )
        return PodJob(
            name=f"{exp.name}-s{step:04d}",
            nodes=t.nodes,
            command=tuple(command),
            env={"OMP_NUM_THREADS": str(self.threads_per_process)},
            resources=t.pods,
            max_restarts=t.max_restarts,
            active_deadline_s=t.active_deadline_s,
        )
