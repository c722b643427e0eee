"""A trainer session: workers that take step after step of a range, and the folder between them and
the driver.

The driver starts the workers once (`torchrun` here, an Indexed Job of pods on Kubernetes) on a
session folder, then hands them one step at a time; the workers keep the policy, the reference and
the optimizer state in memory between steps (`worker.serve`). The folder, on storage both sides
read at the same path (on Kubernetes the shared volume of the job folders):

    owner                 the host and identity (pid and start time) of the driver that made it: a later
                          driver on that host removes the folder once its owner is gone (a killed driver)
    session.json          what the workers need before any step (`SessionSpec`)
    jobs/<seq>.json       step `seq`'s `TrainJob`, written whole (a rename) by the driver
    results/<seq>.json    rank 0's `Answer` to it, written whole after the step's outputs
    steps/<seq>/          the step's batch, its input checkpoint when the workers may not hold it,
                          and its output (the checkpoint and metrics, as a per-step launch writes)
    references/<hash>/    the KL term's reference adapter, written once
    stop                  the driver's word to stop (the end of the range)
    ended                 why the workers stopped (rank 0, last): stopped, idle, owner gone, folder
                          gone, or `failed at step job <seq>: <error>` (the job stays unanswered)

A job names its input checkpoint and that checkpoint's hash: workers that hold that checkpoint
train from memory, others (a restarted set, a resumed range, another run's weights) load it first.
Either way the step computes the same bytes. A job without an answer is pending: restarted
workers (a whole-set restart of the pods) take it up again.
"""

import os
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dagster_rl.base.strict import Strict
from dagster_rl.runtime.lifetime import alive, identity
from dagster_rl.runtime.workers import Workers, WorkersGone
from dagster_rl.tasks.lm.model.policy import checkpoint_hash, load_checkpoint, save_checkpoint
from dagster_rl.tasks.lm.train.trainer import TrainMetrics

SPEC, JOBS, RESULTS, STEPS, REFERENCES, STOP, ENDED = "session.json", "jobs", "results", "steps", "references", "stop", "ended"
OWNER = "owner"  # `<host> <pid>:<start time>` of the driver that made the folder


class SessionSpec(Strict):
    device: str = "auto"  # policy.device: the process group's backend and each rank's GPU depend on it
    idle_timeout_s: float  # the workers stop when no job came for this long
    owner: str | None = None  # `lifetime.identity()` of the driver when it runs on this machine: the workers stop once it is gone
    poll_s: float = 0.01  # how often rank 0 looks for the next job
    keepalive_s: float = 60.0  # rank 0 wakes the other ranks this often while it waits (collectives time out)


class Answer(Strict):
    """Rank 0's answer to a job, once the step's outputs are written: its metrics and the hash of
    the checkpoint it wrote. (A step that failed has no answer: see `ended`.)"""

    seq: int
    step: int | None = None
    metrics: TrainMetrics
    checkpoint_hash: str
    from_memory: bool = False  # the workers held the input checkpoint: nothing was loaded
    timings: dict[str, float] = {}


def seq_name(seq: int) -> str:
    return f"{seq:06d}.json"


def write_whole(path: Path, text: str) -> None:
    """Write `path` so that a reader sees all of it or nothing (a rename over the final name)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def pending_jobs(folder: Path) -> list[int]:
    """Jobs without an answer, oldest first."""
    answered = {p.name for p in (folder / RESULTS).glob("*.json")}
    return sorted(int(p.stem) for p in (folder / JOBS).glob("*.json") if p.name not in answered)


def last_answered(folder: Path) -> int:
    return max((int(p.stem) for p in (folder / RESULTS).glob("*.json")), default=0)


PREFIX = "dagster-rl-session-"


def create_folder(parent: Path | None, spec: SessionSpec) -> Path:
    """A new session folder under `parent` (default: the temp dir), owned by this process (its
    `OWNER` file: host and `lifetime.identity()`), after removing the folders there whose owner, on
    this host, is gone: a driver that was killed (SIGKILL) could not remove its own."""
    where = Path(parent) if parent is not None else Path(tempfile.gettempdir())
    remove_orphans(where)
    folder = Path(tempfile.mkdtemp(prefix=PREFIX, dir=where))
    write_whole(folder / OWNER, f"{socket.gethostname()} {identity()}")
    for sub in (JOBS, RESULTS, STEPS, REFERENCES):
        (folder / sub).mkdir()
    write_whole(folder / SPEC, spec.model_dump_json())
    return folder


def remove_orphans(parent: Path) -> list[Path]:
    """Remove the session folders in `parent` whose owner ran on this host and is gone; return them.
    A folder without an owner file, or owned on another host (a shared volume), is left alone."""
    removed = []
    host = socket.gethostname()
    for folder in parent.glob(f"{PREFIX}*"):
        try:
            owner_host, _, owner = (folder / OWNER).read_text().strip().partition(" ")
        except OSError:
            continue
        try:
            gone = owner_host == host and not alive(owner)
        except ValueError:  # not an identity: not a folder this code made
            continue
        if gone:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


class SessionEnded(WorkersGone):
    """The workers stopped on their own before they answered (idle, or told to): not the step's fault."""


class StepFailed(RuntimeError):
    """A step's answer does not match what the workers wrote."""


@dataclass
class TrainerSession:
    """The driver's side of one session: its folder and its workers."""

    folder: Path
    workers: Workers
    poll_s: float = 0.01
    seq: int = 0
    last_output: tuple[str, Path] | None = None  # (hash, folder) of the checkpoint the last step wrote
    last_files: dict[str, bytes] | None = None  # and its files as `run` returned them
    references: dict[str, Path] = field(default_factory=dict)

    def new_step(self) -> tuple[int, Path]:
        self.seq += 1
        directory = self.folder / STEPS / f"{self.seq:06d}"
        directory.mkdir(parents=True)
        return self.seq, directory

    def input_for(self, checkpoint: dict[str, bytes], directory: Path) -> tuple[Path, str]:
        """Where the workers find the step's input checkpoint, and its hash: the last step's output
        when it is that checkpoint (the store kept what the workers wrote), else a copy written now.
        The very bytes the last step returned are known without hashing them again."""
        last = self.last_files
        same = last is not None and checkpoint.keys() == last.keys() and all(checkpoint[k] is last[k] for k in last)
        digest = self.last_output[0] if same and self.last_output is not None else checkpoint_hash(checkpoint)
        if self.last_output is not None and self.last_output[0] == digest and self.last_output[1].is_dir():
            return self.last_output[1], digest
        return save_checkpoint(directory / "input", checkpoint), digest

    def reference_for(self, checkpoint: dict[str, bytes]) -> tuple[Path, str]:
        digest = checkpoint_hash(checkpoint)
        if digest not in self.references:
            tmp = save_checkpoint(self.folder / REFERENCES / f".{digest}.tmp", checkpoint)
            os.replace(tmp, self.folder / REFERENCES / digest)
            self.references[digest] = self.folder / REFERENCES / digest
        return self.references[digest], digest

    def run(self, seq: int, job_json: str, output: Path, timeout_s: float) -> tuple[dict[str, bytes], Answer]:
        """Hand job `seq` to the workers and wait for its answer (or their end, or the deadline);
        return the checkpoint the step wrote and the answer."""
        write_whole(self.folder / JOBS / seq_name(seq), job_json)
        answer = self._wait(seq, timeout_s)
        files = load_checkpoint(output)
        if checkpoint_hash(files) != answer.checkpoint_hash:
            raise StepFailed(
                f"the checkpoint in {output} is not the one rank 0 wrote (hash {answer.checkpoint_hash}); the shared folder lost a write"
            )
        self.last_output, self.last_files = (answer.checkpoint_hash, output), files
        self.workers.stepped()
        for old in (self.folder / STEPS).iterdir():  # inputs and outputs of earlier steps are needed no more
            if int(old.name) < seq:
                shutil.rmtree(old, ignore_errors=True)
        return files, answer

    def _wait(self, seq: int, timeout_s: float) -> Answer:
        path = self.folder / RESULTS / seq_name(seq)
        deadline = time.monotonic() + timeout_s
        while True:
            if path.exists():
                return Answer.model_validate_json(path.read_text())
            try:
                self.workers.check()
            except WorkersGone as e:
                if path.exists():  # answered, then stopped
                    return Answer.model_validate_json(path.read_text())
                ended = self.ended()
                if ended in ("idle", "stopped"):
                    raise SessionEnded(f"the trainer session's workers stopped ({ended}) before they took the step") from None
                self._note_ended(e)
                raise
            except Exception as e:  # the launcher's own (a terminated run, restarts used up)
                self._note_ended(e)
                raise
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the trainer session gave no answer to step job {seq} within {timeout_s:g} s; its workers are stopped"
                )
            time.sleep(self.poll_s)

    def _note_ended(self, error: Exception) -> None:
        """Add to the error what the workers wrote in `ended` when they failed (rank 0's exception)."""
        ended = self.ended()
        if ended and ended.startswith("failed"):
            error.add_note(f"the trainer workers {ended}")

    def ended(self) -> str | None:
        try:
            return (self.folder / ENDED).read_text().strip()
        except OSError:
            return None

    def alive(self) -> bool:
        """Whether the workers still take jobs (a session that stopped, idle, is replaced)."""
        try:
            self.workers.check()
            return True
        except WorkersGone:
            return False

    def close(self, grace_s: float) -> None:
        """Tell the workers to stop, give them `grace_s` to exit (then the launcher ends what is left),
        remove the folder."""
        try:
            write_whole(self.folder / STOP, "")
        except OSError:
            pass
        try:
            self.workers.close(grace_s)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
