"""`dagster-rl`: train an experiment's steps, and what the Dagster CLI does not say directly, read
from the Dagster instance and the artifact store ($DAGSTER_HOME/artifacts unless `--artifacts`
names another fsspec URL); `dagster-rl sandbox run FILE` (a file run in the agents' sandbox); and the
subcommands tasks add (`dagster-rl serve`: a model over vLLM's OpenAI-compatible API).

`train` runs a range of steps as one run of the experiment's `<exp>_train` job of the workspace's
code location (in this process: no daemon needed; the UI shows it as a run it launched), after
checking the experiment, the range and DAGSTER_HOME, and prints the concise console
(`assets.console`). Artifacts are found by the key a materialization records, checked to be a
content key, under the store given here: metadata never becomes a path, and a moved DAGSTER_HOME
or store still works. `status`, `runs`, `lineage` and `verify` only read: a bad artifact is
reported, never moved; `verify --repair` moves the bad ones to the store's quarantine (as a run that
reads them would).

Dagster, torch and the task's heavy modules are imported by the commands that use them, so that
`--help` and `status` answer at once (`bench/cli_startup.py` measures it).
"""

import argparse
import os
import signal
import sys

from assets import REPO  # the child of `_in_own_group` imports `assets` from here
from assets.cli_inputs import quiet_closed_stdout
from assets.cli_status import cmd_runs, cmd_status
from assets.cli_train import INTERRUPTED_EXIT, checked_range, train_here
from assets.cli_verify import cmd_lineage, cmd_verify
from assets.run_tags import RESUME
from dagster_rl.base.errors import DagsterRLError
from dagster_rl.core.experiment import step_key
from dagster_rl.core.task import BUILTIN_TASKS, task_of
from dagster_rl.sandbox import cli as sandbox_cli


def cmd_train(args: argparse.Namespace) -> None:
    """Check the experiment, the range and DAGSTER_HOME; then, in a child process of a session of its
    own (`_in_own_group`), check that the steps before the range are materialized and run the range
    as one run of `<exp>_train` on the instance, in that process, with the concise console."""
    exp, first, last = checked_range(args)
    if not args.run_here:
        sys.exit(_in_own_group(["train", exp.name, f"{step_key(first)}...{step_key(last)}", "--log-level", args.log_level], args))
    train_here(exp, first, last, args.log_level)


PARENT_FD = "DAGSTER_RL_PARENT_FD"  # the child's end of a pipe to `dagster-rl train`: EOF when it is gone


def _in_own_group(argv: list[str], args: argparse.Namespace) -> int:
    """Run `dagster-rl <argv>` (the run itself) in a child process in a session of its own, and
    relay Ctrl-C, SIGTERM and SIGHUP to it as one SIGINT each; return its exit status.

    A terminal's Ctrl-C goes to every process of its foreground group: Dagster's log tails and a
    trainer's torchrun would each print their own traceback or warning. Relayed to the run's process
    alone, it is Dagster's interruption: it interrupts its step processes, which stop their
    workers, and the console says `interrupted; re-run the same range to resume`, and nothing else.
    The child interrupts itself the same way when this process dies (its end of a pipe closes), and
    kills what it started and itself when that has not ended the run within seconds."""
    import subprocess

    read_end, write_end = os.pipe()
    flags = [*(["--debug"] if args.debug else []), *(["--artifacts", args.artifacts] if args.artifacts else [])]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    child = subprocess.Popen(
        [sys.executable, "-m", "assets.cli", *flags, *argv, "--run-here"],
        env={**os.environ, PARENT_FD: str(read_end), "PYTHONPATH": path},  # the same folder and settings as this one
        pass_fds=(read_end,),
        start_new_session=True,
    )
    os.close(read_end)

    def relay(signum, frame) -> None:
        child.send_signal(signal.SIGINT)

    relayed = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {s: signal.signal(s, relay) for s in relayed}
    try:
        code = child.wait()
        return code if code >= 0 else 128 - code  # ended by a signal: as a shell reports it
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        os.close(write_end)


def _interrupt_when_parent_goes() -> None:
    """In the child of `_in_own_group`: a SIGINT to this process (Dagster's interruption) when the
    `dagster-rl train` that started it is gone, whatever ended it; and, if the run has not ended a
    few seconds later, a SIGKILL of every process it started and of itself
    (`dagster_rl.runtime.lifetime.interrupt_when_gone`)."""
    from dagster_rl.runtime.lifetime import interrupt_when_gone

    fd = os.environ.pop(PARENT_FD, "")
    if fd.isdigit():
        interrupt_when_gone(int(fd))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="dagster-rl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifacts", default="", help="the artifact store's fsspec URL (default: $DAGSTER_HOME/artifacts)")
    parser.add_argument("--debug", action="store_true", help="on an error, print its traceback too (default: its message)")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="run a range of an experiment's steps as one run on $DAGSTER_HOME's instance, a line per step (checks first)",
    )
    train.add_argument("experiment")
    train.add_argument("range", nargs="?", help="FIRST...LAST (e.g. 0008...0011) or one step (e.g. 8); default: every step")
    train.add_argument("--log-level", default="INFO", help="the console's level: INFO (a line per step) or DEBUG (every event)")
    train.add_argument("--run-here", action="store_true", help=argparse.SUPPRESS)  # the child of `_in_own_group`
    train.set_defaults(fn=cmd_train)
    status = sub.add_parser("status", help="table of every step of an experiment, read from $DAGSTER_HOME")
    status.add_argument("experiment")
    status.add_argument(
        "--all", action="store_true", help="a row for every step (default: one row for each span of steps not materialized)"
    )
    status.set_defaults(fn=cmd_status)
    runs = sub.add_parser("runs", help="an experiment's latest runs: id, status, steps, start, and a failed run's error")
    runs.add_argument("experiment")
    runs.add_argument("--limit", type=int, default=10, help="how many runs, newest first (default 10)")
    runs.set_defaults(fn=cmd_runs)
    lineage = sub.add_parser("lineage", help="trace a step's weights back to step 0 through every behavior policy")
    lineage.add_argument("experiment")
    lineage.add_argument("step", help="step number, e.g. 7 or 0007")
    lineage.add_argument("--json", action="store_true", help="everything, every trial seed included, as JSON")
    lineage.add_argument(
        "--trial",
        default=None,
        help="also one trial of the chain, e.g. s3-p0-n1: its reward and each turn (action, tool, observation); with --json, that trial alone",
    )
    lineage.set_defaults(fn=cmd_lineage)
    verify = sub.add_parser(
        "verify",
        help="re-hash every artifact of an experiment's steps, compare it with its materialization; report each bad one (exit 1)",
    )
    verify.add_argument("experiment")
    verify.add_argument(
        "--repair", action="store_true", help="move each bad artifact to the store's quarantine (nothing is deleted)"
    )
    verify.set_defaults(fn=cmd_verify)
    sandbox = sub.add_parser("sandbox", help="run a file in the sandbox the agents' tools use (`sandbox run FILE`)")
    sandbox_cli.add_arguments(sandbox)
    sandbox.set_defaults(fn=sandbox_cli.run)
    for kind in BUILTIN_TASKS:  # the tasks' own subcommands (the language models' `serve`)
        for name, command in task_of(kind).commands.items():
            cmd = sub.add_parser(name, help=command.help)
            if name in argv:  # its arguments only when it is asked for: defining them may import torch
                command.add_arguments(cmd)
            cmd.set_defaults(fn=command.run)
    args = parser.parse_args(argv)
    if getattr(args, "run_here", False):
        _interrupt_when_parent_goes()
    try:
        args.fn(args)
        sys.stdout.flush()  # here, not at exit: a reader that closed the pipe is one more case below
    except KeyboardInterrupt:
        print(RESUME if args.command == "train" else "interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)
    except BrokenPipeError:  # `dagster-rl lineage demo 7 | head`: the reader has what it wanted
        quiet_closed_stdout()
        sys.exit(0)
    except Exception as e:  # every error is one message; the traceback behind --debug
        if args.debug:
            sys.excepthook = sys.__excepthook__  # the whole traceback, whatever a code location that failed to load set
            raise
        sys.exit(one_message(e))


def one_message(error: BaseException) -> str:
    """What `dagster-rl` prints of an error: its message, which says what was wrong and what to do;
    for an error dagster-rl did not raise on purpose, its type too, and where its traceback is."""
    if isinstance(error, DagsterRLError):
        return f"dagster-rl: {error}"
    return f"dagster-rl: {type(error).__name__}: {error} (`dagster-rl --debug ...` shows the traceback)"


if __name__ == "__main__":
    main()
