"""The lines the driver writes for the console: a step's end, an asset's numbers, a warm-up running."""

from dagster import AssetKey

from dagster_rl.core.experiment import step_key
from dagster_rl.core.task import StepResult


def warming_up(key: AssetKey) -> str:
    """What the console says while a warm-up runs (computed once, then read from the artifact store)."""
    return f"{key.to_user_string()}: warming up"


def progress_line(result: StepResult, seconds: float) -> str:
    """The one line a step ends with: `step 0003  24/24 trials  mean reward 2.331  cache miss  0.41 s`."""
    caches = set(result.cache.values())
    cache = caches.pop() if len(caches) == 1 else ", ".join(f"{a} {c}" for a, c in result.cache.items())
    notes = []
    if result.skipped_trials:
        notes.append(f"{len(result.skipped_trials)} trials failed, a re-run attempts them again")
    if result.recovered_trials:
        notes.append(f"{len(result.recovered_trials)} formerly failed trials recovered")
    tail = f"  ({'; '.join(notes)})" if notes else ""
    return (
        f"step {step_key(result.step)}  {result.n_trials}/{result.n_trials_planned} trials  mean reward "
        f"{result.mean_reward:.3f}  cache {cache}  {seconds:.2f} s{tail}"
    )


def numbers_line(values: dict[str, float | int | str]) -> str:
    """`accuracy 0.76  base_accuracy 0  n_prompts 100`: an asset's numbers on one console line."""
    return "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
