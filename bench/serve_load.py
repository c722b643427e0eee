"""`dagster-rl serve` under many concurrent connections: is every request answered, with its own
completion? Prints a table.

    PYTHONPATH=. .venv/bin/python bench/serve_load.py --connections 256,1024,2048 --rounds 3

Each round opens `connections` connections at once (an asyncio httpx client, one request per
connection, no reuse), each sending a completion request of builtin:tiny-qwen2 (a distinct seed, 2
tokens, one of 3 temperatures); a quarter of the requests are sent twice in the same round. A
request is *lost* when it gets no answer within --timeout; an answer is *wrong* when it breaks a
rule of `vllm_client.check_completion` or differs from the other answer of the same request (the
sampler depends on a request's seed alone, never on its batch).
"""

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dagster_rl.inference.vllm_client import ServerReplyError, ServerSampling, completion_body, parse_completion
from tests.serve_process import ServeProcess

TINY, PROMPT, VOCAB = "builtin:tiny-qwen2", [3, 9, 11, 4], 68


async def one_round(base_url: str, connections: int, timeout_s: float, seed0: int) -> dict[str, float]:
    distinct = connections - connections // 4
    requests = [(seed0 + i, 0.7 + (i % 3) / 10) for i in range(distinct)]
    requests += random.Random(seed0).sample(requests, connections - distinct)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=0)
    answers: dict[tuple, list] = {}
    lost = wrong = 0
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits, trust_env=False) as client:

        async def send(seed: int, temperature: float):
            sampling = ServerSampling(temperature, 1.0, 2, (1,))
            response = await client.post("/completions", json=completion_body(TINY, PROMPT, sampling, seed))
            response.raise_for_status()
            return parse_completion(response.json(), response.content, sampling, VOCAB, base_url)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(send(s, t) for s, t in requests), return_exceptions=True)
        wall = time.perf_counter() - t0
    for r, a in zip(requests, results, strict=True):
        if isinstance(a, ServerReplyError):
            wrong += 1
        elif isinstance(a, Exception):
            lost += 1
        else:
            answers.setdefault(r, []).append(a)
    wrong += sum(1 for got in answers.values() if any(g.token_ids != got[0].token_ids for g in got[1:]))
    return {
        "requests": connections,
        "answered": sum(len(v) for v in answers.values()),
        "lost": lost,
        "wrong": wrong,
        "wall": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--connections", default="256,1024,2048")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-batch", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d, ServeProcess(Path(d), extra=["--max-batch", str(args.max_batch)]) as server:
        for n in (int(c) for c in args.connections.split(",")):
            for r in range(args.rounds):
                row = asyncio.run(one_round(server.base_url, n, args.timeout, seed0=r * 100_000))
                rows.append((n, r, row))
                print(f"  {n} connections, round {r}: {row}", flush=True)
        log = server.log()
    print(f"\ndagster-rl serve, builtin:tiny-qwen2, --max-batch {args.max_batch}, 2 tokens a request, one request a connection\n")
    print("| connections | round | answered | lost | wrong | wall s | requests/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n, r, row in rows:
        print(f"| {n} | {r} | {row['answered']} | {row['lost']} | {row['wrong']} | {row['wall']:.1f} | {n / row['wall']:.0f} |")
    print(f"\nserver log: {log.count(' 500')} answers 500, {log.count('went away')} clients went away")


if __name__ == "__main__":
    main()
