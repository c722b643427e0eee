"""`make test`: the suite as two pytest processes at once, one per core.

Most of the suite's time is spent by tests that compute in their own process: Python on one thread,
around a tiny model's small matrices (the key-completeness tests, the learning curves). On a machine
of two cores they leave the other core idle. So the suite runs in two lanes at once:

- `in_process`: the modules of `IN_PROCESS`, whose tests start no server, no sandbox and no
  `dagster-rl` process, scan no host-wide state (processes, ports) and bound no wall time; and, with
  `--numerics-default` (`.ci/run`), after them the tests marked `numerics` once more on torch's
  portable kernels (`make test-numerics-default`, which also runs alone);
- `the rest`: every other module, the servers, processes, sandboxes and timing bounds among them.

Each lane's pytest has its own exit status: the run fails when any fails, exit 5 (nothing
collected) included. The terminal shows `the rest` as it runs, then the `in_process` lane's output,
whole, when both are done. `make test-serial` runs the suite as one pytest.

    python -m tests.lanes [--numerics-default] [pytest options...]
"""

import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Modules that compute in the test's process only (see the module doc). A module that starts a
# server, a sandbox or a subprocess, or asserts a wall-clock bound, stays in the other lane.
IN_PROCESS = [
    "tests/test_agent_learning.py",
    "tests/test_agent_textarena.py",
    "tests/test_cache_keys.py",
    "tests/test_judging.py",
    "tests/test_kv_carry.py",
    "tests/test_lm_bring_your_own.py",
    "tests/test_lm_corrections.py",
    "tests/test_lm_gsm8k.py",
    "tests/test_lm_learning.py",
    "tests/test_lm_loss.py",
    "tests/test_lm_model_build.py",
    "tests/test_lm_policy.py",
    "tests/test_lm_prompts.py",
    "tests/test_lm_rollout.py",
    "tests/test_lm_sources.py",
    "tests/test_lm_trainer.py",
    "tests/test_lm_warmup.py",
    "tests/test_lm_word_problems.py",
    "tests/test_on_policy.py",
    "tests/test_store.py",
    "tests/test_tabular_math.py",
]


def lanes(options: list[str], numerics_default: bool) -> dict[str, list[tuple[list[str], dict[str, str]]]]:
    """Each lane's pytest commands, run in order, with the environment each adds."""
    pytest = [sys.executable, "-m", "pytest"]
    in_process = [([*pytest, *options, *IN_PROCESS], {})]
    if numerics_default:
        in_process.append(([*pytest, *options, "-m", "numerics"], {"ATEN_CPU_CAPABILITY": "default"}))
    rest = [([*pytest, *options, *(f"--ignore={m}" for m in IN_PROCESS)], {})]
    return {"in_process": in_process, "the rest": rest}


def main(argv: list[str]) -> int:
    numerics_default = "--numerics-default" in argv
    options = [a for a in argv if a != "--numerics-default"]
    missing = [m for m in IN_PROCESS if not (REPO / m).is_file()]
    if missing:
        print(f"tests/lanes.py: IN_PROCESS names modules that do not exist: {', '.join(missing)}", file=sys.stderr)
        return 2
    started = time.monotonic()
    plan = lanes(options, numerics_default)
    with tempfile.TemporaryDirectory(prefix="dagster-rl-lanes-") as logs:
        log = Path(logs) / "in_process.log"
        with log.open("w") as out:
            background = _start(plan["in_process"], out)
            foreground = _start(plan["the rest"], None)
            codes = {"the rest": foreground.wait(), "in_process": background.wait()}
        print(f"\n===== lane 'in_process' (exit {codes['in_process']}) =====", flush=True)
        sys.stdout.write(log.read_text())
    failed = [f"lane {name!r} exited {code}" for name, code in codes.items() if code != 0]
    print(f"\n===== 2 lanes in {time.monotonic() - started:.0f} s: {'; '.join(failed) if failed else 'both passed'} =====")
    return 1 if failed else 0


def _start(commands: list[tuple[list[str], dict[str, str]]], out) -> subprocess.Popen:
    """A lane: its commands in order in one shell, each run whatever the one before did; the shell
    exits with the status of the last that failed (0 when none did). Output to `out` (None: this terminal)."""
    lines = ["rc=0"]
    for command, env in commands:
        lines.append(" ".join([*(f"{k}={v}" for k, v in env.items()), *map(shlex.quote, command)]) + " || rc=$?")
    lines.append("exit $rc")
    return subprocess.Popen(["bash", "-c", "\n".join(lines)], cwd=REPO, stdout=out, stderr=subprocess.STDOUT if out else None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
