"""dagster-rl: durable RL post-training as a Dagster asset pipeline.

This package holds the library: RL math, policies, rollout engines, judge, trainer and the
content-addressed artifact store. It knows nothing of Dagster assets; see `resources/` and
`assets/` for the Dagster layer.
"""
