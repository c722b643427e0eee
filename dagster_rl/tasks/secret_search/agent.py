"""One trial: an agent searches a private copy of a world for the secret's digest.

The agent reads documents in an order sampled from the policy's prior, annotates each document it
reads (in its own sandbox), answers with the digest when it finds it, and may leave a scratch file
behind. The sandbox is a fresh directory per trial, removed afterwards: nothing it writes reaches
the world or another trial.
"""

import random
import shutil
import tempfile
from pathlib import Path

from dagster_rl.tasks.secret_search.prior import sample_order
from dagster_rl.tasks.secret_search.records import Trajectory, TrialSpec
from dagster_rl.tasks.secret_search.world import DIGEST_PREFIX, NOTE_PREFIX, doc_name


def run_agent(
    spec: TrialSpec,
    prior: list[float],
    world_files: dict[str, bytes],
    *,
    max_turns: int,
    scratch_rate: float,
    behavior_version: int,
    sandbox_root: Path,
) -> Trajectory:
    sandbox_root.mkdir(parents=True, exist_ok=True)
    sandbox = Path(tempfile.mkdtemp(prefix=f"{spec.trial_id}-", dir=sandbox_root))
    try:
        for name, data in world_files.items():
            (sandbox / name).write_bytes(data)
        return _search(spec, prior, sandbox, set(world_files), max_turns, scratch_rate, behavior_version)
    finally:
        shutil.rmtree(sandbox, ignore_errors=True)


def _search(
    spec: TrialSpec,
    prior: list[float],
    sandbox: Path,
    world_names: set[str],
    max_turns: int,
    scratch_rate: float,
    behavior_version: int,
) -> Trajectory:
    rng = random.Random(spec.seed)
    order = sample_order(prior, max_turns, rng)
    read, answer, foreign = [], None, 0
    for doc in order:
        path = sandbox / doc_name(doc)
        lines = path.read_text().splitlines()
        read.append(doc)
        foreign += sum(1 for line in lines if line.startswith(NOTE_PREFIX))
        with path.open("a") as f:
            f.write(f"{NOTE_PREFIX}{spec.trial_id}\n")
        found = [line[len(DIGEST_PREFIX) :] for line in lines if line.startswith(DIGEST_PREFIX)]
        if found:
            answer = found[0]
            break
    if rng.random() < scratch_rate:
        (sandbox / "scratch.txt").write_text(f"{spec.trial_id} searched {read}\n")
    left = sorted(p.name for p in sandbox.iterdir() if p.name not in world_names)
    return Trajectory(
        trial_id=spec.trial_id,
        step=spec.step,
        prompt=spec.prompt,
        world_id=spec.world_id,
        seed=spec.seed,
        docs_read=read,
        answer=answer,
        turns=len(read),
        files_left=left,
        foreign_notes_seen=foreign,
        behavior_version=behavior_version,
    )
