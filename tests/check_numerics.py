"""`make check-numerics`: the tests marked `numerics` under each CPU kernel setting, as one table.

Different CPU kernels round the last bits of float32 differently, and training amplifies that. The
tests marked `numerics` assert only what holds for every rounding (a tolerance derived from float32,
a learning curve's rise); this runs them under torch's own choice of kernels for this CPU (`native`)
and under `ATEN_CPU_CAPABILITY=avx2` and `=default`, then prints per test and setting pass or fail
and the value each test records (`record_property`): how close it came to its bound, or how far its
curve rose. Run it first on a CPU unlike the ones the project is tested on.

    .venv/bin/python -m tests.check_numerics [--kernels native avx2 default] [pytest args...]
"""

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from tests import REPO

KERNELS = ("native", "avx2", "default")


def run(kernel: str, xml: Path, extra: list[str]) -> int:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    if kernel != "native":
        env["ATEN_CPU_CAPABILITY"] = kernel
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-m",
        "numerics",
        "-p",
        "no:cacheprovider",
        "-o",
        "junit_family=legacy",
        f"--junitxml={xml}",
        *extra,
    ]
    print(f"\n== {kernel}: {' '.join(cmd[1:])}", flush=True)
    return subprocess.run(cmd, env=env, cwd=REPO).returncode


def results(xml: Path) -> dict[str, tuple[str, str]]:
    """test id -> (pass | FAIL | skip, its recorded values)"""
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}.py::{case.get('name')}"
        status = (
            "FAIL"
            if case.find("failure") is not None or case.find("error") is not None
            else "skip"
            if case.find("skipped") is not None
            else "pass"
        )
        values = " ".join(f"{p.get('name')}={p.get('value')}" for p in case.iter("property"))
        out[name] = (status, values)
    return out


def capability(kernel: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"} | (
        {} if kernel == "native" else {"ATEN_CPU_CAPABILITY": kernel}
    )
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    args, extra = parser.parse_known_args(argv)
    table: dict[str, dict[str, tuple[str, str]]] = {}
    codes = {}
    with tempfile.TemporaryDirectory(prefix="check-numerics-") as tmp:
        for kernel in args.kernels:
            xml = Path(tmp) / f"{kernel}.xml"
            codes[kernel] = run(kernel, xml, extra)
            if not xml.exists():
                print(f"{kernel}: pytest wrote no report (exit {codes[kernel]})", file=sys.stderr)
                return codes[kernel] or 1
            for test, result in results(xml).items():
                table.setdefault(test, {})[kernel] = result
    print("\nnumerics tests by CPU kernel setting (ATEN_CPU_CAPABILITY):")
    for kernel in args.kernels:
        print(f"  {kernel}: torch uses {capability(kernel)} kernels; pytest exit {codes[kernel]}")
    for test, by_kernel in table.items():
        print(f"\n{test}")
        for kernel in args.kernels:
            status, values = by_kernel.get(kernel, ("-", ""))
            print(f"  {kernel:8} {status:5} {values}")
    failed = [(t, k) for t, by in table.items() for k, (s, _) in by.items() if s == "FAIL"]
    print(
        f"\n{len(table)} tests x {len(args.kernels)} settings: {len(failed)} failed"
        + "".join(f"\n  FAIL {k} {t}" for t, k in failed)
    )
    return 1 if failed or any(codes.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
