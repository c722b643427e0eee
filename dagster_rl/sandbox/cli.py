"""`dagster-rl sandbox run FILE`: a file run in exactly the sandbox the tools use, for people who
debug their environments.

A `.py` file runs as a tool call's Python program does (its source given to the sandbox's
interpreter); any other file is copied into the episode's folder and run as a command (`./FILE`:
a script with its `#!` line). What the program printed comes out as it came (stdout on stdout,
stderr on stderr, each bounded as an observation is), then one line on stdout: `outcome: <why it
ended>`, with its exit status or signal and the time it took. The exit status is 0 whenever the
sandbox ran, whatever the program did; 1, with the reason, when no sandbox could be made.
"""

import argparse
import sys
from pathlib import Path

from pydantic import ValidationError

from dagster_rl.sandbox.bubblewrap import BubblewrapSandboxes, default_root
from dagster_rl.sandbox.calls import MAX_SOURCE_BYTES, Program, SandboxUnavailable
from dagster_rl.sandbox.limits import SandboxLimits


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="sandbox_command", required=True)
    run = sub.add_parser("run", help="run FILE in the sandbox the tools use; last line: `outcome: ...`")
    defaults = SandboxLimits()
    run.add_argument("file", type=Path, help="a .py file (run by the sandbox's Python) or a script with a #! line")
    run.add_argument("--timeout", type=float, default=defaults.cpu_s, help=f"CPU seconds (default {defaults.cpu_s:g})")
    run.add_argument(
        "--memory", type=int, default=defaults.memory_mb, help=f"MiB of address space (default {defaults.memory_mb})"
    )
    run.add_argument(
        "--wall",
        type=float,
        default=None,
        help=f"wall-clock seconds, for a program that sleeps or blocks (default: {defaults.wall_s:g}, or 4 x --timeout if more)",
    )
    run.add_argument("--python", default=BubblewrapSandboxes.python, help="the sandbox's interpreter (default %(default)s)")


def run(args: argparse.Namespace) -> None:
    path: Path = args.file
    if not path.is_file():
        sys.exit(f"dagster-rl sandbox: {path} is not a file")
    data = path.read_bytes()
    wall = args.wall if args.wall is not None else max(SandboxLimits().wall_s, 4 * args.timeout)
    try:
        limits = SandboxLimits(cpu_s=args.timeout, wall_s=wall, memory_mb=args.memory)
    except ValidationError as e:
        flags = {"cpu_s": "--timeout", "wall_s": "--wall", "memory_mb": "--memory"}
        wrong = "; ".join(f"{flags.get(str(x['loc'][0]), x['loc'][0])} {x['input']!r}: {x['msg'].lower()}" for x in e.errors())
        sys.exit(f"dagster-rl sandbox: {wrong}")
    sandboxes = BubblewrapSandboxes(default_root(), python=args.python)
    try:
        sandboxes.check()
        with sandboxes.open(path.stem) as ws:
            if path.suffix == ".py":
                if len(data) > MAX_SOURCE_BYTES:
                    sys.exit(f"dagster-rl sandbox: {path} holds {len(data)} bytes; a program may hold {MAX_SOURCE_BYTES}")
                program = Program(python=data.decode("utf-8", errors="replace"))
            else:
                ws.write(path.name, data, mode=0o755)
                program = Program(argv=(f"./{path.name}",))
            call = ws.run(program, limits)
    except SandboxUnavailable as e:
        sys.exit(f"dagster-rl sandbox: no sandbox could be made: {e}")
    sys.stdout.write(call.stdout)
    if call.stdout_cut:
        sys.stdout.write(f"\n[stdout cut: {call.stdout_cut} more bytes]\n")
    sys.stdout.flush()
    sys.stderr.write(call.stderr + (f"\n[stderr cut: {call.stderr_cut} more bytes]\n" if call.stderr_cut else ""))
    sys.stderr.flush()
    if call.stdout and not call.stdout.endswith("\n"):
        sys.stdout.write("\n")
    print(f"outcome: {call.outcome} ({', '.join([*call.details(limits), f'{call.seconds:.2f} s'])})")
    sys.stdout.flush()
