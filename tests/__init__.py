"""The test suite. `conftest.py` sets the environment and holds the shared fixtures (with those it
registers through `pytest_plugins`); the other modules that are not `test_*.py` are helpers:

- settings: the shipped experiments' settings at the tests' sizes, written as experiment files
- harness: runs of steps through the real driver against a real Dagster instance (`Lab`), a fresh home
- cli_runs: `dagster asset materialize` and `dagster-rl train` run as processes, as at a terminal
- lm_fixtures: the language-model tests' policies, rollout batches, float32 bounds and subprocesses
- servers: a real daemon and webserver, the GraphQL client of the UI's queries (`dagster_servers`)
- postgres, instance_config: a throwaway PostgreSQL (`postgres_server`), the instances' dagster.yaml
- vllm_server, smollm2, serve_process: the real vLLM (`vllm`), SmolLM2 (`smollm2_dir`), `dagster-rl serve`
- openai_stub, bad_rollout_server: an OpenAI-compatible judge stub (`judge_on`), a proxy that corrupts replies
- fake_kubernetes, helm_chart: a Kubernetes API over local processes, the Helm chart's rules
- readonly_fs: the `readonly://` fsspec protocol (a store that cannot be written)
- machine: a free port on 127.0.0.1; a missing requirement skips the test, or fails it where CI is set
- key_completeness, check_numerics: the cache keys' completeness walk, `make check-numerics`
- lanes: `make test`, the suite as two pytest processes at once (which modules run in which lane)
- reward_fixtures: reward functions the tests name by module, and a user's reward-function file
"""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
