"""`dagster-rl serve`'s command line, apart from the server so that `--help` loads no model code
(torch, peft: seconds) before it answers."""

import argparse
import os

from dagster_rl.inference.server_process import ADAPTER_ROOTS_ENV


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def port(text: str) -> int:
    """A TCP port: 1 to 65535 (uvicorn would take 70000 modulo 65536 and listen on 4464)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is from 1 to 65535, got {value}")
    return value


def existing_folder(text: str) -> str:
    """A folder that exists: an adapter root that is not there can never serve an adapter (a typo)."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is not a folder{'' if os.path.exists(text) else ' (it does not exist)'}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="a local model folder, a hub id (offline cache), or builtin:tiny-qwen2")
    parser.add_argument("--served-model-name", default=None, help="the base model's id in /v1/models (default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port, default=8000, help="1 to 65535")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--max-batch", type=positive_int, default=64, help="requests generated together at most (>= 1)")
    parser.add_argument(
        "--prefix-cache-mib",
        type=int,
        default=1024,
        metavar="MIB",
        help="memory for the KV caches of the sequences served, kept by token prefix: a request that continues one "
        "(an episode's next turn) computes only its new tokens (0: off)",
    )
    parser.add_argument(
        "--adapter-root",
        action="append",
        default=[],
        type=existing_folder,
        metavar="FOLDER",
        help=f"an existing folder adapters may be loaded from (repeatable; also ${ADAPTER_ROOTS_ENV}, folders separated by "
        f"'{os.pathsep}'); with none, no adapter can be loaded",
    )


def adapter_roots(args: argparse.Namespace) -> list[str]:
    from_env = [r for r in os.environ.get(ADAPTER_ROOTS_ENV, "").split(os.pathsep) if r]
    return [*args.adapter_root, *from_env]
