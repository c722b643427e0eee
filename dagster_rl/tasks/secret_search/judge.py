"""Verifier plus rubric: reward = verified + score."""

from dagster_rl.tasks.secret_search.experiment import Rubric, SecretSearchExperiment
from dagster_rl.tasks.secret_search.records import Reward, Trajectory
from dagster_rl.tasks.secret_search.world import secret_digest


def verify(traj: Trajectory) -> bool:
    return traj.answer is not None and traj.answer == secret_digest(traj.world_id)


def rubric_components(traj: Trajectory, verified: bool, max_turns: int) -> dict[str, float]:
    """Each in [0, 1]: correct answer; fewer turns when correct; no files left behind."""
    return {
        "correctness": 1.0 if verified else 0.0,
        "efficiency": (max_turns - traj.turns + 1) / max_turns if verified else 0.0,
        "tidiness": 0.0 if traj.files_left else 1.0,
    }


def judge(traj: Trajectory, rubric: Rubric, max_turns: int) -> Reward:
    verified = verify(traj)
    parts = rubric_components(traj, verified, max_turns)
    score = (
        rubric.correctness * parts["correctness"] + rubric.efficiency * parts["efficiency"] + rubric.tidiness * parts["tidiness"]
    )
    return Reward(
        trial_id=traj.trial_id,
        prompt=traj.prompt,
        world_id=traj.world_id,
        docs_read=traj.docs_read,
        verified=verified,
        components=parts,
        score=score,
        reward=float(verified) + score,
    )


def score(exp: SecretSearchExperiment, traj: Trajectory) -> Reward:
    """The task's in-process judge: the verifier and the experiment's rubric."""
    return judge(traj, exp.rubric, exp.task.max_turns)
