"""The language-model task's backends: batched `transformers` generation (rollout `hf`), and the
GRPO update in this process (trainer `in_process`), under `torchrun` (trainer `torchrun`), or on
an Indexed Job of pods (trainer `k8s`).

Every trainer runs the code the pods run: `dagster_rl.tasks.lm.train.entrypoint`, in this process, under `torchrun`
(Dagster Pipes from the driver, or a plain subprocess), or under `torchrun` in each of `nodes` pods
placed by a `PodLauncher` (its folders then lie on storage the pods share). `torchrun` and the pods
live for a range of steps (a session, `lm.session`: started by the first step that trains, they
keep the policy, reference and optimizer state in memory) or, with `trainer.session: step`, for one
step each (a job folder per launch). The in-process trainer keeps its policy and optimizer between
steps as a session does. Generation keeps the policies of the last two checkpoints it saw and loads
a new checkpoint's adapter into the older one. Loading an adapter into a loaded policy is the same,
bit for bit, as loading the base afresh with it.
"""

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import dagster_rl
from dagster_rl.base import counters
from dagster_rl.base.faults import flaky_trials
from dagster_rl.base.hashing import content_hash
from dagster_rl.base.retries import Limits, with_retries
from dagster_rl.core.records import TrialFailed
from dagster_rl.core.task import Launch, Weights
from dagster_rl.runtime.lifetime import identity
from dagster_rl.runtime.pods import COMPLETION_INDEX, MASTER_ADDR, MASTER_PORT, PodJob, PodLauncher
from dagster_rl.runtime.workers import ProcessWorkers, Start
from dagster_rl.tasks.lm.experiment import LMExperiment
from dagster_rl.tasks.lm.model.policy import Policy, checkpoint_hash, load_adapter, load_checkpoint, load_policy, save_checkpoint
from dagster_rl.tasks.lm.records import LMRollout, RolloutRequest
from dagster_rl.tasks.lm.rewards import LMReward
from dagster_rl.tasks.lm.rollout.hf import generate_rollouts
from dagster_rl.tasks.lm.train.entrypoint import (
    CHECKPOINT_DIR,
    METRICS,
    TIMINGS,
    TrainBatch,
    TrainerStateSlot,
    TrainJob,
    launch_torchrun,
    run_job,
    write_job,
)
from dagster_rl.tasks.lm.train.session import SessionEnded, SessionSpec, TrainerSession, create_folder
from dagster_rl.tasks.lm.train.trainer import OldLogp, TrainMetrics

# The folder that holds the `dagster_rl` package: the trainer processes' working folder and first PYTHONPATH entry.
SOURCE_ROOT = Path(dagster_rl.__file__).resolve().parent.parent


def subprocess_launch(command: list[str], env: dict[str, str]) -> None:
    """Run the command in a plain subprocess (the launch of a loop without Dagster)."""
    proc = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"trainer command {' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")


def subprocess_start(command: list[str], env: dict[str, str]) -> ProcessWorkers:
    """Start the command in a plain subprocess that lives until stopped (a session without Dagster)."""
    return ProcessWorkers(command, {**os.environ, **env}, cwd=SOURCE_ROOT)


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
        self.size, self._lock = size, threading.Lock()
        self._items: OrderedDict[str, _Loaded] = OrderedDict()

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
        self,
        exp: LMExperiment,
        requests: Sequence[RolloutRequest],
        behavior: Weights[dict[str, bytes]],
        template: str,
        on_done: Callable[[LMRollout], None] | None = None,
    ) -> list[LMRollout | TrialFailed]:
        """One outcome per request: its rollout, or how it failed after its retries. Each attempt
        generates the trials still pending, in batches; a trial's tokens do not depend on its batch,
        so a trial that finished is never generated again. An attempt's rollouts land together, when
        it ends within its time limit: `on_done(rollout)` is called for each of them then."""
        with self.policies.use(exp, behavior.payload) as policy:
            return self._generate(exp, policy, requests, template, on_done or (lambda r: None))

    def _generate(
        self,
        exp: LMExperiment,
        policy: Policy,
        requests: Sequence[RolloutRequest],
        template: str,
        on_done: Callable[[LMRollout], None],
    ) -> list[LMRollout | TrialFailed]:
        done: dict[str, LMRollout] = {}
        errors: dict[str, BaseException] = {}
        pending = list(requests)
        for attempt in range(self.limits.max_retries + 1):
            if not pending:
                break
            counters.bump("trials_executed", len(pending))
            healthy, injected = flaky_trials(pending, exp.faults.flaky_trial_rate, attempt, exp.seed)
            errors.update(injected)
            start = time.monotonic()
            try:
                generated = generate_rollouts(policy, healthy, exp.sampling, template)
            except Exception as e:  # the attempt of these trials failed: retry them
                errors.update(dict.fromkeys((r.trial_id for r in healthy), e))
            else:
                if time.monotonic() - start > self.limits.timeout_s:
                    late = TimeoutError(f"generating {len(healthy)} rollouts took longer than {self.limits.timeout_s} s")
                    errors.update(dict.fromkeys((r.trial_id for r in healthy), late))
                else:
                    done.update((g.trial_id, g) for g in generated)
                    for g in generated:
                        on_done(g)
            pending = [r for r in pending if r.trial_id not in done]
        return [done.get(r.trial_id) or TrialFailed(trial_id=r.trial_id, error=repr(errors[r.trial_id])) for r in requests]


class SessionSlot:
    """The trainer session of a range: opened by the first step that trains (cached steps never open
    one), replaced when its workers stopped on their own, closed at the end of the range and on any
    failure of a step (the next attempt opens a new one, which loads the last stored weights)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.current: TrainerSession | None = None
        self.opened = 0

    def get(self, open_session: Callable[[int], TrainerSession]) -> TrainerSession:
        with self.lock:
            if self.current is not None and not self.current.alive():
                self.close()
            if self.current is None:
                self.current = open_session(self.opened)
                self.opened += 1
                counters.bump("trainer_sessions")
            return self.current

    def close(self, grace_s: float = 60.0) -> None:
        with self.lock:
            current, self.current = self.current, None
        if current is not None:
            current.close(grace_s)


def _behavior_inputs(behavior: dict[str, bytes] | None, folder: Path) -> dict[str, str]:
    """A job's behavior checkpoint (written into the step's folder) and its hash; nothing without one."""
    if behavior is None:
        return {}
    return {
        "behavior_checkpoint": str(save_checkpoint(folder / "behavior", behavior)),
        "behavior_hash": checkpoint_hash(behavior),
    }


@dataclass(frozen=True)
class LMTrainer:
    """One GRPO update through the trainer entrypoint: in this process when neither `launch` nor
    `pods` is set; `nproc_per_node` torchrun workers on this machine; or `nproc_per_node` torchrun
    workers in each pod of a `PodJob` placed by `pods`.

    With `trainer.session: range` (the default) the workers on this machine (`start`) or the pods
    (`pods.start`) live for the range: started by the first step that trains, they take step after
    step (`lm.session`) and are stopped by `close()`. With `session: step` every update is a launch
    of its own (`launch`, `pods.run`) that loads the model afresh."""

    limits: Limits = Limits(max_retries=0, timeout_s=3600.0, max_concurrency=1)
    launch: Launch | None = None
    start: Start | None = None
    nproc_per_node: int = 1
    threads_per_process: int = 1
    workdir: Path | None = None
    pods: PodLauncher | None = None
    memory: TrainerStateSlot = field(default_factory=TrainerStateSlot, compare=False, repr=False)  # the in-process trainer's
    sessions: SessionSlot = field(default_factory=SessionSlot, compare=False, repr=False)
    log: list[dict[str, float]] = field(default_factory=list, compare=False, repr=False)  # per update: wall and worker timings

    def train(
        self,
        exp: LMExperiment,
        previous: dict[str, bytes],
        rollouts: list[LMRollout],
        rewards: list[LMReward],
        reference: dict[str, bytes] | None = None,
        old_logp: OldLogp = "sampler",
        behavior: dict[str, bytes] | None = None,
    ) -> tuple[dict[str, bytes], TrainMetrics]:
        """One update from `previous`; `reference`: the KL term's reference adapter (None: the base);
        `old_logp`: the ratio's old policy (`lm.trainer.train_step`); `behavior`: the weights that
        sampled stale rollouts, whose log-probs the trainer recomputes (`grpo.mismatch`)."""
        if self.workdir is not None:
            self.workdir.mkdir(parents=True, exist_ok=True)
        step = rollouts[0].step if rollouts else 0

        def attempt(n: int) -> tuple[dict[str, bytes], TrainMetrics]:
            counters.bump("train_calls")
            start = time.perf_counter()
            if self.in_session(exp):
                files, metrics, timings = self._in_session(exp, step, previous, rollouts, rewards, reference, old_logp, behavior)
            else:
                with tempfile.TemporaryDirectory(prefix="dagster-rl-train-", dir=self.workdir) as tmp:
                    files, metrics, timings = self._run(
                        exp, step, previous, rollouts, rewards, reference, old_logp, behavior, Path(tmp)
                    )
            self.log.append({"wall_s": time.perf_counter() - start, **timings})
            return files, metrics

        return with_retries("training", attempt, self.limits.max_retries, self.limits.timeout_s)

    def in_session(self, exp: LMExperiment) -> bool:
        return exp.trainer.session == "range" and (self.pods is not None or self.start is not None)

    def close(self) -> None:
        """End the range's session, if one was opened (its workers stop, its folder is removed)."""
        self.sessions.close()

    def _job(self, exp, step: int, batch: Path, output: Path, **inputs) -> TrainJob:
        return TrainJob(
            policy=exp.policy,
            device=exp.policy.device,
            grpo=exp.grpo,
            batch=str(batch),
            output_dir=str(output),
            step=step,
            **inputs,
        )

    def _run(
        self, exp, step, previous, rollouts, rewards, reference, old_logp, behavior, tmp: Path
    ) -> tuple[dict[str, bytes], TrainMetrics, dict[str, float]]:
        (tmp / "batch.json").write_text(TrainBatch(rollouts=rollouts, rewards=rewards).model_dump_json())
        job = self._job(
            exp,
            step,
            tmp / "batch.json",
            tmp / "output",
            input_checkpoint=str(save_checkpoint(tmp / "input", previous)),
            input_hash=checkpoint_hash(previous),
            reference_checkpoint=str(save_checkpoint(tmp / "reference", reference)) if reference is not None else None,
            old_logp=old_logp,
            **_behavior_inputs(behavior, tmp),
        )
        job_path = write_job(job, tmp / "job.json")
        if self.pods is not None:
            self.pods.run(self.pod_job(exp, job_path, step))
        elif self.launch is None:
            with self.memory.lock:
                run_job(job, slot=self.memory)
        else:
            self.launch(launch_torchrun(job_path, self.nproc_per_node), self._env())
        out = tmp / "output"
        timings = json.loads((out / TIMINGS).read_text()) if (out / TIMINGS).exists() else {}
        return load_checkpoint(out / CHECKPOINT_DIR), TrainMetrics.model_validate_json((out / METRICS).read_text()), timings

    def _env(self) -> dict[str, str]:
        return {
            "OMP_NUM_THREADS": str(self.threads_per_process),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")])),
        }

    # ---- a session for the range ----------------------------------------------------------------
    def _in_session(
        self, exp, step, previous, rollouts, rewards, reference, old_logp, behavior
    ) -> tuple[dict[str, bytes], TrainMetrics, dict[str, float]]:
        try:
            return self._hand_over(exp, step, previous, rollouts, rewards, reference, old_logp, behavior)
        except SessionEnded:  # its workers stopped, idle, just before this step came: new ones take it
            return self._hand_over(exp, step, previous, rollouts, rewards, reference, old_logp, behavior)

    def _hand_over(
        self, exp, step, previous, rollouts, rewards, reference, old_logp, behavior
    ) -> tuple[dict[str, bytes], TrainMetrics, dict[str, float]]:
        """The step, through the range's session (opened now when there is none)."""
        try:
            session = self.sessions.get(lambda n: self._open(exp, step, n))
            seq, directory = session.new_step()
            (directory / "batch.json").write_text(TrainBatch(rollouts=rollouts, rewards=rewards).model_dump_json())
            input_dir, input_hash = session.input_for(previous, directory)
            ref_dir, ref_hash = session.reference_for(reference) if reference is not None else (None, None)
            job = self._job(
                exp,
                step,
                directory / "batch.json",
                directory / "output",
                input_checkpoint=str(input_dir),
                input_hash=input_hash,
                reference_checkpoint=str(ref_dir) if ref_dir is not None else None,
                reference_hash=ref_hash,
                old_logp=old_logp,
                **_behavior_inputs(behavior, directory),
            )
            files, answer = session.run(
                seq, job.model_dump_json(), directory / "output" / CHECKPOINT_DIR, self._step_timeout(exp)
            )
        except BaseException:
            # a failed step, a dead session, a deadline, an interrupt, workers that stopped idle: the
            # session is ended; the next attempt starts new workers, which load the last stored weights
            self.sessions.close(grace_s=0)
            raise
        return files, answer.metrics, answer.timings

    def _step_timeout(self, exp: LMExperiment) -> float:
        """How long the driver waits for a step's answer: the environment's time limit, and on
        Kubernetes the experiment's `active_deadline_s` (per step, as a per-step Job's deadline)."""
        if self.pods is not None:
            return min(self.limits.timeout_s, float(exp.trainer.active_deadline_s))
        return self.limits.timeout_s

    def _open(self, exp: LMExperiment, step: int, number: int) -> TrainerSession:
        """Start the workers of a session on a new folder (on the pods' shared storage for `k8s`)."""
        t = exp.trainer
        parent = self.pods.workdir if self.pods is not None else self.workdir
        if parent is not None:
            Path(parent).mkdir(parents=True, exist_ok=True)
        owner = identity() if self.pods is None else None  # pods cannot see this process: they stop when idle
        folder = create_folder(
            parent, SessionSpec(device=exp.policy.device, idle_timeout_s=t.session_idle_timeout_s, owner=owner)
        )
        try:
            if self.pods is not None:
                workers = self.pods.start(self.pod_job(exp, folder, step, session=number))
            else:
                assert self.start is not None
                workers = self.start(launch_torchrun(folder, self.nproc_per_node), self._env())
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return TrainerSession(folder, workers, poll_s=0.01 if self.pods is None else 0.1)

    def pod_job(self, exp: LMExperiment, job_path: Path, step: int, session: int | None = None) -> PodJob:
        """The set of pods of one update (or of a session, `session` = its number in the run):
        torchrun on each, node rank = the pod's completion index, static rendezvous at pod 0 (its
        DNS name, from the Job's headless Service). A session's Job lives for the range: its
        deadline is the backstop of a whole range (`active_deadline_s` per step, `n_steps` steps);
        the driver holds each step to `active_deadline_s` itself."""
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
            name=f"{exp.name}-s{step:04d}" + (f"-{session}" if session else ""),
            nodes=t.nodes,
            command=tuple(command),
            env={"OMP_NUM_THREADS": str(self.threads_per_process)},
            resources=t.pods,
            max_restarts=t.max_restarts,
            active_deadline_s=t.active_deadline_s if session is None else t.active_deadline_s * exp.n_steps,
        )
